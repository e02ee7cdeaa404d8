"""Checkpoint integrity: a bit that changes after the commit is caught (by `verify`, every reader, every start),
and retention is never wedged by what is not its own.

The flips are of one mantissa bit: the value stays finite, the size and header stay right, so only the content
checksum (andrea/rundir/checksum.py) can see them. A resume past a corrupt checkpoint is compared byte for byte
with a run that was never touched, on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from andrea import cli
from andrea.control.commit.writer import CheckpointWriter
from andrea.rundir import checkpoint as ckpt, checksum, names, spare
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.rundir.retention import Policy, Retention
from tests.disks import payload
from tests.notices import Inbox
from tests.runs import seed_data, train
from tests.sharding import commit_with_threads

N = 1001


def flip_bit(path, byte_offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(byte_offset)
        b = f.read(1)[0]
        f.seek(byte_offset)
        f.write(bytes([b ^ (1 << bit)]))


def region_offset(region: str, n: int, index: int) -> int:
    """The byte of float `index` of `region` that holds mantissa bits 0-7 (little-endian: the first byte)."""
    return 8 + {"weights": 0, "m": 4 * n, "v": 8 * n}[region] + 4 * index


def verify(path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["verify", str(path)])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("region", ["weights", "m", "v"])
def test_a_flipped_mantissa_bit_is_named_by_verify_and_by_every_reader(tmp_path, region):
    path = commit_checkpoint(tmp_path, 100, payload(N, 1))
    assert ckpt.validate(path, N, deep=True).checksum == ckpt.VERIFIED
    before = np.fromfile(path, dtype="<f4", offset=8)
    flip_bit(path, region_offset(region, N, 517), 0)
    after = np.fromfile(path, dtype="<f4", offset=8)
    assert np.isfinite(after).all() and (after[2 * N:] >= 0).all() and not np.array_equal(before, after)
    with pytest.raises(ckpt.CheckpointError, match=f"checksum mismatch in {region}"):
        ckpt.validate(path, N, deep=True)
    with pytest.raises(ckpt.CheckpointError, match=f"checksum mismatch in {region}"):
        ckpt.read_payload(path, N)  # what export, sample, branch and the guard's rollback read through
    code, out, err = verify(tmp_path)
    assert code == 1 and "step_000100.bin" in err and region in err and "ok" not in out


def test_a_flipped_header_bit_is_caught_even_where_the_sizes_still_agree(tmp_path):
    path = commit_checkpoint(tmp_path, 100, payload(N, 1))
    good = path.read_bytes()
    # Rewrite step and name together (a step 101 file with step 100's payload): every structural check passes.
    moved = tmp_path / names.checkpoint_name(101)
    moved.write_bytes(struct.pack("<ii", 101, N) + good[8:])
    checksum.sum_path(path).rename(checksum.sum_path(moved))
    assert ckpt.validate(moved, N).step == 101
    with pytest.raises(ckpt.CheckpointError, match="recorded for step 100"):
        ckpt.validate(moved, N, deep=True)
    code, _, err = verify(moved)
    assert code == 1 and "step_000101.bin" in err


def test_a_checkpoint_from_before_checksums_is_unverifiable_not_broken(tmp_path):
    path = commit_checkpoint(tmp_path, 100, payload(N, 1))
    checksum.sum_path(path).unlink()
    assert ckpt.validate(path, N, deep=True).checksum == ckpt.UNVERIFIABLE
    code, out, err = verify(tmp_path)
    assert code == 0 and out.startswith("unverifiable ") and "step_000100.bin" in out and not err


def committed_with_ledger_records(run_dir, steps, tag: str):
    """Checkpoints as the trainer commits them: each ledger record (`step_N.ledger.json`) written before it."""
    run_dir.mkdir(exist_ok=True)
    for step in steps:
        names.companion_path(run_dir, step, "ledger").write_text(
            f'{{"bytes": {step}, "xxh3_128": "{tag}{step:030d}", "last_step": {step}}}')
        commit_checkpoint(run_dir, step, payload(N, step))
    return run_dir


def test_a_checkpoint_that_lost_its_checksum_is_unverified_refused_by_verify_and_skipped_at_a_start(tmp_path):
    from andrea.control.run import resume
    run = committed_with_ledger_records(tmp_path / "run", [10, 20], "a")
    newest = run / names.checkpoint_name(20)
    checksum.sum_path(newest).unlink()
    flip_bit(newest, region_offset("weights", N, 517), 0)  # a value check cannot see it; only the checksum could
    code, out, err = verify(run)
    assert code == 1 and "step_000020.bin" in err and "missing" in err and "unverified" in err
    assert "unverifiable" not in out and out.startswith("ok ") and "step_000010" in out
    with pytest.raises(ckpt.CheckpointError, match="sum.json\\) is missing"):
        ckpt.read_payload(newest, N)  # the guard's rollback, export, sample and branch read through this
    info, _ = resume.resume_point(run, None, N)
    assert info.step == 10  # skipped like a bad one
    resume.set_aside_newer(run, info)
    assert (run / names.QUARANTINE_DIR / newest.name).exists() and not newest.exists()


def test_another_runs_checkpoint_with_its_checksum_copied_in_is_refused(tmp_path):
    from andrea.control.run import resume
    mine = committed_with_ledger_records(tmp_path / "mine", [10, 20], "a")
    other = committed_with_ledger_records(tmp_path / "other", [20], "b")
    for name in (names.checkpoint_name(20), "step_000020.sum.json"):  # this run keeps its own ledger record
        shutil.copy(other / name, mine / name)
    with pytest.raises(ckpt.CheckpointError, match="another ledger"):
        ckpt.validate(mine / names.checkpoint_name(20), N, deep=True)
    assert verify(mine)[0] == 1
    assert resume.resume_point(mine, None, N)[0].step == 10
    names.companion_path(mine, 20, "ledger").unlink()  # and without one: its checksum names a record it lacks
    with pytest.raises(ckpt.CheckpointError, match="ledger record .* is missing"):
        ckpt.validate(mine / names.checkpoint_name(20), N, deep=True)


def test_a_garbled_checksum_file_is_one_line_naming_it(tmp_path):
    path = commit_checkpoint(tmp_path, 100, payload(N, 1))
    checksum.sum_path(path).write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match=r"step_000100\.sum\.json: unreadable checksum"):
        ckpt.validate(path, N, deep=True)


def test_the_sharded_commit_records_the_same_checksum_as_one_process(tmp_path):
    n, size = 50_001, 3
    data = np.abs(np.random.default_rng(3).standard_normal(3 * n, dtype=np.float32))
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = commit_checkpoint(tmp_path / "one", 7, data)
    assert commit_with_threads(tmp_path / "many", n, size, data) == {}
    many = tmp_path / "many" / one.name
    assert checksum.read(many) == checksum.read(one) is not None
    assert ckpt.validate(many, n, deep=True).checksum == ckpt.VERIFIED


def test_verify_racing_retention_reports_no_false_failure(tmp_path, monkeypatch):
    for step in (10, 20, 30):
        commit_checkpoint(tmp_path, step, payload(N, step))
    real = ckpt.validate
    removed = tmp_path / names.checkpoint_name(10)

    def retention_strikes_first(path, *args, **kwargs):  # retention deletes step 10 between listing and reading
        if path == removed:
            spare.retire(removed)
            for companion in names.companions(tmp_path, 10):
                companion.unlink()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "validate", retention_strikes_first)
    code, out, err = verify(tmp_path)
    assert code == 0, err
    assert f"gone {removed}" in out and out.count("\nok ") + out.startswith("ok ") == 2


def commits(run_dir, steps, keep_last=2):
    """Commit `steps` through the trainer's writer (its retention included)."""
    pool = ThreadPoolExecutor(1)
    writer = CheckpointWriter(run_dir, N, torch.device("cpu"), pool, retention=Retention(Policy(keep_last, 0)))

    async def go():
        for step in steps:
            slot = await writer.free_slot()
            writer.staging[slot].copy_(torch.from_numpy(payload(N, step)))
            await writer.start_commit(slot, step, None)
        return await writer.drain()

    try:
        asyncio.run(go())
    finally:
        pool.shutdown()


