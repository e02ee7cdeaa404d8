"""The replica in process: the replicator's decisions (pure, an injected clock, no sleeping), its passes against a
plain-path replica (complete-or-absent publication, the ledger never shorter, retention both sides), restore
(newest verified checkpoint, fallback, refusal, an interrupted restore completed), and the bad inputs against the
real S3 server (tests/s3server.py), each one line naming the replica and the problem."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from andrea import cli
from andrea.commands.restore import restore
from andrea.config.keepers import GuardConfig
from andrea.config.schema import RunConfig
from andrea.control.guard.decisions import Guard
from andrea.control.replica import admit, owner, plan, replicator as rp
from andrea.control.guard import rollback
from andrea.rundir import checkpoint as ckpt
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.control.replica import remote as rep
from andrea.rundir.ledger import LossLedger, marker
from andrea.rundir.names import LEDGER_NAME, RESTORING_NAME, checkpoint_name, companion_path
from andrea.rundir.retention import Policy, Retention, victims
from tests.runs import andrea_records, wait_until
from tests.s3server import BUCKET, S3Server

N = 64  # parameters of the synthetic checkpoints


# --- decisions ---------------------------------------------------------------------------------------------
def test_retry_delay_doubles_and_is_capped():
    assert [plan.retry_delay(k, 1.0, 60.0) for k in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert plan.retry_delay(10**6, 0.5, 30.0) == 30.0


def test_upload_plan_is_the_newest_and_the_milestones_the_replica_lacks():
    two, every100 = Policy(keep_last=2), Policy(keep_last=2, keep_every=100)
    assert plan.upload_plan([10, 20, 30, 40], [10], two) == [40]  # 20, 30: superseded before a pass came
    assert plan.upload_plan([10, 20, 30], [10, 20, 30], two) == [] and plan.upload_plan([], [10], two) == []
    assert plan.upload_plan([100, 150, 200, 250], [250], every100) == [200, 100]  # milestones, kept for good
    assert plan.upload_plan([100, 150, 200, 250], [], every100) == [250, 200, 100]
    assert victims([10, 20, 30], two) == [10]


def test_superseded_is_what_lies_above_the_step_the_run_went_back_to():
    assert plan.superseded([10, 20, 30, 40], 20) == [30, 40]
    assert plan.superseded([10, 20], 20) == [] and plan.superseded([], 0) == []


def test_health_says_one_line_per_problem_and_one_when_back():
    h, err = plan.Health(1.0, 8.0), rep.ReplicaError("replica s3://b/p: the endpoint cannot be reached", "unreachable")
    said = [h.failed(err, now=t) for t in (0.0, 1.0, 3.0, 7.0, 15.0)]
    assert said[0] is not None and "training goes on" in said[0] and said[1:] == [None] * 4
    assert h.next_try == 15.0 + 8.0 and not h.due(22.9) and h.due(23.0)  # capped backoff, on the injected clock
    assert h.failed(rep.ReplicaError("full", "full"), 23.0) is not None  # a new problem is said
    assert h.succeeded() is not None and h.succeeded() is None and h.due(0.0)


def test_classify_names_the_problem():
    kinds = {msg: rep.classify("s3://b/p", Exception(msg)).kind for msg in
             ("<Code>NoSuchBucket</Code>", "<Code>InvalidAccessKeyId</Code>", "error sending request for url",
              "<Code>QuotaExceeded</Code>", "something else",
              "Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>",
              "Server returned non-2xx status code: 500 Internal Server Error: ",
              "Server returned non-2xx status code: 507 Insufficient Storage")}
    assert list(kinds.values()) == ["bucket", "credentials", "unreachable", "full", "other", "unavailable",
                                    "unavailable", "full"]
    assert set(rep.PASSING) == {"unreachable", "unavailable"}  # a start of a run with checkpoints trains through
    assert "\n" not in str(rep.classify("s3://b/p", Exception("a\nb\nc")))


# --- a synthetic run and a plain-path replica -------------------------------------------------------------------
def make_run(run_dir: Path, steps: list[int], seed: int = 0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text("[train]\nseed = 1\n")
    (run_dir / "tokenizer.json").write_text("{}")
    (run_dir / "data").mkdir(exist_ok=True)
    (run_dir / "data" / "arm.train.bin").write_bytes(bytes(range(256)) * 4)
    (run_dir / "data" / "manifest.json").write_text("{}")
    ledger = LossLedger(run_dir / LEDGER_NAME)
    if ledger.size == 0:
        ledger.append([{**marker("start", 0, identity={"train.seed": seed}), "time": 1000.0 + seed}])
    for step in steps:
        ledger.append([{"step": s, "loss": 1.0} for s in range(step - 9, step + 1)])
        ledger.sync()
        payload = np.random.default_rng(step).random(3 * N, dtype=np.float32)
        companion_path(run_dir, step, "ledger").write_bytes(ledger.record_bytes())
        companion_path(run_dir, step, "state").write_text("{}")
        commit_checkpoint(run_dir, step, payload)
    ledger.close()
    return run_dir


def replicator(run_dir: Path, uri: Path, **kw) -> rp.Replicator:
    policy = Policy(kw.pop("keep_last", 2), kw.pop("keep_every", 0), kw.pop("keep_best", 0))
    return rp.Replicator(str(uri), run_dir, retention=Retention(policy, kw.pop("scores", dict)), **kw)


def test_a_pass_publishes_each_checkpoint_whole_with_companions_ledger_and_files(tmp_path):
    run, remote = make_run(tmp_path / "run", [10, 20, 30]), tmp_path / "replica"
    r = replicator(run, remote)
    assert r.pass_once() and r.newest == 30 and r.protected() == [30]
    keys = {str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()}
    assert {"replica.json", "run.toml", "tokenizer.json", LEDGER_NAME, "data/manifest.json", "data/arm.train.bin",
            "step_000030.bin", "step_000030.sum.json", "step_000030.ledger.json"} <= keys
    assert "step_000020.bin" not in keys  # superseded by 30 before a pass came: the newest is what is sent
    make_run(run, [40, 50])
    assert r.pass_once() and r.newest == 50
    published = sorted(p.name for p in remote.glob("*.sum.json"))
    assert published == ["step_000030.sum.json", "step_000050.sum.json"]  # keep_last = 2: the run's retention
    for step in (30, 50):
        assert (remote / checkpoint_name(step)).read_bytes() == (run / checkpoint_name(step)).read_bytes()
    assert json.loads((run / rep.STATUS_NAME).read_text())["lag_steps"] == 0
    (remote / "step_000040.bin").write_bytes(b"an upload a kill interrupted")  # no .sum.json: never published
    assert r.pass_once() and not (remote / "step_000040.bin").exists() and r.newest == 50


def test_the_ledger_is_never_replaced_by_a_shorter_copy(tmp_path):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    assert replicator(run, remote).pass_once()
    longer = (run / LEDGER_NAME).read_bytes() + b'{"step":99,"loss":1.0}\n'
    (remote / LEDGER_NAME).write_bytes(longer)
    assert replicator(run, remote).pass_once()
    assert (remote / LEDGER_NAME).read_bytes() == longer


def test_a_checkpoint_changed_after_its_commit_is_never_published(tmp_path, caplog):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    path = run / checkpoint_name(10)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "andrea.control.replica"):
        assert not replicator(run, remote).pass_once()
    assert not (remote / checkpoint_name(10)).exists() and not (remote / "step_000010.sum.json").exists()
    assert "checksum mismatch in weights" in caplog.text and len(andrea_records(caplog)) == 1


class Flaky(rep.Replica):
    """The store, down while `down` is set: every call refuses (an in-process outage; the end-to-end test kills
    the real server)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.down = False

    def _call(self, fn, *args, **kwargs):
        if self.down:
            raise rep.ReplicaError(f"replica {self.uri}: the endpoint cannot be reached", "unreachable")
        return super()._call(fn, *args, **kwargs)


