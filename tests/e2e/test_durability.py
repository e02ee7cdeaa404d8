"""The os-call order of every durable write: what a power cut needs, read from the calls a real commit makes.

A SIGKILL cannot see a missing fsync (the page cache outlives the process); a power cut can. These tests record
the os calls (tests/oscalls.py) and assert, for each durable write path, the order crash consistency needs:
the data fsynced after its last write and before the rename onto its final name, the directory fsynced after the
rename, the ledger lines a checkpoint vouches for durable before that checkpoint's rename, each ZeRO-1 rank's
blocks durable before its vote and the rename after every vote.

Paths: the one-process commit (O_DIRECT, buffered by choice, buffered after a refusal), the sidecars
(write_many), a replica's download (`restore`), the ledger's sync, the sharded commit on every rank (the fake world of tests/sharding.py),
the spare's reuse, and a real `python -m andrea train` (companions and ledger before each `.bin`, the spare
claimed and rewritten, and the rollback's rewrite of guard state before the abandoned checkpoints go).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from andrea.control.commit import shards
from andrea.control.commit.writer import CheckpointWriter
from andrea.rundir import atomic, checkpoint as ckpt, names, sidecars, spare
from andrea.rundir.checkpoint_write import DirectIO, commit_checkpoint
from andrea.rundir.names import LEDGER_NAME
from andrea.rundir.ledger import LossLedger
from andrea.rundir.retention import Policy, Retention
from tests import sharding
from tests.disks import refuse_o_direct_on_setfl
from tests.oscalls import OsCalls
from tests.runs import ROOT, TINY, env, seed_data

N = 1001  # 12,020 bytes: the O_DIRECT image is padded, then truncated


def payload(n: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal(3 * n).astype(np.float32)
    data[2 * n:] = np.abs(data[2 * n:])
    return data


def o_direct(calls: OsCalls, i: int) -> bool:
    return bool((calls.events[i].info or {}).get("flags", 0) & os.O_DIRECT)


# --- the recorder itself: each assertion refuses the order it exists to refuse ---------------------------------
def careless_write(path: Path, data: bytes, *, fsync: bool, flush: bool = True, dir_sync: bool = True,
                   write_after: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if flush:
            f.flush()
        if fsync:
            os.fsync(f.fileno())
        if write_after:
            f.write(b"more")
    os.rename(tmp, path)
    if dir_sync:
        atomic.fsync_dir(path.parent)


@pytest.mark.parametrize("bug, match", [({"fsync": False}, "never fsynced"),
                                        ({"fsync": True, "flush": False}, "bytes written after the fsync"),
                                        ({"fsync": True, "write_after": True}, "bytes written after the fsync"),
                                        ({"fsync": True, "dir_sync": False}, "no directory fsync")])
def test_the_recorder_refuses_each_order_a_power_cut_would_punish(tmp_path, bug, match):
    with OsCalls() as calls:
        careless_write(tmp_path / "good.json", b"{}\n" * 10, fsync=True)
        careless_write(tmp_path / "bad.json", b"{}\n" * 10, **bug)
    calls.published(tmp_path / "good.json")
    with pytest.raises(AssertionError, match=match):
        calls.published(tmp_path / "bad.json")


def test_the_recorder_sees_pwrites_after_the_fsync_and_unsynced_directories(tmp_path):
    path = tmp_path / "f"
    with OsCalls() as calls:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"abc", 0)
        os.fsync(fd)
        os.pwrite(fd, b"d", 3)
        os.close(fd)
        relied = calls.mark("relied on")
    with pytest.raises(AssertionError, match="modified after its last fsync"):
        calls.durable_before(path, relied)
    with pytest.raises(AssertionError, match="no directory fsync"):
        calls.dir_synced_after(tmp_path, 0)


# --- the one-process commit ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["O_DIRECT", "buffered", "refused at open"])
def test_a_commit_fsyncs_the_tmp_after_its_last_write_renames_it_then_fsyncs_the_directory(tmp_path, path):
    run = tmp_path / "run"
    run.mkdir()
    direct = DirectIO(path != "buffered")
    with OsCalls(refuse_o_direct=path == "refused at open") as calls:
        final = commit_checkpoint(run, 20, payload(N, 20), direct=direct)
    tmp = str(final) + names.TMP_SUFFIX
    rename, dir_sync = calls.published(final)
    assert calls.events[rename].path == tmp and calls.events[rename].size == ckpt.checkpoint_bytes(N)
    opens = calls.where("open", path=tmp)
    assert opens and all(o_direct(calls, i) == (path == "O_DIRECT") for i in opens), calls.describe()
    writes = calls.where(("write", "pwrite"), path=tmp)
    assert writes and max(writes) < rename  # the bytes went to the .tmp, and only before the commit point
    assert not calls.where(("write", "pwrite", "open"), path=final), "the final name was written directly"
    assert direct.enabled == (path == "O_DIRECT")
    assert ckpt.validate(final, N, deep=True).step == 20


def test_a_commit_into_the_spare_rewrites_the_claimed_blocks_and_makes_them_durable_before_the_rename(tmp_path):
    n = 5000
    old = commit_checkpoint(tmp_path, 10, payload(n, 10))
    ino = old.stat().st_ino
    assert spare.retire(old)
    for direct in (True, False):  # the spare is claimed on both paths
        with OsCalls() as calls:
            final = commit_checkpoint(tmp_path, 20 if direct else 30, payload(n, 3), direct=DirectIO(direct))
        claim = calls.where("rename", path=tmp_path / names.SPARE_NAME, dst=str(final) + names.TMP_SUFFIX)
        assert len(claim) == 1 and calls.events[claim[0]].ino == ino, calls.describe()
        # Inode numbers alone cannot tell: a fresh file may be given the number just freed.
        assert not calls.where("unlink", path=str(final) + names.TMP_SUFFIX), "the claimed spare was dropped"
        rename, _ = calls.published(final)
        assert calls.events[rename].ino == ino, "the commit did not write into the spare"
        assert claim[0] < min(calls.where(("write", "pwrite"), ino=ino))
        assert spare.retire(final)  # released again: the next pass claims it too
    assert not list(tmp_path.glob("*.tmp"))


def test_sidecars_write_many_makes_every_file_durable_then_renames_then_fsyncs_each_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    files = {tmp_path / "a.json": b'{"a": 1}\n', tmp_path / "b.json": b"[]\n" * 100,
             tmp_path / "sub" / "c.json": b"{}\n"}
    (tmp_path / "a.json").write_bytes(b"old")
    with OsCalls() as calls:
        atomic.write_many(files)
    renames = []
    for path, data in files.items():
        rename, _ = calls.published(path)
        assert calls.events[rename].size == len(data)
        renames.append(rename)
    for directory in (tmp_path, tmp_path / "sub"):
        assert len(calls.where("fsync", path=directory, kind="dir")) == 1  # one per directory, after the renames
        assert calls.dir_synced_after(directory, max(renames))


def test_a_replica_download_is_durable_before_its_rename_and_a_refused_piece_changes_nothing(tmp_path):
    from andrea.control.replica import remote as rep
    remote = rep.Replica(str(tmp_path / "remote"))  # a plain-path replica: the same download as from S3
    remote.put("step_000010.bin", b"\x01" * 3000)
    dest = tmp_path / "run" / "step_000010.bin"
    with OsCalls() as calls:
        assert remote.download("step_000010.bin", dest) == 3000
    rename, _ = calls.published(dest)
    assert calls.events[rename].size == 3000 and dest.read_bytes() == b"\x01" * 3000

    def refuse(piece: bytes) -> None:
        raise rep.ReplicaError("not the recorded bytes", "corrupt")
    remote.put("step_000010.bin", b"\x02" * 3000)
    with pytest.raises(rep.ReplicaError):
        remote.download("step_000010.bin", dest, refuse)
    assert dest.read_bytes() == b"\x01" * 3000 and sorted(p.name for p in dest.parent.iterdir()) == [dest.name]


def test_the_ledger_sync_makes_every_appended_line_durable(tmp_path):
    path = tmp_path / LEDGER_NAME
    ledger = LossLedger(path)
    with OsCalls() as calls:
        ledger.append([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}])
        appended = path.stat().st_size
        ledger.sync()
        relied = calls.mark("a checkpoint relies on steps 1-2")
        ledger.append([{"step": 3, "loss": 2.8}])
        ledger.sync()
        end = calls.mark("a checkpoint relies on step 3")
    ledger.close()
    assert calls.where("write", path=path) and appended > 0
    calls.durable_before(path, relied, min_size=appended)
    calls.durable_before(path, end, min_size=path.stat().st_size)


# --- the ZeRO-1 sharded commit, every rank -------------------------------------------------------------------
@pytest.mark.parametrize("path", ["O_DIRECT", "refused", "into the spare"])
@pytest.mark.parametrize("n,size", [(50_001, 2), (3_000, 3)])
def test_every_rank_fsyncs_its_blocks_before_its_vote_and_rank_0_renames_after_every_vote(tmp_path, monkeypatch,
                                                                                          path, n, size):
    data = payload(n, n)
    calls = OsCalls()
    vote = sharding.ThreadWorld.to_leader

    def recorded_vote(self, value, group="io"):
        calls.mark("vote", rank=self.rank, value=value)
        return vote(self, value, group)

    monkeypatch.setattr(sharding.ThreadWorld, "to_leader", recorded_vote)
    if path == "refused":  # a filesystem that will not switch O_DIRECT on: the buffered blocks
        refuse_o_direct_on_setfl(monkeypatch, shards)
    spare_ino = sharding.released_spare(tmp_path, n) if path == "into the spare" else None
    with calls:
        assert sharding.commit_with_threads(tmp_path, n, size, data) == {}
    final = tmp_path / names.checkpoint_name(7)
    tmp = str(final) + names.TMP_SUFFIX
    rename, _ = calls.published(final)
    assert calls.events[rename].thread == "rank-0"
    ino = calls.events[rename].ino
    if spare_ino is not None:  # rank 0 claimed it before the exchange; every rank wrote into its blocks
        [claim] = calls.where("rename", path=tmp_path / names.SPARE_NAME, dst=tmp)
        assert ino == spare_ino and calls.events[claim].thread == "rank-0"
        assert claim < min(calls.where(("pwrite", "write"), ino=ino))
    votes = {}
    for r in range(size):
        thread = f"rank-{r}"
        [voted] = calls.where("mark", thread=thread, what="vote")
        assert calls.events[voted].info["value"] == 0
        writes = [i for i in calls.where(("pwrite", "write"), ino=ino, thread=thread) if i < voted]
        syncs = [i for i in calls.where(("fsync", "fdatasync"), ino=ino, thread=thread) if i < voted]
        assert writes, f"rank {r} wrote nothing before its vote:\n{calls.describe()}"
        assert syncs and max(writes) < max(syncs), (f"rank {r} voted on blocks it never fsynced:\n"
                                                    f"{calls.describe()}")
        assert not [i for i in calls.where(("pwrite", "write", "ftruncate"), ino=ino, thread=thread)
                    if i > max(syncs)], f"rank {r} wrote after its fsync"
        votes[r] = voted
    assert max(votes.values()) < rename, "rank 0 renamed before every rank had voted"
    assert calls.events[rename].path == tmp
    assert np.array_equal(ckpt.read_payload(final, n)[1], data)


# --- the writer: the companions before the .bin --------------------------------------------------------------
def test_the_writer_runs_before_commit_to_completion_before_the_bin_is_renamed(tmp_path):
    """The runtime's before_commit (ledger sync, companions) runs on the I/O thread ahead of the commit."""
    ledger = LossLedger(tmp_path / LEDGER_NAME)
    io = ThreadPoolExecutor(1)
    writer = CheckpointWriter(tmp_path, N, torch.device("cpu"), io, retention=Retention(Policy(5, 0)))
    companion = sidecars.checkpoint_state_path(tmp_path, 40)

    def before_commit() -> None:
        ledger.append([{"step": s, "loss": 1.0} for s in range(1, 41)])
        ledger.sync()
        atomic.write_many({companion: b'{"step": 40}\n'})

    async def commit():
        writer.staging[0].copy_(torch.from_numpy(payload(N, 40)))
        return await writer.start_commit(0, 40, None, before_commit)

    with OsCalls() as calls:
        result = asyncio.run(commit())
    io.shutdown()
    ledger.close()
    assert result.error is None
    rename, _ = calls.published(result.path)
    calls.published(companion, before=rename)
    calls.durable_before(tmp_path / LEDGER_NAME, rename, min_size=(tmp_path / LEDGER_NAME).stat().st_size)


