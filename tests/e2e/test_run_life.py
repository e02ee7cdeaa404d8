"""A run's life (docs/formats.md and operating.md): pivots offline and by SIGHUP, audit branches, compare, zombie arms.

Training runs in real processes; pivot, branch, compare, status and plot (which only read a run, or write files
and train nothing) run in-process through the same `cli.main`, saving each a torch import. The tests share one run
trained to step 40, copied per test."""

import json
import re
import shutil
import signal

import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import history, read_ledger
from tests.runs import Trainer, andrea, andrea_here, ledger, seed_data, train

EVERY = ["--checkpoint-every", "20", "--set", "sample.every=20"]
POLICY = "[policy]\nfloors = { pydoc-topics = 0.6 }\ncaps = { stdlib-code = 0.1 }\n"


@pytest.fixture(scope="module")
def at_40(prepared, tmp_path_factory):
    """One run trained to step 40 with checkpoints and samples at 20 and 40, once per module; copy it, never touch."""
    run = seed_data(prepared, tmp_path_factory.mktemp("at_40") / "run")
    result = train(run, "--steps", "40", *EVERY)
    assert result.returncode == 0, result.stderr
    return run


def copy_of(at_40, tmp_path, name="run"):
    return shutil.copytree(at_40, tmp_path / name)


def assert_pivoted(run, old_ledger: bytes, pivot_step: int, last: int):
    archived = run / "archive" / "phase-0"
    assert sorted(p.name for p in archived.iterdir()) == [".samples.json", ".state.json"]
    new_ledger = (run / ".loss.json").read_bytes()
    assert new_ledger.startswith(old_ledger)
    steps = [e["step"] for e in history(read_ledger(run / ".loss.json").entries)]
    assert steps == list(range(1, last + 1))  # no gap across the pivot
    (mark,) = [e for e in ledger(run) if e.get("event") == "pivot"]
    assert mark["step"] == pivot_step and mark["phase"] == 1 and mark["floors"] == {"pydoc-topics": 0.6}
    state = json.loads((run / ".state.json").read_text())
    assert state["phase"] == 1 and state["phase_start"] == pivot_step
    assert state["shares"]["pydoc-topics"] >= 0.6 and state["shares"]["stdlib-code"] <= 0.1


def test_offline_pivot_archives_state_and_samples_and_keeps_the_ledger(at_40, tmp_path):
    run = copy_of(at_40, tmp_path)
    old_ledger = (run / ".loss.json").read_bytes()
    (tmp_path / "p.toml").write_text(POLICY)
    result = andrea_here("pivot", str(run), "--policy", str(tmp_path / "p.toml"))
    assert result.returncode == 0, result.stderr
    assert not (run / ".state.json").exists() and not (run / ".samples.json").exists()
    resumed = train(run, "--steps", "80", *EVERY)
    assert resumed.returncode == 0, resumed.stderr
    assert_pivoted(run, old_ledger, 40, 80)


def test_infeasible_policy_is_refused_in_one_line(at_40, tmp_path):
    run = copy_of(at_40, tmp_path)
    (tmp_path / "p.toml").write_text("[policy]\nfloors = { pydoc-topics = 0.7, stdlib-code = 0.6 }\n")
    result = andrea_here("pivot", str(run), "--policy", str(tmp_path / "p.toml"))
    assert result.returncode == 2 and "floors" in result.stderr.strip().splitlines()[-1]
    assert (run / ".state.json").exists() and not (run / "archive").exists()


def test_hot_pivot_by_sighup_continues_like_an_offline_pivot(prepared, at_40, tmp_path):
    hot = seed_data(prepared, tmp_path / "hot")
    (tmp_path / "p.toml").write_text(POLICY)
    t = Trainer(hot, "--steps", "100000", *EVERY, "--set", "checkpoint.usr1='cadence'", "--set", "train.log_every=1")
    try:
        t.wait_ready()
        t.wait_for(lambda l: "step 25/" in l)
        old_ledger = (hot / ".loss.json").read_bytes()
        assert andrea_here("pivot", str(hot), "--policy", str(tmp_path / "p.toml")).returncode == 0
        line = t.wait_for(lambda l: "pivot at step" in l, 60)
        pivot_step = int(re.search(r"pivot at step (\d+)", line).group(1))
        assert pivot_step % 20 == 0
        t.wait_for(lambda l: f"step {pivot_step + 30}/" in l, 60)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(30) == 0
    finally:
        t.kill()
    assert_pivoted(hot, old_ledger[:old_ledger.rfind(b"\n") + 1], pivot_step, ckpt.list_checkpoints(hot)[-1][0])
    # The same pivot done offline at the same step continues with the same bytes.
    target = pivot_step + 20  # a cadence checkpoint the hot run wrote before its SIGTERM
    offline = copy_of(at_40, tmp_path, "offline")  # the same run to step 40 (the first cadence after step 25)
    if pivot_step > 40:  # the trainer outran the pivot command
        assert train(offline, "--steps", str(pivot_step), *EVERY).returncode == 0
    assert andrea_here("pivot", str(offline), "--policy", str(tmp_path / "p.toml")).returncode == 0
    assert train(offline, "--steps", str(target), *EVERY).returncode == 0
    name = names.checkpoint_name(target)
    assert (offline / name).read_bytes() == (hot / name).read_bytes()