def test_an_outage_costs_one_line_backs_off_and_catches_up(tmp_path, caplog):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    now = [0.0]
    store = Flaky(str(remote))
    markers = []  # what the runtime would write to the ledger (and notify): rundir/incidents.py
    r = replicator(run, remote, replica=store, clock=lambda: now[0],
                   on_incident=lambda kind, detail: markers.append((kind, detail)))
    assert r.pass_once() and r.newest == 10
    store.down = True
    make_run(run, [20, 30])
    with caplog.at_level(logging.WARNING, "andrea.control.replica"):
        for t in (1.0, 2.0, 4.0):
            now[0] = t
            assert not r.pass_once()
        assert [rec.message.count("cannot be reached") for rec in caplog.records] == [1]
        assert r.health.next_try == 4.0 + 4.0 and r.protected() == [10]
        status = json.loads((run / rep.STATUS_NAME).read_text())
        assert status["step"] == 10 and status["lag_steps"] == 20 and "cannot be reached" in status["error"]
        store.down, now[0] = False, 8.0
        assert r.pass_once() and r.newest == 30
        assert "caught up" in caplog.records[-1].message
    assert (remote / "step_000030.sum.json").exists()  # the newest; 20 was superseded while the store was down
    # the outage and its catch-up on the record (issue 46): one marker each, however many passes failed
    assert [kind for kind, _ in markers] == ["replica_down", "replica_back"]
    down, back = markers[0][1], markers[1][1]
    assert down["problem"] == "unreachable" and "cannot be reached" in down["error"] and down["uri"] == str(remote)
    assert back == {"uri": str(remote), "down_s": 7.0, "replica_step": 30}  # first failure at 1.0, back at 8.0


