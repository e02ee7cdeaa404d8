"""SIGKILL anywhere: chains of real trainers killed at seeded random moments, checked after every kill.

Each chain: start (or resume) → SIGKILL at a random moment → check the invariants (tests/faults/harness.py) →
restart → … ANDREA_FAULT_KILLS times in all (split over the chains), then one clean resume to step F and a
never-killed reference run with the same arguments to F: the final checkpoints must be byte-identical and every
ledger entry either run ever wrote must equal the reference's for that step.

Kill moments (chosen per segment by a seeded RNG, so a failure reproduces from its seed: a chain's first seven kills
meet each kind once, in a seeded order; later ones are weighted draws):
    startup        at a random time after spawn: imports, lock, ledger open, checkpoint load, data load (resume)
    first-steps    just after `ready`: the first steps after a resume
    steps          anywhere in training (with a small cadence this often lands in a commit or a ledger flush)
    ledger-append  the moment `.loss.json` grows (an append just landed; its fsync may not have)
    commit-tmp     the moment a `step_N.bin.tmp` appears (the temporary file is being written)
    commit-rename  the moment a new `step_N.bin` appears (after the rename: directory fsync, retention pending)
    commit-window  inside ANDREA_TEST_COMMIT_DELAY: the `.tmp` is complete and fsynced, the rename not yet done
Chain A checkpoints every 5 steps with the default retention; chain B every 12 steps with keep_last=2, so
retention deletes files while kills land.
"""

from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import history, read_ledger
from tests.faults.conftest import FAULT_KILLS
from tests.faults.harness import (REPORT, check_ledger, checkpoint_problems, newest_committed, pause, sigkill,
                                  stale_tmp, step_entries, wait_for_path, has_name)
from tests.runs import Trainer, seed_data, train

BIG = 10_000_000  # the kill segments' --steps: never reached
COMMIT_DELAY = 0.25
MODES = {"startup": 3, "first-steps": 2, "steps": 3, "ledger-append": 2, "commit-tmp": 2, "commit-rename": 2,
         "commit-window": 3}


@dataclass
class Chain:
    name: str
    args: list[str]
    seed: int
    kills: int
    run_dir: Path | None = None
    trials: int = 0
    kills_done: int = 0
    failures: list[str] = field(default_factory=list)  # invariant violations (each also in REPORT)
    crashes: list[str] = field(default_factory=list)
    resume_mismatches: list[str] = field(default_factory=list)
    final_step: int = 0
    final_rc: int | None = None
    final_stderr: str = ""
    reference: Path | None = None
    reference_rc: int | None = None
    written: dict[int, list[dict]] = field(default_factory=dict)  # every step entry ever seen, by step


