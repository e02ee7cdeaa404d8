"""The trunk end to end, through the real CLI: layout on disk, bit-exact resume, learning, bad input."""

import json
import math
import shutil

import numpy as np
import pytest

from tests.runs import andrea, andrea_here, header, ledger, seed_data, train, tree_digest


@pytest.fixture(scope="module")
def trained_to_40(prepared, tmp_path_factory):
    """Trained once per module; each test below gets its own copy (a run directory holds no path of its own)."""
    run = seed_data(prepared, tmp_path_factory.mktemp("trained") / "run")
    assert train(run, "--steps", "40", "--checkpoint-every", "20").returncode == 0
    return run


@pytest.fixture
def run_with_checkpoints(trained_to_40, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_to_40, run, symlinks=True)
    return run


@pytest.fixture(scope="module")
def straight(prepared, tmp_path_factory):
    """One uninterrupted run to step 150, evaluated every 25 steps, checkpointed every 30 (all five kept): the
    learning curve, and the bytes of step 60 that every resume must reproduce (evaluations and checkpoints, which the
    resumed runs do at other steps, never change the training)."""
    run = seed_data(prepared, tmp_path_factory.mktemp("straight") / "run")
    result = train(run, "--steps", "150", "--checkpoint-every", "30", "--set", "train.eval_every=25")
    assert result.returncode == 0, result.stderr
    return run


def test_checkpoint_on_disk_matches_info_layout(trained_to_40):
    info = json.loads(andrea_here("info", "--preset", "andrea-tiny").stdout)
    path = trained_to_40 / "step_000020.bin"
    assert path.stat().st_size == info["checkpoint_bytes"] == 8 + 12 * info["n_params"]
    assert header(path) == (20, info["n_params"])
    n = info["n_params"]
    data = np.fromfile(path, dtype="<f4", offset=8).reshape(3, n)
    assert np.count_nonzero(data[1]) > n // 2 and np.count_nonzero(data[2]) > n // 2  # m and v after 20 steps
    params = info["params"]
    assert [p["name"] for p in params[:2]] == ["wte.weight", "wpe.weight"] and params[-1]["name"] == "lm_head.weight"
    assert all(a["offset"] + math.prod(a["shape"]) == b["offset"] for a, b in zip(params, params[1:]))
    ln_f = next(p for p in params if p["name"] == "ln_f.weight")
    gain = data[0, ln_f["offset"]:ln_f["offset"] + ln_f["shape"][0]]
    assert np.allclose(gain, 1.0, atol=0.05)  # a LayerNorm gain where the layout says it is


def test_resume_is_bit_identical(straight, run_with_checkpoints):
    stopped = run_with_checkpoints  # stopped at 40, as `--steps 40 --checkpoint-every 20` stops
    assert train(stopped, "--steps", "60", "--checkpoint-every", "20").returncode == 0
    reference = (straight / "step_000060.bin").read_bytes()
    assert (stopped / "step_000060.bin").read_bytes() == reference
    # Resume from an older retained checkpoint: delete the newer ones first.
    for step in (40, 60):
        (stopped / f"step_{step:06d}.bin").unlink()
    result = train(stopped, "--steps", "60", "--checkpoint-every", "20")
    assert result.returncode == 0, result.stderr
    assert (stopped / "step_000060.bin").read_bytes() == reference
    markers = [e for e in ledger(stopped) if e.get("event") == "resume"]
    assert [m["step"] for m in markers] == [40, 20]


def test_tiny_model_learns(straight):
    evals = {e["step"]: e["val_loss"] for e in ledger(straight) if e.get("event") == "eval"}
    assert sorted(evals) == [25, 50, 75, 100, 125, 150]
    uniform = math.log(512)  # an untrained model predicts ~uniformly (6.24); 4.1 at step 150, 3.8 at 300
    assert evals[150] < uniform - 1.5, evals
    assert evals[150] < evals[25] - 0.5, evals


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("andrea: error: "), result.stderr
    return lines[-1]


def test_truncated_newest_checkpoint_falls_back_to_previous(run_with_checkpoints):
    run = run_with_checkpoints
    newest = run / "step_000040.bin"
    newest.write_bytes(newest.read_bytes()[:1000])
    result = train(run, "--steps", "30", "--checkpoint-every", "20")
    assert result.returncode == 0, result.stderr
    assert "step_000040.bin: truncated" in result.stderr
    assert [e["step"] for e in ledger(run) if e.get("event") == "resume"] == [20]
    kept = run / "quarantine" / "step_000040.bin"  # out of the run's way (it commits step 40 again), never deleted
    assert not newest.exists() and kept.stat().st_size == 1000