def test_branch_reproduces_the_parent_or_diverges_and_compare_reports(at_40, tmp_path):
    parent = copy_of(at_40, tmp_path, "parent")
    same, other = tmp_path / "same", tmp_path / "other"
    assert andrea_here("branch", str(parent), "--step", "20", "--to", str(same)).returncode == 0
    made = andrea_here("branch", str(parent), "--step", "20", "--to", str(other), "--set", "train.lr=0.01")
    assert made.returncode == 0, made.stderr
    marks = [e for e in ledger(other) if e.get("event") == "branch"]
    assert marks[0]["step"] == 20 and marks[0]["overrides"] == ["train.lr=0.01"]
    assert max(e["step"] for e in ledger(other)) == 20
    for branch in (same, other):
        result = andrea("train", "--run-dir", str(branch), "--steps", "40")
        assert result.returncode == 0, result.stderr
    name = names.checkpoint_name(40)
    assert (same / name).read_bytes() == (parent / name).read_bytes()
    assert (other / name).read_bytes() != (parent / name).read_bytes()
    out = tmp_path / "compare.png"
    result = andrea_here("compare", str(parent), str(other), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "branch point: step 20" in result.stdout and "lower loss EMA at step 40" in result.stdout
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    itself = andrea_here("compare", str(parent), str(parent), "--out", str(tmp_path / "itself.png"))
    assert itself.returncode == 0 and "equal loss EMA at step 40" in itself.stdout, itself.stdout
    unrelated = copy_of(at_40, tmp_path, "unrelated")  # its first step's loss differs: no history in common
    lines = (unrelated / ".loss.json").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if json.loads(line).get("step") == 1 and "loss" in line)
    lines[first] = json.dumps({**json.loads(lines[first]), "loss": 99.0})
    (unrelated / ".loss.json").write_text("\n".join(lines) + "\n")
    apart = andrea_here("compare", str(parent), str(unrelated), "--out", str(tmp_path / "apart.png"))
    assert apart.returncode == 0 and "no common history" in apart.stdout and "branch point" not in apart.stdout


def test_a_branch_or_an_init_from_that_would_change_what_the_bytes_mean_is_one_line_and_writes_nothing(at_40,
                                                                                                      tmp_path):
    """An AdamW run's checkpoint carries AdamW's m and v: a branch to Muon could never start, and an --init-from into
    a Muon run would have read them as Muon's momentum. Both are refused before anything is written."""
    parent = copy_of(at_40, tmp_path, "parent")
    before = sorted(p.name for p in parent.rglob("*"))
    branch = andrea_here("branch", str(parent), "--step", "20", "--to", str(tmp_path / "b"),
                         "--set", "train.optimizer='muon'")
    fresh = tmp_path / "fresh"
    started = andrea("train", "--preset", "andrea-tiny", "--run-dir", str(fresh), "--set", "train.optimizer='muon'",
                     "--init-from", str(parent / names.checkpoint_name(20)))
    for result in (branch, started):
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert "train.optimizer from 'adamw' to 'muon'" in line and "andrea export" in line, line
    assert not (tmp_path / "b").exists() and not fresh.exists()
    assert sorted(p.name for p in parent.rglob("*")) == before


def test_status_names_the_newest_whole_checkpoint_and_the_ones_that_are_not(at_40, tmp_path):
    run = copy_of(at_40, tmp_path)
    cut = run / names.checkpoint_name(40)
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 4)  # a copy cut short
    result = andrea_here("status", str(run), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["newest_checkpoint"] == names.checkpoint_name(20) and report["not_whole"] == [cut.name]
    assert report["checkpoints"] == [names.checkpoint_name(20), cut.name]
    sampled = andrea("sample", str(run), "--prompt", "def ", "--max-new-tokens", "4")
    assert sampled.returncode == 0, sampled.stderr
    assert "skipping invalid checkpoint, taking an older one to sample" in sampled.stderr and cut.name in \
        sampled.stderr  # said, not silent


def test_a_negative_step_is_one_line(at_40, tmp_path):
    for command in (["sample", "--prompt", "x"], ["export", "--out", str(tmp_path / "never")]):
        result = andrea_here(command[0], str(at_40), "--step", "-1", *command[1:])
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == ["andrea: error: --step -1: a checkpoint's step is >= 0"]
    assert not (tmp_path / "never").exists()


def test_sample_refuses_a_negative_temperature_in_one_line(at_40):
    result = andrea_here("sample", str(at_40), "--prompt", "def ", "--temperature", "-1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["andrea: error: --temperature -1 and --max-new-tokens 100 must be "
                                                  ">= 0 (temperature 0: the most likely token)"]


def test_a_zombie_arm_is_dropped_with_a_warning(at_40, tmp_path):
    run = copy_of(at_40, tmp_path)
    result = train(run, "--steps", "50", *EVERY, "--set", "data.arms=['stdlib-code', 'pydoc-topics']")
    assert result.returncode == 0, result.stderr
    assert "dropping zombie arm 'stdlib-docstrings'" in result.stderr
    state = json.loads((run / ".state.json").read_text())
    assert set(state["shares"]) == {"stdlib-code", "pydoc-topics"}


def test_status_and_plot(at_40, tmp_path):
    run = at_40  # status and plot only read the run
    result = andrea_here("status", str(run), "--json")
    status = json.loads(result.stdout)
    assert status["step"] == 40 and status["newest_checkpoint"] == "step_000040.bin"
    assert status["phase"] == 0 and abs(sum(status["shares"].values()) - 1) < 1e-9 and status["loss_ema"] > 0
    assert status["target"] == {a: 1 / 3 for a in status["shares"]} and status["target_loss"] > 0  # policy.target
    out = tmp_path / "loss.png"
    assert andrea_here("plot", str(run), "--out", str(out)).returncode == 0 and out.read_bytes()[:4] == b"\x89PNG"