def append_lines(run: Path, *lines: dict) -> None:
    led = LossLedger(run / LEDGER_NAME)
    led.append(list(lines))
    led.close()


def test_an_outage_a_process_ended_with_is_closed_by_the_next_processes_first_pass(tmp_path, caplog):
    """Campaign seed 20: the process that wrote replica_down ended before the store was back; the next one says
    the outage in its log while it lasts (no second replica_down), closes it on the record once the store answers
    (one replica_back, down since the marker), and no later process does it again. An outage of another replica
    (a changed checkpoint.replica) is not this one's to close."""
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    append_lines(run, {**marker("replica_down", 10, uri="s3://b/old", problem="unreachable", error="x"),
                       "time": 1.0},
                 {**marker("replica_down", 10, uri=str(remote), problem="unreachable", error="y"),
                  "time": time.time() - 30})
    markers, now, store = [], [0.0], Flaky(str(remote))
    store.down = True  # still down when the next process starts: said in its log, not a second time on the record
    r = replicator(run, remote, replica=store, clock=lambda: now[0],
                   on_incident=lambda kind, detail: markers.append((kind, detail)))
    with caplog.at_level(logging.WARNING, "andrea.control.replica"):
        assert not r.pass_once()
        assert [rec.message.count("cannot be reached") for rec in caplog.records] == [1] and markers == []
        store.down, now[0] = False, 10.0
        assert r.pass_once() and r.newest == 10
    assert [kind for kind, _ in markers] == ["replica_back"] and markers[0][1]["uri"] == str(remote)
    assert markers[0][1]["down_s"] >= 40 and markers[0][1]["replica_step"] == 10  # since the marker: 30 s + 10
    assert "reachable again" in caplog.records[-1].message
    append_lines(run, marker("replica_back", 10, **markers[0][1]))  # as the runtime writes it
    later = []
    assert replicator(run, remote, on_incident=lambda kind, detail: later.append(kind)).pass_once() and not later


def test_a_run_begun_again_from_step_0_claims_the_replica_of_its_earlier_start_and_no_other(s3, tmp_path, monkeypatch):
    """Campaign seed 157: a first start recorded as the replica's owner, then killed before its first checkpoint;
    the next start writes a new start marker (a new time and run id) in the same ledger, and its replica is still
    its own. A replica with published checkpoints of that earlier start, or another directory's, is refused."""
    def started(run: Path, t: float, rid: str) -> None:
        run.mkdir(parents=True, exist_ok=True)
        append_lines(run, {**marker("start", 0, identity={"train.seed": 1}, run=rid), "time": t})
    s3_env(s3, monkeypatch)
    run, remote = tmp_path / "run", f"s3://{BUCKET}/begun-again"
    started(run, 1000.0, "a" * 32)
    assert replicator(run, remote).pass_once()  # the first start's record, no checkpoint
    assert owner.read(rep.Replica(str(remote)))["run"] == "a" * 32
    started(run, 2000.0, "b" * 32)  # begun again from step 0
    admit.check_at_start(str(remote), run, has_checkpoints=False)
    make_run(run, [10])
    assert replicator(run, remote).pass_once()
    assert owner.read(rep.Replica(str(remote)))["run"] == "b" * 32
    admit.check_at_start(str(remote), run, has_checkpoints=True)  # every later start: its own
    started(run, 3000.0, "c" * 32)  # a start from 0 again, but the replica holds step 10 of "b"
    with pytest.raises(rep.ReplicaError, match="already holds another run .*checkpoints up to step 10.*restore"):
        admit.check_at_start(str(remote), run, has_checkpoints=False)
    other, empty = tmp_path / "other", f"s3://{BUCKET}/begun-elsewhere"
    started(other, 500.0, "d" * 32)
    assert replicator(other, empty).pass_once()
    with pytest.raises(rep.ReplicaError, match="another run .*no published checkpoint: .*delete its objects"):
        admit.check_at_start(str(empty), run, has_checkpoints=True)


def test_quarantine_reaches_the_replica(tmp_path):
    """A checkpoint quarantined for a checksum mismatch is the evidence of the incident: it must outlive the
    machine (issue 46), so quarantine/ goes to the replica with the run's other files."""
    run, remote = make_run(tmp_path / "run", [10, 20]), tmp_path / "replica"
    from andrea.control.run.resume import quarantine
    quarantine(run, run / checkpoint_name(20))
    assert replicator(run, remote).pass_once()
    for name in ("step_000020.bin", "step_000020.sum.json", "step_000020.ledger.json"):
        assert (remote / "quarantine" / name).read_bytes() == (run / "quarantine" / name).read_bytes()
    assert rep.published_steps(rep.Replica(str(remote)).listing()) == [10]  # evidence, never a checkpoint to restore