CHAINS = [
    Chain("A", ["--checkpoint-every", "5"], seed=20240601, kills=(FAULT_KILLS + 1) // 2),
    Chain("B", ["--checkpoint-every", "12", "--set", "checkpoint.keep_last=2"], seed=20240602,
          kills=FAULT_KILLS // 2),
]


def _ready_step(t: Trainer) -> int | None:
    line = next((l for l in t.lines if l.startswith("ready ")), None)
    m = re.search(r" step=(\d+)", line or "")
    return int(m.group(1)) if m else None


def _wait_ready(t: Trainer, timeout: float = 60) -> bool:
    try:
        t.wait_ready(timeout)
        return True
    except (AssertionError, TimeoutError):
        return False


def _kill_at(mode: str, t: Trainer, run_dir: Path, rng: random.Random) -> None:
    """Block until the chosen moment, then SIGKILL (returns at once if the trainer already exited)."""
    proc = t.proc
    if mode == "startup":
        pause(proc, rng.uniform(0.0, 2.4))
    elif not _wait_ready(t):
        return
    elif mode == "first-steps":
        pause(proc, rng.uniform(0.0, 0.08))
    elif mode == "steps":
        pause(proc, rng.uniform(0.05, 0.6))
    elif mode == "ledger-append":
        ledger = run_dir / ".loss.json"
        for _ in range(rng.randint(1, 4)):
            size = ledger.stat().st_size if ledger.exists() else 0
            wait_for_path(lambda: ledger.exists() and ledger.stat().st_size != size, proc, 10)
    elif mode == "commit-tmp":
        wait_for_path(lambda: has_name(run_dir, "step_", ".bin.tmp"), proc, 10, interval=0.0005)
    elif mode == "commit-rename":
        before = frozenset(os.listdir(run_dir))
        wait_for_path(lambda: has_name(run_dir, "step_", ".bin", before), proc, 10, interval=0.0005)
    elif mode == "commit-window":
        if wait_for_path(lambda: has_name(run_dir, "step_", ".bin.tmp"), proc, 10):
            pause(proc, rng.uniform(0.0, COMMIT_DELAY))
    sigkill(proc)


def _check_after_kill(chain: Chain, n: int, label: str) -> None:
    run_dir = chain.run_dir
    problems = checkpoint_problems(run_dir, n)
    committed = newest_committed(run_dir)
    led = check_ledger(run_dir, committed)
    with REPORT.lock:
        REPORT.torn_checkpoints += [f"{label}: {p}" for p in problems]
        REPORT.torn_ledger_tails += int(led.torn_tail)
        if led.broken:
            REPORT.broken_ledger_lines.append(f"{label}: {led.broken}")
        REPORT.lost_ledger_lines += len(led.lost)
        REPORT.doubled_ledger_lines += len(led.doubled)
    chain.failures += [f"{label}: torn checkpoint: {p}" for p in problems]
    if led.broken:
        chain.failures.append(f"{label}: ledger: {led.broken}")
    if led.lost:
        chain.failures.append(f"{label}: ledger lost steps {led.lost[:10]} (newest checkpoint {committed})")
    if led.doubled:
        chain.failures.append(f"{label}: history() holds steps twice: {led.doubled[:10]}")
    for e in step_entries(led.entries):
        chain.written.setdefault(e["step"], []).append(e)


def run_chain(chain: Chain, template: Path, root: Path, n: int) -> Chain:
    rng = random.Random(chain.seed)
    chain.run_dir = seed_data(template, root / f"chain-{chain.name}")
    modes, weights = list(MODES), list(MODES.values())
    unmet = rng.sample(modes, len(modes))  # each kind of moment once, in a seeded order, before the weighted draws
    while chain.kills_done < chain.kills:
        mode = unmet.pop() if unmet else rng.choices(modes, weights)[0]
        label = f"chain {chain.name} seed {chain.seed} trial {chain.trials} ({mode})"
        expected = newest_committed(chain.run_dir)
        env = {"ANDREA_TEST_COMMIT_DELAY": str(COMMIT_DELAY)} if mode == "commit-window" else None
        # a startup kill's window holds the imports: a new interpreter (every other moment comes after `ready`)
        t = Trainer(chain.run_dir, *chain.args, "--steps", str(BIG), extra_env=env, fresh=mode == "startup")
        chain.trials += 1
        with REPORT.lock:
            REPORT.trials += 1
        try:
            _kill_at(mode, t, chain.run_dir, rng)
            hit = t.proc.poll() is None or t.proc.returncode == -9
            rc = t.wait_exit(60)
        finally:
            t.kill()
        if rc == -9 and hit:
            chain.kills_done += 1
            with REPORT.lock:
                REPORT.kills[mode] += 1
        else:
            chain.crashes.append(f"{label}: exited {rc} before the kill:\n" + "\n".join(t.lines[-15:]))
            with REPORT.lock:
                REPORT.crashes.append(f"{label}: exit {rc}: {t.lines[-1] if t.lines else ''}")
            if len(chain.crashes) >= 3:
                break
        ready = _ready_step(t)
        if ready is not None:
            if ready == expected:
                with REPORT.lock:
                    REPORT.resumes_ok += 1
            else:
                chain.resume_mismatches.append(f"{label}: resumed from step {ready}, newest checkpoint was {expected}")
        _check_after_kill(chain, n, label)
    return chain


def finish_chain(chain: Chain, template: Path, root: Path) -> Chain:
    """One clean resume of the killed chain to F, and the never-killed reference run to F."""
    chain.final_step = max(newest_committed(chain.run_dir), max(chain.written, default=0)) + 7
    f = str(chain.final_step)
    chain.reference = seed_data(template, root / f"reference-{chain.name}")
    with ThreadPoolExecutor(2) as pool:
        final = pool.submit(train, chain.run_dir, *chain.args, "--steps", f, timeout=600)
        ref = pool.submit(train, chain.reference, *chain.args, "--steps", f, timeout=600)
        final, ref = final.result(), ref.result()
    chain.final_rc, chain.final_stderr = final.returncode, final.stderr[-3000:]
    chain.reference_rc = ref.returncode
    assert ref.returncode == 0, ref.stderr[-3000:]
    return chain


@pytest.fixture(scope="module")
def campaign(prepared, tmp_path_factory, n_params) -> list[Chain]:
    root = tmp_path_factory.mktemp("kill-campaign")
    with ThreadPoolExecutor(len(CHAINS)) as pool:
        chains = list(pool.map(lambda c: run_chain(c, prepared, root, n_params), CHAINS))
    with ThreadPoolExecutor(len(chains)) as pool:
        chains = list(pool.map(lambda c: finish_chain(c, prepared, root), chains))
    for c in chains:
        ours = c.run_dir / names.checkpoint_name(c.final_step)
        theirs = c.reference / names.checkpoint_name(c.final_step)
        same = ours.exists() and theirs.exists() and ours.read_bytes() == theirs.read_bytes()
        with REPORT.lock:
            REPORT.bit_identical.append(f"chain {c.name} step {c.final_step}: {'yes' if same else 'NO'}")
    return chains


def test_kill_campaign_delivers_the_requested_number_of_kills_at_every_kind_of_moment(campaign):
    assert sum(c.kills_done for c in campaign) >= FAULT_KILLS, [c.crashes for c in campaign]
    if min(c.kills for c in CHAINS) >= len(MODES):  # a chain's first kills meet every kind of moment once
        assert all(REPORT.kills[mode] >= len(CHAINS) for mode in MODES), REPORT.kills


def test_killed_trainers_never_leave_a_torn_or_invalid_checkpoint(campaign):
    torn = [f for c in campaign for f in c.failures if "torn checkpoint" in f]
    assert not torn, "\n".join(torn)


def test_killed_trainers_never_break_a_ledger_line_before_the_last(campaign):
    broken = [f for c in campaign for f in c.failures if ": ledger: " in f]
    assert not broken, "\n".join(broken)


def test_no_ledger_entry_at_or_before_the_newest_checkpoint_is_lost_or_doubled_by_a_kill(campaign):
    lost = [f for c in campaign for f in c.failures if "ledger lost" in f or "twice" in f]
    assert not lost, "\n".join(lost[:20])


def test_every_killed_run_restarts_and_resumes_from_its_newest_checkpoint(campaign):
    for c in campaign:
        assert not c.crashes, "\n\n".join(c.crashes)
        assert not c.resume_mismatches, "\n".join(c.resume_mismatches)
        assert c.final_rc == 0, c.final_stderr


def test_resumed_after_every_kill_the_final_checkpoint_is_byte_identical_to_a_never_killed_run(campaign):
    for c in campaign:
        name = names.checkpoint_name(c.final_step)
        ours, theirs = c.run_dir / name, c.reference / name
        assert ours.exists(), f"chain {c.name}: {name} missing after the final resume:\n{c.final_stderr}"
        assert ours.read_bytes() == theirs.read_bytes(), f"chain {c.name}: {name} differs from the never-killed run"
        for _, path in ckpt.list_checkpoints(c.run_dir):  # every retained checkpoint both runs hold
            other = c.reference / path.name
            if other.exists():
                assert path.read_bytes() == other.read_bytes(), f"chain {c.name}: {path.name} differs"


def test_every_ledger_entry_any_killed_trainer_wrote_equals_the_never_killed_runs(campaign):
    keys = ("loss", "lr", "grad_norm", "tokens", "phase")
    for c in campaign:
        reference = {e["step"]: e for e in history(read_ledger(c.reference / ".loss.json").entries)}
        final = history(read_ledger(c.run_dir / ".loss.json").entries)
        assert {e["step"] for e in final} == set(range(1, c.final_step + 1))  # doubling: the test above
        for e in final:
            c.written.setdefault(e["step"], []).append(e)
        diffs = [f"step {s}: {[{k: w[k] for k in keys} for w in ws]} vs {({k: reference[s][k] for k in keys})}"
                 for s, ws in sorted(c.written.items()) if s in reference
                 for w in ws if any(w[k] != reference[s][k] for k in keys)]
        assert not diffs, f"chain {c.name}: " + "\n".join(diffs[:10])
        assert not stale_tmp(c.run_dir), stale_tmp(c.run_dir)


def test_a_run_killed_in_the_commit_of_its_first_checkpoint_restarts_without_doubling_its_ledger(prepared, tmp_path,
                                                                                                 n_params):
    """Deterministic repro of the campaign's "history() holds steps twice" finding.

    The commit of step 12 fsyncs ledger entries 1..12 before the rename; a SIGKILL in the commit window leaves
    those entries with no checkpoint, so the restart begins again at step 0 and appends a second step 1..12
    after a `start` marker. `history()` supersedes entries only at `resume`/`branch` markers, so the run's
    history holds steps 1..12 twice for ever (the ledger is append-only).
    """
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--checkpoint-every", "12", "--steps", str(BIG), extra_env={"ANDREA_TEST_COMMIT_DELAY": "5"})
    try:
        t.wait_ready()
        assert wait_for_path(lambda: has_name(run, "step_000012", ".bin.tmp"), t.proc, 60)
        assert sigkill(t.proc)
        t.wait_exit(30)
    finally:
        t.kill()
    assert newest_committed(run) == 0
    result = train(run, "--checkpoint-every", "12", "--steps", "20")
    assert result.returncode == 0, result.stderr[-2000:]
    led = check_ledger(run, 20)
    assert not checkpoint_problems(run, n_params)
    assert led.broken is None and not led.lost
    assert not led.doubled, (f"history() holds steps {led.doubled[0]}..{led.doubled[-1]} twice after a restart "
                             f"from scratch (a `start` marker does not supersede the entries before it)")
