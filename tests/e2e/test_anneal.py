"""A run without a fixed end (train.schedule = "wsd"), finished at any step: `andrea branch --anneal N` warms the
lr down over N steps from a checkpoint while the run goes on, replayed byte for byte; a polish pivot
(`andrea pivot --anneal N`) anneals the run itself, hot or offline, across a stop in its middle; `export --average
K` exports the mean of the last K checkpoints' weights. Real `python -m andrea` processes on the tiny preset."""

from __future__ import annotations

import re
import shutil
import signal
import tomllib

import numpy as np
import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import history
from tests.runs import Trainer, andrea, andrea_here, ledger, seed_data, train

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


POLICY = "[policy]\nfloors = { pydoc-topics = 0.6 }\n"


def test_a_hot_anneal_pivot_stopped_in_its_middle_ends_on_the_offline_pivots_bytes_at_min_lr(endless, tmp_path):
    """A running wsd trainer gets `pivot --anneal 8` (SIGHUP), pivots at its next cadence checkpoint P, is stopped
    by SIGTERM inside the anneal and resumed to P + 9; the same pivot done offline at P and trained through
    without a stop writes the same step_{P+9}.bin. The lr falls from the plateau's at every step of the anneal
    and the update of step P + 8 (the ledger's entry P + 9) runs at min_lr; run.toml and the marker record it."""
    (tmp_path / "p.toml").write_text(POLICY)
    hot = shutil.copytree(endless, tmp_path / "hot")
    t = Trainer(hot, "--steps", "100000", *WSD, "--set", "checkpoint.usr1='cadence'", "--set", "train.log_every=1",
                extra_env={"ANDREA_TEST_STEP_DELAY": "0.3"})
    try:
        t.wait_for(lambda l: "step 11/" in l, 90)
        made = andrea_here("pivot", str(hot), "--policy", str(tmp_path / "p.toml"), "--anneal", "8")
        assert made.returncode == 0, made.stderr
        pivot_step = int(re.search(r"pivot at step (\d+)", t.wait_for(lambda l: "pivot at step" in l, 60)).group(1))
        t.wait_for(lambda l: f"step {pivot_step + 3}/" in l, 60)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(60) == 0
    finally:
        t.kill()
    stopped = ckpt.list_checkpoints(hot)[-1][0]
    assert pivot_step < stopped < pivot_step + 8  # the stop fell inside the anneal
    end = pivot_step + 9
    assert train(hot, "--steps", str(end), *WSD).returncode == 0
    offline = shutil.copytree(endless, tmp_path / "offline")
    if pivot_step > 10:
        assert train(offline, "--steps", str(pivot_step), *WSD).returncode == 0
    done = andrea_here("pivot", str(offline), "--policy", str(tmp_path / "p.toml"), "--anneal", "8")
    assert done.returncode == 0 and f"by step {pivot_step + 8}" in done.stdout, done.stderr
    assert train(offline, "--steps", str(end), *WSD).returncode == 0
    name = names.checkpoint_name(end)
    assert (hot / name).read_bytes() == (offline / name).read_bytes()
    for run in (hot, offline):
        recorded = tomllib.loads((run / names.CONFIG_NAME).read_text())["train"]
        assert (recorded["anneal_at"], recorded["anneal_steps"]) == (pivot_step, 8)
        (mark,) = [e for e in ledger(run) if e.get("event") == "pivot"]
        assert mark["anneal"] == {"at": pivot_step, "steps": 8}
        lr = {e["step"]: e["lr"] for e in history(ledger(run)) if "event" not in e}
        assert lr[5] == lr[pivot_step] == lr[pivot_step + 1]  # the plateau up to the pivot's own step
        assert all(lr[s + 1] < lr[s] for s in range(pivot_step + 1, end))
        assert lr[end] == 3e-4  # andrea-tiny's min_lr, the warmdown's floor


def test_a_second_anneal_pivot_is_refused_in_one_line_and_changes_nothing(endless, tmp_path):
    run = shutil.copytree(endless, tmp_path / "run")
    (tmp_path / "p.toml").write_text(POLICY)
    assert andrea_here("pivot", str(run), "--policy", str(tmp_path / "p.toml"), "--anneal", "4").returncode == 0
    before = (run / names.CONFIG_NAME).read_bytes(), (run / ".loss.json").read_bytes()
    again = andrea_here("pivot", str(run), "--policy", str(tmp_path / "p.toml"), "--anneal", "4")
    assert again.returncode == 2 and "anneals already from step 10 over 4 steps" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert ((run / names.CONFIG_NAME).read_bytes(), (run / ".loss.json").read_bytes()) == before