# --- a real run ----------------------------------------------------------------------------------------------
# Checkpoints every 10 steps, the newest kept (and the guard's), confirmed good 5 steps later. Retention runs on
# the I/O thread after each commit and asks the guard then, so step 10 is released at step 20's commit or at step
# 30's (whether step 25's confirmation came first is timing), and step 40's commit is written into the spare
# either way. The guard's bands are opened wide, so no finite record is ever anomalous and confirmations follow
# from the step counts alone, on any machine (a loss trajectory differs across CPUs and thread counts, and an
# anomaly delays a confirmation). A non-finite record is still an incident at once.
QUIET = [f"guard.{k}=1e9" for k in ("loss_sigmas", "loss_margin", "grad_sigmas", "grad_margin")]
REAL = ["--checkpoint-every", "10", "--set", "checkpoint.keep_last=1", "--set", "checkpoint.keep_every=0",
        "--set", "guard.confirm_steps=5", *(a for k in QUIET for a in ("--set", k))]


def recorded_run(run_dir: Path, events: Path, *args: str, extra_env: dict | None = None) -> OsCalls:
    """`python -m tests.oscalls EVENTS <args before --> -- train <tiny> --run-dir RUN <args after -->`."""
    r = subprocess.run([sys.executable, "-m", "tests.oscalls", str(events), *args[:args.index("--")], "--", "train",
                        *TINY, "--run-dir", str(run_dir), *args[args.index("--") + 1:]],
                       capture_output=True, text=True, timeout=300, env={**env(), **(extra_env or {})}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return OsCalls.load(events)


def ledger_offsets(run_dir: Path) -> dict[int, int]:
    """step -> the byte offset just past its (first) step entry in .loss.json (append-only: offsets are final)."""
    out, end = {}, 0
    for line in (run_dir / LEDGER_NAME).read_bytes().splitlines(keepends=True):
        end += len(line)
        entry = json.loads(line)
        if "event" not in entry:
            out.setdefault(entry["step"], end)
    return out


def assert_checkpoint_published_after_what_it_vouches_for(calls: OsCalls, run_dir: Path, step: int,
                                                          occurrence: int = 0, ledger_bytes: int | None = None):
    final = run_dir / names.checkpoint_name(step)
    rename, _ = calls.published(final, occurrence=occurrence)
    for companion in (sidecars.checkpoint_state_path(run_dir, step), names.companion_path(run_dir, step, "guard")):
        before = [i for i in calls.renames_onto(companion) if i < rename]
        calls.published(companion, occurrence=len(before) - 1, before=rename)
    state = [i for i in calls.renames_onto(run_dir / names.STATE_NAME) if i < rename]
    calls.published(run_dir / names.STATE_NAME, occurrence=len(state) - 1, before=rename)
    calls.durable_before(run_dir / LEDGER_NAME, rename, min_size=ledger_bytes)
    return rename


@pytest.mark.parametrize("path", ["O_DIRECT", "refused"])
def test_a_real_run_publishes_each_checkpoint_after_its_ledger_lines_and_companions_and_reuses_the_spare(
        prepared, tmp_path, path):
    run = seed_data(prepared, tmp_path / "run")
    opts = ["--refuse-o-direct"] if path == "refused" else []
    calls = recorded_run(run, tmp_path / "events.jsonl", *opts, "--", "--steps", "40", *REAL)
    offsets = ledger_offsets(run)
    renames = {s: assert_checkpoint_published_after_what_it_vouches_for(calls, run, s, ledger_bytes=offsets[s])
               for s in (10, 20, 30, 40)}
    tmp_opens = [i for i in calls.where("open") if calls.events[i].path.endswith(".bin" + names.TMP_SUFFIX)]
    assert tmp_opens and all(o_direct(calls, i) == (path == "O_DIRECT") for i in tmp_opens)
    # The spare: a checkpoint released by retention after one commit (step_K.bin renamed onto spare.ckpt) is
    # claimed by the next commit (spare.ckpt renamed onto its .tmp), which rewrites those blocks, fsyncs them
    # (published above) and renames them onto its step_N.bin. Which checkpoints are released after which commit
    # is timing (see REAL; two at once replace each other, as unlinks would); that the next commit takes the
    # last one is not.
    retired = calls.where("rename", dst=run / names.SPARE_NAME)
    claims = calls.where("rename", path=run / names.SPARE_NAME)
    reused = 0
    for step in (20, 30, 40):
        released = [r for r in retired if renames[step - 10] < r < renames[step]]
        if not released:
            continue
        assert {Path(calls.events[r].path).name for r in released} <= {names.checkpoint_name(s) for s in (10, 20)}
        [claim] = [c for c in claims if released[-1] < c < renames[step]]
        assert calls.events[claim].dst == str(run / (names.checkpoint_name(step) + names.TMP_SUFFIX))
        assert calls.events[claim].ino == calls.events[released[-1]].ino == calls.events[renames[step]].ino, \
            f"step {step} was not written into the released checkpoint's blocks"
        reused += 1
    assert reused, f"no released checkpoint was reused:\n{calls.describe()}"
    assert sorted(p.name for p in run.glob("step_*.bin")) == ["step_000030.bin", "step_000040.bin"]


def test_a_rollback_rewrites_the_guard_state_durably_before_it_deletes_the_abandoned_checkpoints(prepared, tmp_path):
    """A NaN loss at step 42 (injected, deterministic): step 30 is the known-good point (confirmed at 35), step 40
    tentative. The rollback's ledger markers are fsynced, step 30's guard companion is rewritten atomically, and
    only then is step_40.bin deleted, the directory fsynced after it."""
    run = seed_data(prepared, tmp_path / "run")
    calls = recorded_run(run, tmp_path / "events.jsonl", "--", "--steps", "50", *REAL,
                         extra_env={"ANDREA_TEST_POISON_STEPS": "42"})
    entries = [json.loads(line) for line in (run / LEDGER_NAME).read_text().splitlines()]
    [rollback] = [e for e in entries if e.get("event") == "rollback"]
    assert rollback["step"] == 30 and rollback["from"] == 42, rollback
    guard = names.companion_path(run, 30, "guard")
    first_40 = calls.renames_onto(run / names.checkpoint_name(40))[0]
    rewrites = [i for i in calls.renames_onto(guard) if i > first_40]
    assert rewrites, "the known-good checkpoint's guard state was never rewritten"
    rewrite, rewrite_dir_sync = calls.published(guard, occurrence=calls.renames_onto(guard).index(rewrites[0]))
    upto_marker = sum(len(line) for line in (run / LEDGER_NAME).read_bytes().splitlines(keepends=True)
                      [:entries.index(rollback) + 1])
    calls.durable_before(run / LEDGER_NAME, rewrite, min_size=upto_marker)
    dropped = [i for i in calls.where("unlink", path=run / names.checkpoint_name(40)) if i > rewrite]
    assert dropped, f"step_000040.bin was not deleted after the rewrite:\n{calls.describe(first_40)}"
    assert rewrite_dir_sync < dropped[0]
    # ... and the deletions are durable before the run goes on: a directory fsync before the next rename in it
    # (else a power cut could bring the abandoned step_000040.bin back, and a restart would resume from it)
    last_unlink = max(calls.where("unlink", path=run / names.checkpoint_name(40)))
    next_rename = min(i for i in calls.where(("rename", "replace")) if i > last_unlink)
    calls.dir_synced_after(run, last_unlink, before=next_rename)
    # training went on from step 30: the new step 40 and 50 land as every checkpoint does
    assert_checkpoint_published_after_what_it_vouches_for(calls, run, 40, occurrence=1)
    assert_checkpoint_published_after_what_it_vouches_for(calls, run, 50)