@pytest.mark.parametrize("where", ["spare", "checkpoint"])
def test_a_directory_in_the_way_is_left_alone_once_said_and_retention_stays_bounded(tmp_path, caplog, where):
    odd = tmp_path / (names.SPARE_NAME if where == "spare" else names.checkpoint_name(5))
    odd.mkdir()
    (odd / "mine").write_text("not andrea's")
    with caplog.at_level(logging.WARNING, logger="andrea"):
        commits(tmp_path, range(10, 130, 10), keep_last=3)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [100, 110, 120]  # bounded: keep_last
    assert (odd / "mine").read_text() == "not andrea's"
    said = [r.getMessage() for r in caplog.records if str(odd) in r.getMessage()]
    assert len(said) == 1, said  # once, not once per commit
    assert not [r for r in caplog.records if "retention" in r.getMessage() and "failed" in r.getMessage()]


def test_a_hard_linked_spare_is_never_written_through(tmp_path):
    run, copy = tmp_path / "run", tmp_path / "copy"
    run.mkdir()
    copy.mkdir()
    commits(run, [10, 20, 30], keep_last=2)  # step 10 released: the spare
    assert (run / names.SPARE_NAME).exists()
    for f in run.iterdir():  # `cp -al run copy`
        (copy / f.name).hardlink_to(f)
    copy_spare = (copy / names.SPARE_NAME).read_bytes()
    commits(run, [40], keep_last=2)
    assert (copy / names.SPARE_NAME).read_bytes() == copy_spare
    assert (run / names.checkpoint_name(40)).stat().st_ino != (copy / names.SPARE_NAME).stat().st_ino
    assert ckpt.validate(run / names.checkpoint_name(40), N, deep=True).checksum == ckpt.VERIFIED