def test_init_from_truncated_file_is_refused(run_with_checkpoints, tmp_path):
    run = run_with_checkpoints
    bad = tmp_path / "step_000040.bin"
    bad.write_bytes((run / "step_000040.bin").read_bytes()[:-4])
    before = tree_digest(run)
    result = train(run, "--init-from", str(bad), "--steps", "50")
    assert result.returncode == 1
    assert str(bad) in error_line(result) and "truncated" in error_line(result)
    assert tree_digest(run) == before


def test_checkpoint_of_another_model_is_refused(run_with_checkpoints, prepared, tmp_path):
    run = run_with_checkpoints
    before = tree_digest(run)
    result = train(run, "--set", "model.n_layer=3", "--steps", "50")
    assert result.returncode == 2  # the run's identity: refused before any checkpoint is read
    assert "model.n_layer from 2 to 3" in error_line(result)
    assert tree_digest(run) == before
    other = seed_data(prepared, tmp_path / "other")
    result = train(other, "--init-from", str(run / "step_000040.bin"), "--set", "model.n_embd=32", "--steps", "50")
    assert result.returncode == 2 and "model.n_embd from 64 to 32" in error_line(result)  # its run's identity
    kept = tmp_path / "kept"  # the same file outside any run: its parameter count decides
    kept.mkdir()
    shutil.copy(run / "step_000040.bin", kept)
    result = train(other, "--init-from", str(kept / "step_000040.bin"), "--set", "model.n_embd=32", "--steps", "50")
    assert result.returncode == 1 and "checkpoint of another model: n_params=169728" in error_line(result)


def test_unknown_config_key_is_one_line_exit_2(run_with_checkpoints):
    run = run_with_checkpoints
    before = tree_digest(run)
    result = train(run, "--set", "train.learning_rate=0.1")
    assert result.returncode == 2 and "unknown key 'train.learning_rate'" in error_line(result)
    assert tree_digest(run) == before


def test_missing_data_path_is_one_line(tmp_path):
    result = train(tmp_path / "run", "--set", "data.sources=[{name='mine', path='/no/such/dir/*.txt'}]")
    assert result.returncode == 1
    assert "data.sources['mine'].path: no file matches '/no/such/dir/*.txt'" in error_line(result)


def test_verify_reports_each_bad_file(run_with_checkpoints):
    run = run_with_checkpoints
    assert andrea_here("verify", str(run)).returncode == 0
    (run / "step_000020.bin").write_bytes(b"\0" * 64)
    result = andrea("verify", str(run))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "step_000020.bin" in result.stderr
    assert "ok " in result.stdout and "step_000040.bin" in result.stdout


def test_sample_generates_from_a_checkpoint(run_with_checkpoints):
    result = andrea_here("sample", str(run_with_checkpoints), "--prompt", "def ", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ") and len(result.stdout.strip()) > len("def")


def test_user_arms_from_a_text_directory_and_a_token_file(tmp_path):
    texts = tmp_path / "notes"
    (texts / "sub").mkdir(parents=True)
    for i in range(6):
        (texts / "sub" / f"note{i}.md").write_text(f"Note {i}: the checkpoint is the heart of the run. " * 40)
    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 512, 20_000, dtype=np.uint16).tofile(tokens)  # nanoGPT prepare.py layout
    run = tmp_path / "run"
    sources = f"[{{name='notes', path='{texts}'}}, {{name='tok', path='{tokens}', kind='tokens'}}]"
    result = train(run, "--steps", "10", "--set", "data.arms=['pydoc-topics']", "--set", f"data.sources={sources}",
                   "--set", "policy.floors={tok=0.25, notes=0.25}")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (run / "data").iterdir()) == [
        "manifest.json", "notes.files.jsonl", "notes.plan.json", "notes.train.u16", "notes.val.u16",
        "pydoc-topics.train.u16", "pydoc-topics.val.u16"]  # the token arm is used in place, never copied
    shares = json.loads((run / ".state.json").read_text())["shares"]
    assert set(shares) == {"pydoc-topics", "notes", "tok"} and shares["tok"] >= 0.25 and shares["notes"] >= 0.25
    big = tmp_path / "big.bin"
    np.full(100, 9000, dtype=np.uint16).tofile(big)
    bad = train(tmp_path / "bad", "--steps", "1", "--set", f"data.sources=[{{name='big', path='{big}', kind='tokens'}}]")
    assert bad.returncode == 1 and f"{big}: token id 9000 does not fit model.vocab_size=512" in error_line(bad)
