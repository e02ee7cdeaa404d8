"""The seeded campaign of random fault sequences (bench/campaign.py; `make campaign` runs many seeds): two fixed
seeds end to end, and the seeds it found failing, kept as regressions (their replays marked slow: `make campaign`
runs them; the ones with a test of their own run in the suite).

The two seeds meet, between them, a SIGKILL, a poisoned step (the guard's rollback), a pivot, a branch, a full
disk (a tmpfs in a mount namespace: root only; otherwise the campaign skips it and says so) and a flipped bit in
the ledger, and must hold against the same commands on a perfect machine. A regression named after its seed replays
what the campaign's shrunk sequence did, with the timing that made it fail held fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runs import ROOT, Trainer, andrea_here, env, ledger, seed_data, wait_until
from tests.s3server import BUCKET, S3Server, weed_binary

SEEDS = {4: {"branch", "disk", "flip"}, 149: {"sigkill", "poison", "pivot"}}


def test_two_fixed_seeds_hold_against_the_perfect_machine(prepared, tmp_path):
    out = tmp_path / "outcomes.json"
    r = subprocess.run([sys.executable, "bench/campaign.py", "--seeds", ",".join(map(str, SEEDS)), "--shrink", "0",
                        "--template", str(prepared), "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**env(), "TMPDIR": str(tmp_path)}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    outcomes = {o["seed"]: o for o in json.loads(out.read_text())}
    assert set(outcomes) == set(SEEDS)
    for seed, kinds in SEEDS.items():
        o = outcomes[seed]
        assert o["failures"] == []
        struck = set(o["struck"]) | {s.split(":")[0] for s in o["skipped"]}
        assert kinds <= struck, (seed, o)
        assert all(s.startswith("disk:") for s in o["skipped"]), o["skipped"]  # only a missing tmpfs may skip
    assert "## Campaign: 2 sequences, 0 failing" in r.stdout and "| pivot | 1 | 1 | 0 |" in r.stdout


# Seeds the campaign found failing, kept as regression tests once mended: their shrunk sequences lost the guard's data
# offset, which lived only with the known-good checkpoint (issue 55's hole 2: now the trajectory's, kept by the
# checkpoint a start resumes from and by the ledger's rollback markers)
OFFSET_LOST = "the guard's data offset after a rollback must outlive its known-good checkpoint: "
REGRESSIONS = [
    ("24", "0,2", OFFSET_LOST + "poison@9 (rolled back to the initial state, data offset 9) -> delete@18 of "
     "step_000000.bin: the start at 18 says 'its known-good checkpoint step_000000.bin is not in ...; the guard "
     "starts afresh', reads the data from offset 0, and step 19 on differs from the perfect run "
     "(control/run/resume.py, control/guard/: issue 55's hole 2)"),
    ("156", "1,2", OFFSET_LOST + "poison@12 (rolled back to the initial state, data offset 12) -> --init-from "
     "step_000008.bin into a fresh directory, which has no step_000000.bin: the guard starts afresh with offset "
     "0, and step 9 on differs (the --init-from start path; its ledger also opens with `resume`, no `start`: "
     "issue 55's holes 1 and 2)"),
    ("64", "0,1,2", "a flipped bit in step_N.guard.json must never steer the run: sigkill@4 -> flip@6 of "
     "step_000006.guard.json -> poison@25: the start took the damaged companion as unreadable and started the guard "
     "afresh from step_000006.bin, so the rollback at 25 went to step 6 (data offset 19) where the perfect run's went "
     "to the initial state (offset 25): the companion is now sealed, and a checkpoint whose companion changed is "
     "refused by every reader, a start falling back to step_000005.bin (rundir/sidecars.py, rundir/checkpoint.py)"),
    ("15", "0,1", "the campaign's operator must move a pivoted run on under its policy: pivot@11 -> init_from@15 started "
     "the new run under the preset's policy, its bandit restarted in phase 2 where the perfect run is in phase 1 "
     "(settled step 16 on differed; before that the oracle missed the parent's pivot marker): the harness now "
     "restates the parent's [policy] with --init-from (bench/campaign_run.py), as docs/operating.md says a new run "
     "is configured by its own command line"),
    ("201", "0", "a flipped bit in the ledger's start marker is a damaged ledger, not another run: flip@5 of .loss.json "
     "turned the marker's model.n_layer into model.N_layer, and the next start's replica check refused its own "
     "replica as 'another run' (advising another prefix) before the ledger check could name the change and "
     "--accept-ledger-gap; the run id now decides ownership (control/replica/plan.py's same_run), and where the flip "
     "leaves no readable start marker, the id the newest checkpoint vouches for (control/replica/admit.py)"),
    ("201", "0,1,2", "the whole sequence, flip@5 of .loss.json -> restore@24 -> disk@26 (the flip's byte follows the "
     "start marker's time, so which field it hits varies run to run): where the flip broke the marker's line, the "
     "start with --accept-ledger-gap went on, but its checkpoints named no run, and after the restore the run was "
     "refused by its own replica as another run; the run now keeps the id its checkpoint vouches for "
     "(control/run/ledger_feed.py's vouched_run). Where the line still parsed (model.n_layer 2 -> 6), the start with "
     "the flag refused the run's own configuration as a change; a changed ledger's start marker is now no evidence "
     "of the identity, run.toml's is (control/run/identity.py's ledger_changed)"),
    ("58", "2", "a flipped bit in a checkpoint's ledger record must make it unverified: flip@25 of "
     "step_000025.ledger.json turned \"last_step\" into \"las4_step\" and verify said ok (the checksum binds only the "
     "record's hash of the ledger); the record is now sealed (rundir/ledger.py, rundir/checksum.py)"),
    ("214", "0", "every checkpoint of a 2-rank run damaged (cut@11 of the only one kept) must be one refusal line on "
     "each rank: rank 1 waited in the broadcast of rank 0's pick, and rank 0's exit broke it into a traceback; rank "
     "0's refusal now reaches every rank (control/parallel/sharing.py's leader_decides)"),
]
# found with the 2026 recipe's dimension, replayed with it (the others were drawn without it: --plain-recipe)
RECIPE_REGRESSIONS = [
    ("367", "2", "the oracle's own: a stop is a command (gpt2/adamw on wsd, init_from@32 alone): the offline event's "
     "`train --steps 32` met a guard suspicion (a spike at 31), and a checkpoint the gate holds back at a step target "
     "is an incident there (docs/operating.md), so the run rolled back from 32 where the perfect run, never stopped, "
     "rolled back from 33; the perfect run now stops where an offline event stopped the run "
     "(bench/campaign_draw.py's perfect_commands)"),
    ("400", "0,1,2", "a lost known-good point must go to the candidate the run would have confirmed first: sigkill@9 "
     "-> flip@23 of the newest .bin -> poison@24 (gpt2/adamw on wsd): the start below the quarantined 23 resumed "
     "from 18, whose companion named the known-good step 6, released when 12 was confirmed at 20; it took 18 as the "
     "known-good point and rolled back there from 24, where the run that never lost 23 rolled back to 12 (still on "
     "disk, a tentative one in 18's companion); the oldest tentative checkpoint still there is now the known-good "
     "point (control/guard/decisions.py's repoint)"),
    ("483", "0,1", "a start rank 0 alone refuses is every rank's refusal: sigterm@3 -> flip@12 of .loss.json on two "
     "ranks (gpt2/adamw): rank 0 refused the changed ledger in its one line, rank 1 went on into the step loop and "
     "its first collective, broken by rank 0's exit, ended in a traceback; rank 0's start checks (the ledger, "
     "--init-from's tokenizer, the task audit's file) now raise on every rank (control/parallel/sharing.py's "
     "leader_only)"),
]


# The replays run in `make campaign` (before its seeds), not in `make test`: each costs a sequence and its perfect
# run (20-35 s on one worker), and each defect has its focused test in the suite: seeds 24 and 156,
# tests/e2e/test_guard_run.py::test_losing_the_known_good_checkpoint_keeps_the_rollbacks_data_offset_and_lr_scale;
# seed 64, tests/unit/control/guard/test_rollback.py's sealed-companion tests; seed 15 was the harness's own; seed 201,
# tests/unit/control/replica/test_owner.py and (its whole sequence) tests/e2e/test_run_integrity.py's
# test_a_bit_flipped_in_the_start_marker_keeps_the_runs_id_and_identity_past_the_gap; seed 214, tests/unit/control/parallel/test_sharing.py; seed 58,
# tests/unit/rundir/test_checksum.py; seed 367 was the harness's own (tests/unit/bench/test_campaign_draw.py's
# perfect_commands test); seed 400, tests/unit/control/guard/test_rollback.py's oldest-tentative test; seed 483,
# tests/unit/control/run/test_ledger_feed.py's every-rank refusal.
@pytest.mark.slow
@pytest.mark.parametrize("seed,events,reason,recipe",
                         [(*r, False) for r in REGRESSIONS] + [(*r, True) for r in RECIPE_REGRESSIONS],
                         ids=[f"seed{r[0]}" for r in REGRESSIONS + RECIPE_REGRESSIONS])
def test_a_seed_the_campaign_found_failing_holds(seed, events, reason, recipe, prepared, tmp_path):
    plain = () if recipe else ("--plain-recipe",)
    r = subprocess.run([sys.executable, "bench/campaign.py", "--seed", seed, "--events", events, "--shrink", "0",
                        *plain, "--template", str(prepared)], capture_output=True, text=True, timeout=300,
                       env={**env(), "TMPDIR": str(tmp_path)}, cwd=ROOT)
    if "HARNESS ERROR" in r.stdout or "Traceback" in r.stderr:  # the campaign's own defect: a failure of the harness, not of the run
        pytest.fail(r.stdout[-3000:] + r.stderr[-3000:])
    assert r.returncode == 0, reason + "\n" + r.stdout[-3000:]


@pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS (weed)")
# seed 7 (outage@36), mended: a replica that came back while the stop waited for it (checkpoint.replica_wait) posted
# its replica_back marker to a ledger whose I/O executor had shut down: a traceback (cannot schedule new futures after
# shutdown) and no replica_back, the record ending on replica_down. The stop's wait now appends such a marker itself.
def test_seed_7_a_replica_back_during_the_stops_wait_is_on_the_record_without_a_traceback(prepared, tmp_path):
    server = S3Server(tmp_path / "s3").start()
    try:
        run = seed_data(prepared, tmp_path / "run")
        t = Trainer(run, "--device", "cpu", "--steps", "46", "--checkpoint-every", "8",
                    "--set", 'model.arch="modern"', "--set", 'train.optimizer="muon"', "--set", "train.micro_batch_size=4",
                    "--set", f'checkpoint.replica="s3://{BUCKET}/seed7"', "--set", "checkpoint.replica_wait=60",
                    "--set", "sample.every=1000000", "--set", "train.eval_every=1000000",
                    extra_env={**server.env(), "ANDREA_TEST_STEP_DELAY": "0.05", "ANDREA_TEST_REPLICA_BACKOFF": "0.2"})
        # the stop's wait ends when the store is back; a restarted weed lists its buckets before it serves their
        # objects, and on a loaded 2-core machine that took over the 20 s this wait was (CI, 2026-12-06)
        t.wait_for(lambda line: " published" in line, 120)
        server.kill()  # the outage: the next uploads fail
        t.wait_for(lambda line: "stopped at step 46" in line, 120)
        server.start()  # back while the stop waits for the replica
        assert t.wait_exit(120) == 0
        out = t.output()
        assert "replica reachable again" in out  # the sequence did what seed 7 did
        marks = [e["event"] for e in ledger(run) if "event" in e]
        assert "replica_down" in marks
        assert "Traceback" not in out, out[-3000:]
        down = max(i for i, m in enumerate(marks) if m == "replica_down")
        assert "replica_back" in marks[down:], marks  # the record ends with the replica caught up, as it is
    finally:
        server.stop()



@pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS (weed)")
# seed 20 (outage@17 -> sigterm@22; seed 179 too), mended: a process that ended with its replica down left
# replica_down as the ledger's last replica marker; the next start (the store reachable again) uploaded everything but
# never wrote replica_back (each process started as healthy, the open replica_down on the record unread), so the
# record said the replica was down for good. A start now takes an outage left open on the record as its own
# (control/replica/plan.py `open_outage`), and its first pass that reaches the store closes it.
def serves(uri: str, monkeypatch, server: S3Server) -> bool:
    """Whether the store answers a GET of the replica's owner record (a restarted weed lists its buckets before it
    serves their objects: until then a start is refused, the store answering 500)."""
    from andrea.control.replica import owner, remote
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        return owner.read(remote.Replica(uri, timeout_s=5)) is not None
    except remote.ReplicaError:
        return False


def test_seed_20_a_replica_down_left_by_one_process_is_closed_by_the_next_that_reaches_the_store(prepared, tmp_path,
                                                                                                 monkeypatch):
    server = S3Server(tmp_path / "s3").start()
    try:
        run = seed_data(prepared, tmp_path / "run")
        argv = ["--device", "cpu", "--checkpoint-every", "8", "--set", f'checkpoint.replica="s3://{BUCKET}/seed20"',
                "--set", "sample.every=1000000", "--set", "train.eval_every=1000000"]
        extra = {**server.env(), "ANDREA_TEST_STEP_DELAY": "0.05", "ANDREA_TEST_REPLICA_BACKOFF": "0.2"}
        t = Trainer(run, "--steps", "25", *argv, "--set", "checkpoint.replica_wait=2", extra_env=extra)
        t.wait_for(lambda line: " published" in line, 120)
        server.kill()  # down until this process has exited: it ends with replica_down on the record
        assert t.wait_exit(120) == 0
        server.start()
        wait_until(lambda: serves(f"s3://{BUCKET}/seed20", monkeypatch, server), 60, "the store serving objects again")
        t = Trainer(run, "--steps", "33", *argv, "--set", "checkpoint.replica_wait=30", extra_env=extra)
        assert t.wait_exit(120) == 0, t.output()[-3000:]
        assert "holds step 33" in t.output()  # the replica caught up
        marks = [e["event"] for e in ledger(run) if e.get("event", "").startswith("replica_")]
        assert marks and marks[0] == "replica_down", marks  # the sequence did what seed 20 did
        assert marks[-1] == "replica_back", marks
        report = json.loads(andrea_here("status", str(run), "--json").stdout)
        assert report["incidents"]["replica_back"] is not None and report["replica"]["error"] is None
        assert report["replica"]["step"] == 33 and not report["replica"]["lag_steps"]  # status: healthy
    finally:
        server.stop()


@pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS (weed)")
# seed 157 (sigkill during the first start; seed 167 too), mended: a first start SIGKILLed after its replicator
# recorded it as the replica's owner (replica.json's `started` = its start marker's time) and before its first
# checkpoint; the next start began again from step 0 with a new `start` marker (a new time, a new run id), and its
# own replica called it "another run": a warning, no replica, and once it had a checkpoint every later start was
# refused (exit 1, for good, advising a restore of a replica that held no checkpoint). The restart from 0 is the
# same run: the owner record of an earlier start of its run directory that published no checkpoint is claimed
# again (control/replica/plan.py `owner_verdict`).
def test_seed_157_a_run_killed_before_its_first_checkpoint_starts_again_with_its_own_replica(prepared, tmp_path,
                                                                                             monkeypatch):
    from andrea.control.replica.owner import read
    from andrea.control.replica.remote import Replica, read_status
    from andrea.rundir.checkpoint import list_checkpoints
    server = S3Server(tmp_path / "s3").start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        run = seed_data(prepared, tmp_path / "run")
        uri = f"s3://{BUCKET}/seed157"
        argv = ["--device", "cpu", "--steps", "20", "--checkpoint-every", "10", "--set", f'checkpoint.replica="{uri}"',
                "--set", "sample.every=1000000", "--set", "train.eval_every=1000000"]
        t = Trainer(run, *argv, extra_env={**server.env(), "ANDREA_TEST_STEP_DELAY": "1"})
        wait_until(lambda: (read(Replica(uri)) or {}).get("started") is not None, 120, "the replica's owner record")
        if list_checkpoints(run):
            pytest.fail("a checkpoint was committed before the kill: not seed 157's sequence")
        t.kill()
        t = Trainer(run, *argv, extra_env=server.env())
        assert t.wait_exit(120) == 0
        assert "already holds another run" not in t.output(), t.output()[-2000:]
        assert (read_status(run) or {}).get("step") == 20
        starts = [e for e in ledger(run) if e.get("event") == "start"]
        assert len(starts) == 2  # the sequence did what seed 157 did: a second start from step 0
        assert read(Replica(uri))["run"] == starts[-1]["run"]  # the replica is the run's as it goes on
        argv[argv.index("--steps") + 1] = "30"
        t = Trainer(run, *argv, extra_env=server.env())  # a later start, with checkpoints: not refused
        assert t.wait_exit(120) == 0, t.output()[-2000:]
        assert (read_status(run) or {}).get("step") == 30
    finally:
        server.stop()