def test_a_resume_skips_a_corrupt_checkpoint_keeps_it_as_evidence_and_reaches_the_untouched_bytes(prepared,
                                                                                                  tmp_path):
    base = seed_data(prepared, tmp_path / "base")
    assert train(base, "--steps", "40", "--checkpoint-every", "20").returncode == 0
    untouched, corrupt = tmp_path / "untouched", tmp_path / "corrupt"
    shutil.copytree(base, untouched)
    shutil.copytree(base, corrupt)
    n = ckpt.validate(corrupt / names.checkpoint_name(40)).n_params
    flip_bit(corrupt / names.checkpoint_name(40), region_offset("m", n, n // 2), 3)
    assert verify(corrupt)[0] == 1
    a = train(untouched, "--steps", "60", "--checkpoint-every", "20")
    inbox = Inbox()  # the operator's webhook: the incident must reach them, not only the log
    b = train(corrupt, "--steps", "60", "--checkpoint-every", "20", "--set", f'notify.url="{inbox.url}"')
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    warned = [line for line in b.stderr.splitlines() if "step_000040.bin" in line and "checksum mismatch in m" in line]
    assert len(warned) == 1, b.stderr
    assert (corrupt / names.QUARANTINE_DIR / names.checkpoint_name(40)).exists()  # evidence, not deleted
    name = names.checkpoint_name(60)
    assert (corrupt / name).read_bytes() == (untouched / name).read_bytes()
    assert verify(corrupt)[0] == 0
    # On the record (issue 46): a quarantine marker naming the file and the region, a resume below the newest and
    # why — not only a `resume` from an older step, as a crash leaves — each a notice, and `status` shows them.
    lines = [json.loads(line) for line in (corrupt / names.LEDGER_NAME).read_text().splitlines()]
    (moved,) = [e for e in lines if e.get("event") == "quarantine"]
    (below,) = [e for e in lines if e.get("event") == "resume_below"]
    assert (moved["step"], moved["file"], moved["to"], moved["regions"]) == (20, "step_000040.bin", "quarantine/",
                                                                              ["m"])
    assert "checksum mismatch in m" in moved["reason"]
    assert (below["step"], below["newest"], below["skipped"]) == (20, 40, ["step_000040.bin"])
    notice = inbox.wait_for("quarantine")
    assert notice["file"] == "step_000040.bin" and notice["regions"] == ["m"] and notice["step"] == 20
    assert inbox.wait_for("resume_below")["newest"] == 40
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["status", str(corrupt), "--json"]) == 0
    shown = json.loads(out.getvalue())["incidents"]
    assert shown["quarantine"]["file"] == "step_000040.bin" and shown["resume_below"]["newest"] == 40
    assert shown["replica_down"] is None
