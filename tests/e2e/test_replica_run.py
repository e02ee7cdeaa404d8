"""End to end against a real S3 server (SeaweedFS, tests/s3server.py), real trainer processes, no mock of the store:
a run replicates; the store is killed mid-run and training goes on; it comes back and the replica catches up; a
SIGKILL of the trainer mid-upload leaves no partial object visible; the run directory is deleted, and `restore`
then `train` end with the bytes of a reference run that never stopped (same machine, OMP_NUM_THREADS=1)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time

import pytest

from andrea.rundir import checkpoint as ckpt, checksum
from andrea.control.replica import remote as rep
from andrea.rundir.names import LEDGER_NAME, checkpoint_name
from tests.notices import Inbox
from tests.runs import Trainer, andrea, andrea_here, seed_data, train, wait_until
from tests.s3server import BUCKET, S3Server

EVERY = ["--checkpoint-every", "5", "--set", "sample.every=1000", "--set", "train.eval_every=1000"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3") / "data").start()
    yield server
    server.stop()


def published(line: str) -> int | None:
    m = re.search(r"replica \S+: step (\d+) published", line)
    return int(m.group(1)) if m else None


def committed(line: str) -> int | None:
    m = re.search(r"checkpoint step_(\d+)\.bin committed", line)
    return int(m.group(1)) if m else None


def test_replicate_survive_an_outage_and_a_kill_then_restore_to_the_same_bytes(s3, prepared, tmp_path):
    uri = f"s3://{BUCKET}/e2e"
    replica_flag = ["--set", f'checkpoint.replica="{uri}"']
    run = seed_data(prepared, tmp_path / "run")
    # 0.1 s a step: the test waits on the store's uploads, outage and restart, and every step trained meanwhile
    # is trained again by the reference run (the kill came at step ~155 at 0.03 s a step, ~65 at 0.1 s: the
    # test's runs train ~170 steps in all instead of ~350)
    slow = {**s3.env(), "ANDREA_TEST_STEP_DELAY": "0.1", "ANDREA_TEST_REPLICA_DELAY": "0.5",
            "ANDREA_TEST_REPLICA_BACKOFF": "0.25"}
    inbox = Inbox()  # the operator's webhook: the outage and the catch-up reach it as notices (issue 46)
    p1 = Trainer(run, "--steps", "100000", *EVERY, *replica_flag, "--set", f'notify.url="{inbox.url}"',
                 extra_env=slow)
    try:
        first = published(p1.wait_for(lambda l: published(l) is not None, 120))
        s3.kill()  # the store dies mid-run
        down_at = committed(p1.wait_for(lambda l: (committed(l) or 0) > first, 60))
        p1.wait_for(lambda l: "cannot be reached" in l, 60)
        p1.wait_for(lambda l: (committed(l) or 0) >= down_at + 15, 60)  # training goes on without the store
        s3.start()
        p1.wait_for(lambda l: "reachable again" in l, 120)  # it comes back, the replica catches up
        wait_until(lambda: '"replica_back"' in (run / LEDGER_NAME).read_text(), 60, "the catch-up's marker")
        caught = published(p1.wait_for(lambda l: (published(l) or 0) > down_at + 15, 60))
        uploading = p1.wait_for(lambda l: re.search(rf"uploading step (\d+)", l) is not None
                                and int(l.rsplit(" ", 1)[1]) > caught, 60)
        p1.proc.kill()  # SIGKILL in the middle of an upload (each piece is held 0.5 s)
        p1.wait_exit(30)
    finally:
        p1.kill()
    out = p1.output()
    assert sum("cannot be reached" in l for l in out.splitlines()) == 1, "one warning line for the outage"
    # on the record: one marker for the outage, one for the catch-up, in the ledger and among the notices
    said = [json.loads(l) for l in (run / LEDGER_NAME).read_text().splitlines() if '"replica_' in l]  # fsynced
    assert [e["event"] for e in said] == ["replica_down", "replica_back"], said
    assert said[0]["problem"] == "unreachable" and said[0]["uri"] == uri and said[1]["down_s"] > 0
    assert inbox.wait_for("replica_down")["uri"] == uri and inbox.wait_for("replica_back")["replica_step"] >= first
    killed_step = int(uploading.rsplit(" ", 1)[1])

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        store = rep.Replica(uri)
        listing = store.listing()
        steps = rep.published_steps(listing)
        assert killed_step not in steps and caught in steps
        n = ckpt.HEADER.unpack((run / checkpoint_name(caught)).read_bytes()[:8])[1]
        for key, size in listing.items():  # every object whole: no partial checkpoint is visible
            if key.endswith(".bin"):
                assert size == ckpt.checkpoint_bytes(n), key
            elif key == LEDGER_NAME:
                assert store.get(key).endswith(b"\n")  # whole lines only
            elif key.endswith(".json"):
                json.loads(store.get(key))
        for step in steps:
            recorded = json.loads(store.get(f"step_{step:06d}.sum.json"))
            feed, finish = rep.verifier(recorded, f"step {step}")
            for piece in store.chunks(checkpoint_name(step)):
                feed(piece)
            finish()

    stop_at = (killed_step // 5 + 2) * 5
    second = train(run, "--steps", str(stop_at), *EVERY, *replica_flag, extra_env=s3.env())
    assert second.returncode == 0, second.stderr
    status = json.loads(andrea_here("status", str(run), "--json").stdout)["replica"]  # reads the run: in process
    assert (status["step"], status["lag_steps"], status["error"]) == (stop_at, 0, None)

    shutil.rmtree(run)  # the machine is lost
    restored = andrea("restore", uri, "--run-dir", str(run), extra_env=s3.env())
    assert restored.returncode == 0 and f"restored step {stop_at}" in restored.stdout, restored.stderr
    last = train(run, "--steps", str(stop_at + 10), *EVERY, *replica_flag, extra_env=s3.env())
    assert last.returncode == 0, last.stderr
    reference = seed_data(prepared, tmp_path / "reference")  # the same run, never stopped, never replicated
    assert train(reference, "--steps", str(stop_at + 10), *EVERY).returncode == 0
    final = checkpoint_name(stop_at + 10)
    assert (run / final).read_bytes() == (reference / final).read_bytes()
    assert checksum.read(run / final)["regions"] == checksum.read(reference / final)["regions"]


def test_sigterm_with_the_store_unreachable_trains_on_and_exits_0_within_the_bound(prepared, tmp_path):
    """A run with checkpoints whose store cannot be reached at its start: one warning line, training goes on; a
    SIGTERM then waits at most checkpoint.replica_wait for the replica and exits 0 with its final checkpoint."""
    run = seed_data(prepared, tmp_path / "run")
    assert train(run, "--steps", "5", *EVERY).returncode == 0
    down = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_DEFAULT_REGION": "us-east-1", "ANDREA_TEST_STEP_DELAY": "0.05"}
    p = Trainer(run, "--steps", "100000", *EVERY, "--set", f'checkpoint.replica="s3://{BUCKET}/down"',
                "--set", "checkpoint.replica_wait=2", extra_env=down)
    try:
        p.wait_ready()
        p.wait_for(lambda l: (committed(l) or 0) >= 15, 60)  # trains on
        p.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert p.wait_exit(60) == 0
        waited = time.monotonic() - t0
    finally:
        p.kill()
    out = p.output()
    assert "behind at the stop" in out and "still failing after a 2 s wait" in out and waited < 2 + 20, \
        (waited, out[-2000:])
    assert sum("cannot be reached" in line for line in out.splitlines()) == 2  # at the start, then once by the thread
    assert ckpt.validate(run / checkpoint_name(max(s for s, _ in ckpt.list_checkpoints(run))), deep=True)


def test_a_run_started_with_init_from_a_checkpoint_is_replicated_and_restored(s3, prepared, tmp_path):
    """Issue 55, hole 1: `--init-from step_N.bin` wrote only a `resume` marker, so the replicator, which claims its
    prefix with the run's `start` marker, replicated nothing and `restore` found no checkpoint. Such a start is a
    new run: its `start` marker (at step N) records the identity, the tokenizer's included, and the replica holds
    its checkpoints; `restore` brings back the newest, byte for byte. Another tokenizer is refused before the run
    directory is touched."""
    uri = f"s3://{BUCKET}/init-from"
    source = seed_data(prepared, tmp_path / "source")
    assert train(source, "--steps", "10", *EVERY).returncode == 0
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--init-from", str(source / checkpoint_name(10)), "--steps", "20", *EVERY,
              "--set", f'checkpoint.replica="{uri}"', extra_env=s3.env())
    assert r.returncode == 0, r.stderr[-3000:]
    (start,) = [e for e in map(json.loads, (run / LEDGER_NAME).read_text().splitlines()) if e.get("event") == "start"]
    assert start["step"] == 10 and start["from"] == str((source / checkpoint_name(10)).resolve())
    assert start["identity"]["tokenizer.sha256"] == json.loads((source / LEDGER_NAME).read_text().splitlines()[0]
                                                               )["identity"]["tokenizer.sha256"]
    restored = andrea("restore", uri, "--run-dir", str(tmp_path / "restored"), extra_env=s3.env())
    assert restored.returncode == 0 and "restored step 20" in restored.stdout, restored.stdout + restored.stderr
    assert (tmp_path / "restored" / checkpoint_name(20)).read_bytes() == (run / checkpoint_name(20)).read_bytes()

    other = seed_data(prepared, tmp_path / "other")  # the same tokenizer, serialised otherwise: other bytes
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(json.dumps(json.loads(tokenizer.read_text()), indent=1))
    before = sorted(p.name for p in other.iterdir())
    r = train(other, "--init-from", str(source / checkpoint_name(10)), "--steps", "20", *EVERY)
    errors = [line for line in r.stderr.splitlines() if line.startswith("andrea: error:")]
    assert r.returncode != 0 and len(errors) == 1 and "tokenizer.sha256 from" in errors[0], r.stderr[-3000:]
    assert f"data.tokenizer={source / 'tokenizer.json'}" in errors[0]
    assert sorted(p.name for p in other.iterdir()) == before