def test_the_abandoned_timeline_is_unpublished_and_a_step_trained_again_is_sent_again(tmp_path):
    run, remote = make_run(tmp_path / "run", [10, 20]), tmp_path / "replica"
    r = replicator(run, remote, keep_last=5)
    assert r.pass_once() and make_run(run, [30]) and r.pass_once() and r.pos.steps == [20, 30]
    abandoned = (remote / checkpoint_name(30)).read_bytes()
    rollback.drop_after(run, 20)  # a guard rollback to 20 (control/run/boundary.py): 30 is the abandoned timeline's
    rollback.write_companion(run, 20, {"incident": 30})  # and 20's guard state rewritten with its decisions
    r.supersede(20)
    assert r.pass_once() and r.pos.steps == [20] and not list(remote.glob("step_000030.*"))  # never restored
    guard = companion_path(run, 20, "guard").name
    assert (remote / guard).read_bytes() == (run / guard).read_bytes()  # a restore from 20 resumes mid-incident
    companion_path(run, 30, "state").write_text("{}")
    commit_checkpoint(run, 30, np.random.default_rng(99).random(3 * N, dtype=np.float32))  # trained again
    assert r.pass_once() and r.pos.steps == [20, 30]
    assert (remote / checkpoint_name(30)).read_bytes() == (run / checkpoint_name(30)).read_bytes() != abandoned
    rollback.drop_after(run, 10)  # a start that resumes from 10 (20 and 30 failed verification, say)
    r.supersede(10)  # control/run/runtime.py: start_for(..., resumed_from=10)
    r.supersede(20)  # two before a pass: the lower one holds
    assert r.pass_once() and r.pos.steps == [10]


def test_an_abandoned_copy_left_by_a_process_that_ended_is_replaced_at_the_next_start(tmp_path):
    run, remote = make_run(tmp_path / "run", [10, 20]), tmp_path / "replica"
    assert replicator(run, remote).pass_once()  # the replica holds 20
    rollback.drop_after(run, 10)  # a rollback to 10; its process ended before its next pass
    companion_path(run, 20, "state").write_text("{}")
    commit_checkpoint(run, 20, np.random.default_rng(99).random(3 * N, dtype=np.float32))  # 20 trained again
    r = replicator(run, remote)
    r.supersede(20)  # what start_for tells the next process: the run goes on from 20
    assert r.pass_once() and r.pos.steps == [20]
    assert (remote / checkpoint_name(20)).read_bytes() == (run / checkpoint_name(20)).read_bytes()


def test_retention_spares_the_newest_replicated_checkpoint(tmp_path):
    run = make_run(tmp_path / "run", [10, 20, 30])
    r = replicator(run, tmp_path / "replica", keep_last=5)
    r.pos.steps = [10]  # the replica holds 10 only (the store was down since)
    assert victims([10, 20, 30], Policy(keep_last=1), r.protected()) == [20]


def test_finish_waits_for_a_pass_that_covers_every_commit(tmp_path):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    r = replicator(run, remote).start()
    wait_until(lambda: r.newest == 10, 60, "the first pass")
    tid = r.thread.native_id  # the thread is niced and named for the OS (top -H; bench/replica.py counts its CPU)
    assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "andrea-replica"
    assert os.getpriority(os.PRIO_PROCESS, tid) >= rp.NICE
    make_run(run, [20])
    r.notify()
    assert r.finish(60) is True and r.newest == 20
    r.thread.join(60)
    assert not r.thread.is_alive()


def test_finish_waits_at_most_its_bound(tmp_path):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    gate = threading.Event()

    class Stuck(rep.Replica):
        def _call(self, fn, *args, **kwargs):
            gate.wait(30)
            return super()._call(fn, *args, **kwargs)
    r = replicator(run, remote, replica=Stuck(str(remote))).start()
    assert r.finish(0.3) is False  # the pass is stuck in the store: the stop goes on
    gate.set()
    r.thread.join(30)


# --- restore -----------------------------------------------------------------------------------------------
def test_restore_takes_the_newest_verified_checkpoint_and_completes_when_run_again(tmp_path, capsys):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    r = replicator(run, remote)
    assert r.pass_once() and make_run(run, [20]) and r.pass_once() and r.pos.steps == [10, 20]
    corrupt = bytearray((remote / checkpoint_name(20)).read_bytes())
    corrupt[-1] ^= 0xFF
    (remote / checkpoint_name(20)).write_bytes(bytes(corrupt))
    target = tmp_path / "restored"
    target.mkdir()
    (target / RESTORING_NAME).write_text("{}")  # an interrupted restore: completed, not refused
    (target / "run.toml").write_text("half")
    (target / "step_000030.bin.restore").write_text("an older attempt's staging file, of another checkpoint")
    assert restore(str(remote), target) == 0
    assert "restored step 10" in capsys.readouterr().out
    assert (target / checkpoint_name(10)).read_bytes() == (run / checkpoint_name(10)).read_bytes()
    assert sorted(p.name for p in target.glob("step_*")) == [f"step_000010.{k}" for k in
                                                            ("bin", "ledger.json", "state.json", "sum.json")]
    assert not (target / RESTORING_NAME).exists()
    for name in (LEDGER_NAME, "run.toml", "tokenizer.json", "data/manifest.json", "data/arm.train.bin"):
        assert (target / name).read_bytes() == (run / name).read_bytes(), name
    assert ckpt.validate(target / checkpoint_name(10), N, deep=True).checksum == ckpt.VERIFIED


