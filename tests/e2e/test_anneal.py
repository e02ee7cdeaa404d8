"""A run without a fixed end (train.schedule = "wsd"), finished at any step: `andrea branch --anneal N` warms the
lr down over N steps from a checkpoint while the run goes on, replayed byte for byte; `export --average K` exports
the mean of the last K checkpoints' weights. Real `python -m andrea` processes on the tiny preset."""

from __future__ import annotations

import numpy as np
import pytest

from andrea.rundir import names
from andrea.rundir.ledger import history
from tests.runs import andrea, andrea_here, ledger, seed_data, train

WSD = ["--set", "train.schedule=wsd", "--set", "train.lr_decay_steps=100000", "--set", "train.warmdown_steps=1000",
       "--set", "train.warmup_steps=4", "--checkpoint-every", "5", "--set", "sample.every=1000",
       "--set", "train.eval_every=1000"]


@pytest.fixture(scope="module")
def endless(prepared, tmp_path_factory):
    run = seed_data(prepared, tmp_path_factory.mktemp("wsd") / "run")
    r = train(run, "--steps", "10", *WSD)
    assert r.returncode == 0, r.stderr[-4000:]
    return run


def weights(path) -> np.ndarray:
    n = int(np.frombuffer(path.read_bytes()[4:8], dtype="<i4")[0])
    return np.frombuffer(path.read_bytes(), dtype="<f4", offset=8, count=n)


def test_an_anneal_branch_warms_down_to_its_end_and_replays_byte_for_byte(endless, tmp_path):
    finals = []
    for name in ("a", "b"):
        dest = tmp_path / name
        made = andrea("branch", str(endless), "--step", "10", "--to", str(dest), "--anneal", "6")
        assert made.returncode == 0, made.stderr[-4000:]
        r = train(dest, "--steps", "16")
        assert r.returncode == 0, r.stderr[-4000:]
        finals.append((dest / names.checkpoint_name(16)).read_bytes())
    assert finals[0] == finals[1]
    lr = {e["step"]: e["lr"] for e in history(ledger(tmp_path / "a")) if "event" not in e}
    parent = {e["step"]: e["lr"] for e in history(ledger(endless)) if "event" not in e}
    assert all(lr[s] == parent[s] for s in range(1, 11))  # the run's own schedule up to the branch
    assert parent[5] == parent[10] == lr[11]  # the plateau, then the warmdown
    assert all(lr[s + 1] < lr[s] for s in range(11, 16))
    assert lr[16] == pytest.approx(3e-4 + (3e-3 - 3e-4) / 6)  # andrea-tiny's lr to min_lr: 5/6 of the way at 16


def test_anneal_is_refused_in_one_line_for_a_cosine_run(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "cosine")
    assert train(run, "--steps", "5", "--checkpoint-every", "5").returncode == 0
    r = andrea_here("branch", str(run), "--step", "5", "--to", str(tmp_path / "b"), "--anneal", "5")
    assert r.returncode == 2 and "--anneal needs train.schedule" in r.stderr and not (tmp_path / "b").exists()


def test_export_average_is_the_mean_of_the_last_k_checkpoints_weights(endless, tmp_path):
    r = andrea_here("export", str(endless), "--out", str(tmp_path / "avg"), "--format", "npz", "--average", "2")
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "avg" / "model.npz") as npz:
        got = np.concatenate([npz[k].ravel() for k in npz.files])
    five, ten = (weights(endless / names.checkpoint_name(s)) for s in (5, 10))
    assert np.array_equal(got, ((five.astype(np.float64) + ten) / 2).astype(np.float32))
    assert not np.array_equal(got, ten)
    many = andrea_here("export", str(endless), "--out", str(tmp_path / "many"), "--average", "9")
    assert many.returncode != 0 and "--average 9" in many.stderr and not (tmp_path / "many").exists()