def guarded_run(run_dir: Path, remote: Path, steps: list[int], good: int, keep_last: int = 5) -> rp.Replicator:
    """A run whose guard names `good` as known-good and the later checkpoints as tentative, each checkpoint
    replicated by a pass of its own (as at a real cadence)."""
    r = replicator(make_run(run_dir, []), remote, keep_last=keep_last)
    guard = Guard(GuardConfig(), good_step=good, good_path=checkpoint_name(good))
    for step in steps:
        make_run(run_dir, [step])
        if step > good:
            guard.on_checkpoint(step, checkpoint_name(step))
        rollback.write_companion(run_dir, step, guard.to_state(step))
        assert r.pass_once()
    return r


def test_the_guards_known_good_checkpoint_is_sent_and_kept_by_the_replicas_retention(tmp_path):
    one = Policy(keep_last=1)
    assert plan.upload_plan([10, 20, 30, 40], [], one, spared=[20]) == [40, 20]
    assert plan.upload_plan([10, 30, 40], [], one, spared=[20]) == [40]  # not here to send
    assert victims([10, 20, 30, 40], one, [20]) == [10, 30]
    run, remote = tmp_path / "run", tmp_path / "replica"
    r = guarded_run(run, remote, [10, 20, 30], good=10, keep_last=1)
    assert r.pos.steps == [10, 30]  # keep_last = 1, and the known-good point a rollback reads
    (remote / "step_000010.sum.json").unlink()  # unpublished meanwhile (an older version's retention)
    assert r.pass_once() and r.pos.steps == [10, 30]  # sent again


def test_keep_best_sends_and_keeps_the_best_held_out_checkpoints_in_the_replica(tmp_path):
    scores = {10: 3.0, 20: 2.0, 30: 2.5, 40: 2.9}
    best = Policy(keep_last=1, keep_best=1)
    assert plan.upload_plan([10, 20, 30, 40], [], best, scores=scores) == [40, 20]  # landed faster than a pass
    run, remote = tmp_path / "run", tmp_path / "replica"
    r = replicator(make_run(run, []), remote, keep_last=1, keep_best=1, scores=lambda: scores)
    for step in (10, 20, 30, 40):
        make_run(run, [step])
        assert r.pass_once()
    assert r.pos.steps == [20, 40]  # keep_last = 1, and the best held-out loss
    assert sorted(p.name for p in remote.glob("step_*.bin")) == ["step_000020.bin", "step_000040.bin"]


def test_restore_brings_the_checkpoints_the_guard_state_names(tmp_path, capsys):
    run, remote = tmp_path / "run", tmp_path / "replica"
    guarded_run(run, remote, [10, 20, 30, 40], good=20)
    target = tmp_path / "restored"
    assert restore(str(remote), target) == 0
    assert "restored step 40" in capsys.readouterr().out
    for step in (20, 30, 40):  # the known-good point a rollback reads, and the tentative one that may become it
        assert ckpt.validate(target / checkpoint_name(step), N, deep=True).checksum == ckpt.VERIFIED
        assert sorted(p.name for p in target.glob(f"step_{step:06d}.*")) == [
            f"step_{step:06d}.{k}" for k in ("bin", "guard.json", "ledger.json", "state.json", "sum.json")]
    assert not (target / checkpoint_name(10)).exists()  # named by nothing: not brought
    guard, warning = rollback.load_guard(RunConfig(), ckpt.validate(target / checkpoint_name(40), N), target)
    assert warning is None and guard.good["step"] == 20


def test_restore_says_in_one_line_a_known_good_checkpoint_the_replica_no_longer_holds(tmp_path, caplog):
    run, remote = tmp_path / "run", tmp_path / "replica"
    guarded_run(run, remote, [10, 20, 30, 40], good=10, keep_last=2)
    store = rep.Replica(str(remote))
    rep.remove_checkpoint(store, 10, store.listing())  # dropped by an older version's retention, or by hand
    with caplog.at_level(logging.WARNING, "andrea.restore"):
        assert restore(str(remote), tmp_path / "restored", out=open(os.devnull, "w")) == 0
    said = [r.message for r in caplog.records]
    assert len(said) == 1 and "step_000010.bin as its known-good point" in said[0], said
    assert "not in the replica" in said[0] and "known-good point becomes step_000040.bin" in said[0]
    assert sorted(p.name for p in (tmp_path / "restored").glob("step_*.bin")) == ["step_000030.bin",
                                                                                   "step_000040.bin"]


@pytest.mark.parametrize("record", [b"\xff\xfe\x00 not text", b'{"bytes": 3, "xxh3_128": "00", "last_step": 1}',
                                    b"[]"])
def test_restore_falls_back_in_one_line_past_a_damaged_ledger_record(tmp_path, caplog, capsys, record):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    r = replicator(run, remote)
    assert r.pass_once() and make_run(run, [20]) and r.pass_once()
    (remote / "step_000020.ledger.json").write_bytes(record)
    with caplog.at_level(logging.WARNING, "andrea.restore"):
        assert restore(str(remote), tmp_path / "restored") == 0
    assert "restored step 10" in capsys.readouterr().out
    assert len(andrea_records(caplog)) == 1 and "step_000020" in caplog.text and "trying an older" in caplog.text
    assert sorted(p.name for p in (tmp_path / "restored").glob("step_*")) == [
        f"step_000010.{k}" for k in ("bin", "ledger.json", "state.json", "sum.json")]


def test_restore_refuses_a_non_empty_directory_in_one_line(tmp_path, capsys):
    run, remote = make_run(tmp_path / "run", [10]), tmp_path / "replica"
    assert replicator(run, remote).pass_once()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert cli.main(["restore", str(remote), "--run-dir", str(tmp_path / "busy")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]


def s3_env(s3, monkeypatch, **changes):
    for key, value in s3.env(**changes).items():
        monkeypatch.setenv(key, value)


def test_a_replica_holding_another_run_is_refused_before_anything_is_written(s3, tmp_path, monkeypatch):
    s3_env(s3, monkeypatch)
    remote = f"s3://{BUCKET}/owned"
    assert replicator(make_run(tmp_path / "a", [10], seed=1), remote).pass_once()
    before = sorted(rep.Replica(remote).listing())
    other = make_run(tmp_path / "b", [10], seed=2)
    with pytest.raises(rep.ReplicaError, match="already holds another run"):
        admit.check_at_start(remote, other, has_checkpoints=True)
    with pytest.raises(rep.ReplicaError, match="already holds another run"):
        admit.check_at_start(remote, tmp_path / "fresh", has_checkpoints=False)
    assert not replicator(other, remote).pass_once()
    assert sorted(rep.Replica(remote).listing()) == before
    branch = make_run(tmp_path / "branch", [10], seed=1)  # the parent's start marker, then a branch marker
    ledger = LossLedger(branch / LEDGER_NAME)
    ledger.append([marker("branch", 10, parent="a")])
    ledger.close()
    with pytest.raises(rep.ReplicaError, match="already holds another run"):
        admit.check_at_start(remote, branch, has_checkpoints=True)
    rep.Replica(f"s3://{BUCKET}/junk").put("x", b"not ours")
    with pytest.raises(rep.ReplicaError, match="not an andrea replica"):
        admit.check_at_start(f"s3://{BUCKET}/junk", other, has_checkpoints=True)


def test_a_replica_on_the_runs_own_filesystem_is_refused_in_one_line():
    assert plan.placement_problem("/r/run", "/r/run", 1, 1) == "is the run directory itself"
    assert plan.placement_problem("/r/run/rep", "/r/run", 1, 1) == "is inside the run directory"
    assert plan.placement_problem("/r", "/r/run", 1, 1) == "holds the run directory"
    assert "filesystem" in plan.placement_problem("/r/rep", "/r/run", 7, 7)
    assert plan.placement_problem("/mnt/b/rep", "/r/run", 8, 7) is None
    assert plan.placement_problem("/r/run2", "/r/run", 8, 7) is None  # a sibling whose name extends the run's


def test_who_holds_a_replicas_claim():
    me = {"host": "h", "pid": 7, "run_dir": "/r/run"}
    claim = lambda **c: {"format": 1, "claimed_by": {**me, **c}}  # noqa: E731
    assert plan.claim_holder(None, me, alive=False) == "none"
    assert plan.claim_holder({"started": 5.0, "identity": {}}, me, alive=False) == "run"
    assert plan.claim_holder(claim(pid=99), me, alive=True) == "ours"  # this run directory, started again
    assert plan.claim_holder(claim(run_dir="/r/other"), me, alive=True) == "other"  # starting at this moment
    assert plan.claim_holder(claim(run_dir="/r/other"), me, alive=False) == "stale"  # a start that died
    assert plan.claim_holder(claim(host="elsewhere"), me, alive=False) == "other"  # cannot tell: another's


@pytest.mark.parametrize("where", ["run", "run/replica", "beside"])
def test_train_refuses_a_replica_on_the_runs_disk_before_writing(tmp_path, capsys, where):
    run_dir = tmp_path / "run"
    uri = str(tmp_path / where)
    rc = cli.main(["train", "--preset", "andrea-tiny", "--run-dir", str(run_dir), "--steps", "0",
                   "--set", f'checkpoint.replica="{uri}"'])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "off the run's disk" in err, err  # configuration: exit 2
    assert not run_dir.exists() and not (tmp_path / "beside").exists()


def test_a_replica_that_refuses_a_test_write_is_refused_at_start(tmp_path, capsys):
    import subprocess
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:  # a read-only filesystem: even root's writes are refused (as a read-only key's are)
        run_dir = tmp_path / "run"
        rc = cli.main(["train", "--preset", "andrea-tiny", "--run-dir", str(run_dir), "--steps", "0",
                       "--set", f'checkpoint.replica="{mount}"'])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "cannot be written" in err, err
        assert not run_dir.exists()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_key_is_refused_at_start(s3, tmp_path, monkeypatch, capsys):
    s3.add_reader("andrea-reader", "andrea-reader-secret")
    s3_env(s3, monkeypatch, AWS_ACCESS_KEY_ID="andrea-reader", AWS_SECRET_ACCESS_KEY="andrea-reader-secret")
    uri, run_dir = f"s3://{BUCKET}/read-only", tmp_path / "run"

    def reads() -> bool:
        try:
            return rep.Replica(uri).listing() is not None
        except rep.ReplicaError:
            return False
    wait_until(reads, 30, "the read-only key to be accepted")  # the server applies a new identity within a moment
    rc = cli.main(["train", "--preset", "andrea-tiny", "--run-dir", str(run_dir), "--steps", "0",
                   "--set", f'checkpoint.replica="{uri}"'])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "cannot be written" in err and uri in err, err
    assert not run_dir.exists() and "andrea-reader-secret" not in err


def test_of_two_runs_started_at_once_on_one_empty_prefix_the_second_is_refused_at_start(s3, tmp_path, monkeypatch):
    s3_env(s3, monkeypatch)
    uri = f"s3://{BUCKET}/twins"
    admit.check_at_start(uri, tmp_path / "first", has_checkpoints=False)  # not started yet: a provisional claim
    with pytest.raises(rep.ReplicaError, match="another run is starting on it"):
        admit.check_at_start(uri, tmp_path / "second", has_checkpoints=False)
    admit.check_at_start(uri, tmp_path / "first", has_checkpoints=False)  # the same run started again: its own
    first = make_run(tmp_path / "first", [10], seed=1)
    assert replicator(first, uri).pass_once()  # its first pass replaces the claim with the run's record
    assert owner.read(rep.Replica(uri))["started"] == 1001.0
    with pytest.raises(rep.ReplicaError, match="already holds another run"):
        admit.check_at_start(uri, make_run(tmp_path / "second", [10], seed=2), has_checkpoints=True)
    assert not [k for k in rep.Replica(uri).listing() if k.startswith(rep.PROBE_PREFIX)]  # test writes removed


# --- bad input against the real server, one line each -------------------------------------------------------
@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3") / "data").start()
    yield server
    server.stop()


@pytest.mark.parametrize("case, uri, env, words", [
    ("no bucket", "s3://no-such-bucket/run", {}, "the bucket does not exist"),
    ("bad key", f"s3://{BUCKET}/run", {"AWS_SECRET_ACCESS_KEY": "wrong"}, "refuses the credentials"),
    ("unreachable", f"s3://{BUCKET}/run", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "cannot be reached"),
])
def test_train_refuses_a_bad_replica_in_one_line_before_writing(s3, tmp_path, monkeypatch, capsys, case, uri, env,
                                                                words):
    for key, value in s3.env(**env).items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    rc = cli.main(["train", "--preset", "andrea-tiny", "--run-dir", str(run_dir), "--steps", "0",
                   "--set", f'checkpoint.replica="{uri}"'])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and words in err and uri in err, err
    assert "wrong" not in err and not run_dir.exists()


class Racing(rep.Replica):
    """The store while the run's retention removes the newest published checkpoint once a restore has downloaded
    its `.bin` (a slow link: minutes between the listing and its companions)."""

    def download(self, key, dest, check=None):
        n = super().download(key, dest, check)
        if key == checkpoint_name(20):
            rep.remove_checkpoint(rep.Replica(self.uri), 20, self.listing())
        return n


def test_restore_racing_the_runs_retention_falls_back_in_one_line(s3, tmp_path, monkeypatch, caplog, capsys):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    uri, run = f"s3://{BUCKET}/race", make_run(tmp_path / "run", [10])
    r = replicator(run, uri, keep_last=5)
    assert r.pass_once() and make_run(run, [20]) and r.pass_once()
    monkeypatch.setattr(rep, "Replica", Racing)
    with caplog.at_level(logging.WARNING, "andrea.restore"):
        assert restore(uri, tmp_path / "restored") == 0
    assert "restored step 10" in capsys.readouterr().out
    assert len(andrea_records(caplog)) == 1 and "removed by the run's retention" in caplog.text
    assert "\n" not in caplog.text.strip() and "Debug" not in caplog.text  # the store's own dump stays out
    assert (tmp_path / "restored" / checkpoint_name(10)).read_bytes() == (run / checkpoint_name(10)).read_bytes()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a replica that fills up mid-upload (skipped where mounting is not allowed)."""
    import subprocess
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_replica_mid_upload_is_one_line_and_loses_nothing(tmp_path, small_disk, caplog):
    run = make_run(tmp_path / "run", [10])
    big = np.random.default_rng(1).random(3 * 50_000, dtype=np.float32)  # 600 KB each: the second one does not fit
    companion_path(run, 20, "state").write_text("{}")
    commit_checkpoint(run, 20, big)
    r = replicator(run, small_disk / "replica", keep_last=5)
    assert r.pass_once() and r.newest == 20
    companion_path(run, 30, "state").write_text("{}")
    commit_checkpoint(run, 30, big)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != rep.STATUS_NAME}
    with caplog.at_level(logging.WARNING, "andrea.control.replica"):
        assert not r.pass_once() and not r.pass_once()
    assert [rec.message.count("full or over its quota") for rec in caplog.records] == [1], caplog.text
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != rep.STATUS_NAME} == before
    listing = rep.Replica(str(small_disk / "replica")).listing()
    for step in rep.published_steps(listing):  # what is published is whole
        assert listing[checkpoint_name(step)] == (run / checkpoint_name(step)).stat().st_size
    assert rep.published_steps(listing) == [20]  # 30 did not fit: not published, 20 still is


def test_without_the_extra_one_line_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "obstore.store", None)  # as if `andrea[replica]` were missing
    with pytest.raises(rep.ReplicaError, match=r"pip install -e '\.\[replica\]' from andrea's clone"):
        rep.Replica(str(tmp_path / "replica"))


def test_tensorboard_gets_the_lag(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from andrea.control.observe.tensorboard import TensorBoardLog
    tb = TensorBoardLog(tmp_path, 0, 1.0, 10)
    tb.add_replica(40, 20, 12.5)
    tb.add_replica(50, 0, 0.0)
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("replica/lag_steps")] == [(40, 20.0), (50, 0.0)]
    assert [(e.step, e.value) for e in events.Scalars("replica/lag_s")] == [(40, 12.5), (50, 0.0)]


def test_train_refuses_a_directory_with_an_interrupted_restore(tmp_path, capsys):
    target = tmp_path / "half"
    target.mkdir()
    (target / RESTORING_NAME).write_text("{}")
    assert cli.main(["train", "--preset", "andrea-tiny", "--run-dir", str(target), "--steps", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run it again" in err and [p.name for p in target.iterdir()] == [RESTORING_NAME]


def test_the_etag_is_checked_as_the_md5_of_what_was_sent():
    import hashlib
    parts = [hashlib.md5(b"a" * 10).digest(), hashlib.md5(b"b").digest()]
    multi = hashlib.md5(b"".join(parts)).hexdigest() + "-2"
    assert rep.etag_matches(f'"{multi}"', parts) and not rep.etag_matches(f'"{multi[:-1]}3"', parts)
    assert rep.etag_matches(hashlib.md5(b"b").hexdigest(), parts[1:]) and not rep.etag_matches("inode-mtime", parts)
    assert not rep.etag_matches(None, parts[:1])


class Counting(rep.Replica):
    read_backs = 0

    def chunks(self, key):
        Counting.read_backs += 1
        return super().chunks(key)


def test_s3_checks_the_etag_a_plain_path_reads_back(s3, tmp_path, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    run = make_run(tmp_path / "run", [10])
    for uri, read_backs in ((f"s3://{BUCKET}/etag", 0), (str(tmp_path / "plain"), 1)):
        Counting.read_backs = 0
        rep.upload_checkpoint(Counting(uri), run, 10, lambda: None)
        assert Counting.read_backs == read_backs, uri


def test_a_store_answering_server_errors_is_trained_through_by_a_run_with_checkpoints(tmp_path, monkeypatch):
    """A store that has just restarted, or throttles, answers 503 (or 500) to every request: a first start is
    refused in one line (nothing proves the replica can work), a run with checkpoints trains on with a warning
    and its replica catches up later, as it does for an unreachable store. It used to be refused (exit 1) like a
    store that refuses this replica for good. A loopback server plays the store."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Busy(BaseHTTPRequestHandler):
        def answer(self):
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
                           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        run = make_run(tmp_path / "run", [10])
        said = admit.check_at_start(f"s3://{BUCKET}/busy", run, has_checkpoints=True)
        assert said is not None and "server error" in said and "training goes on" in said, said
        with pytest.raises(rep.ReplicaError, match="server error") as refused:
            admit.check_at_start(f"s3://{BUCKET}/busy", tmp_path / "fresh", has_checkpoints=False)
        assert refused.value.kind == "unavailable"
    finally:
        server.shutdown()
