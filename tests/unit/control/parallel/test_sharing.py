"""Ranks that do not share a run directory (andrea/control/parallel/sharing.py, gathered.py): the decision as a plain
function, then the probe, rank 0's reads, the payload hand-out and the gathered commit with ranks as threads, each
rank's run directory its own temporary directory (as two disks mounted at one path)."""

import errno
import os

import numpy as np
import pytest
import torch

from andrea.control.parallel import ranks, sharing
from andrea.control.commit.gathered import GatheredCheckpointWriter
from andrea.control.commit.shards import ShardedCheckpointWriter, writer_for
from andrea.control.parallel.distributed import World, shard_bounds
from andrea.rundir import checkpoint as ckpt, checksum, names
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.rundir.retention import Policy, Retention
from tests.sharding import released_spare, run_ranks

T, F = True, False


def test_every_rank_seeing_every_probe_is_one_directory():
    views = sharing.decide([[T, T, T]] * 3)
    assert views == sharing.RunDirSharing(True, (0, 0, 0))


def test_two_nodes_on_their_own_disks_are_separate_with_one_first_rank_each():
    assert sharing.decide([[T, F], [F, T]]) == sharing.RunDirSharing(False, (0, 1))
    two_by_two = [[T, T, F, F], [T, T, F, F], [F, F, T, T], [F, F, T, T]]
    assert sharing.decide(two_by_two) == sharing.RunDirSharing(False, (0, 0, 2, 2))


@pytest.mark.parametrize("seen,words", [
    ([[T, T], [F, T]], "rank 0 sees rank 1's probe file but rank 1 does not see rank 0's"),
    ([[F, F], [F, T]], "rank 0 cannot read back its own probe file"),
    ([[T, T, F], [T, T, T], [F, T, T]], "seen by ranks that see different directories"),
])
def test_answers_no_filesystem_gives_are_one_clear_problem(seen, words):
    views = sharing.decide(seen)
    assert not views.shared and words in views.problem


def probe_in(dirs):
    """Each rank probes its own directory (the same path for two ranks: one shared directory)."""
    def rank(world):
        views = sharing.probe(world, dirs[world.rank])
        return views, world.shared_dir, world.view
    return run_ranks(len(dirs), rank)


def test_the_probe_finds_a_shared_directory_and_leaves_nothing(tmp_path):
    stale = tmp_path / f"{names.PROBE_PREFIX}0123"  # a crash's leftover
    stale.write_text("0123")
    got = probe_in([tmp_path, tmp_path, tmp_path])
    assert {r: got[r][1:] for r in got} == {0: (True, 0), 1: (True, 0), 2: (True, 0)}
    assert list(tmp_path.iterdir()) == []


def test_the_probe_finds_separate_disks_and_leaves_nothing(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    got = probe_in([node0, node0, node1, node1])
    assert {r: got[r][1:] for r in got} == {0: (False, 0), 1: (False, 0), 2: (False, 2), 3: (False, 2)}
    assert list(node0.iterdir()) == list(node1.iterdir()) == []


def test_from_leader_gives_rank_0s_answer_or_its_error_on_separate_disks():
    def rank(world):
        world.shared_dir = False
        value = sharing.from_leader(world, lambda: f"rank {world.rank}")
        try:
            sharing.from_leader(world, lambda: int(f"not a number on rank {world.rank}"))
        except ValueError as e:
            return value, str(e)
    got = run_ranks(3, rank)
    assert all(got[r] == ("rank 0", "invalid literal for int() with base 10: 'not a number on rank 0'")
               for r in range(3))
    shared = run_ranks(2, lambda world: sharing.from_leader(world, lambda: world.rank))
    assert shared == {0: 0, 1: 1}  # a shared directory: every rank reads for itself, as before


def test_rank_0s_choice_of_checkpoint_or_its_refusal_reaches_every_rank_on_a_shared_directory(tmp_path):
    """Campaign seed 214: rank 0 alone picks the checkpoint to resume (it may quarantine files), and when every
    checkpoint is damaged its refusal must be every rank's one line: rank 1 once waited in the broadcast of the
    pick until rank 0's exit broke it into a traceback."""
    from andrea.control.run import resume
    n = 40
    for step in (10, 20):
        commit_checkpoint(tmp_path, step, np.zeros(3 * n, np.float32))
    calls = []

    def pick(world):
        calls.append(world.rank)
        found = resume.resume_point(tmp_path, None, n, [])
        return found[0].step if found is not None else None
    assert run_ranks(2, lambda world: sharing.leader_decides(world, pick, world)) == {0: 20, 1: 20}
    for step in (10, 20):  # one byte past each header: the size no longer fits the model
        with open(tmp_path / names.checkpoint_name(step), "ab") as f:
            f.write(b"\0")
    calls.clear()
    got = run_ranks(2, lambda world: sharing.leader_decides(world, pick, world))
    assert calls == [0]
    assert all(isinstance(got[r], ckpt.CheckpointError) for r in (0, 1)), got
    assert str(got[0]) == str(got[1]) and "refusing to start over" in str(got[1])


@pytest.mark.parametrize("n,size", [(1001, 3), (10, 4)])
def test_rank_0s_payload_reaches_each_rank_as_all_of_w_and_its_slices(n, size):
    payload = torch.from_numpy(np.random.default_rng(n).standard_normal(3 * n, dtype=np.float32))

    def rank(world):
        world.shared_dir = False
        return sharing.share_payload(world, payload.clone() if world.leader else None, n)
    got = run_ranks(size, rank)
    for r in range(size):
        lo, hi = shard_bounds(n, size, r)
        assert torch.equal(got[r][:n], payload[:n])
        for region in (1, 2):
            assert torch.equal(got[r][region * n + lo:region * n + hi], payload[region * n + lo:region * n + hi])


def test_a_payload_rank_0_cannot_read_is_the_same_error_on_every_rank():
    def rank(world):
        world.shared_dir = False
        return sharing.share_payload(world, ckpt.CheckpointError("step_000020.bin: truncated") if world.leader
                                     else None, 10)
    got = run_ranks(2, rank)
    assert all(isinstance(e, ckpt.CheckpointError) and str(e) == "step_000020.bin: truncated" for e in got.values())


def test_a_pivot_on_separate_disks_takes_rank_0s_policy_or_none_everywhere():
    got = run_ranks(3, lambda world: ranks.leader_policy(world, "rank 0's" if world.leader else f"{world.rank}'s",
                                                         lambda: "read"))
    assert got == {0: "rank 0's", 1: "rank 0's", 2: "rank 0's"}
    asked_elsewhere = run_ranks(2, lambda world: ranks.leader_policy(world, None, lambda: "rank 0's file"))
    assert asked_elsewhere == {0: "rank 0's file", 1: "rank 0's file"}

    def missing():
        raise FileNotFoundError("policy.next.toml")
    assert run_ranks(2, lambda world: ranks.leader_policy(world, None, missing)) == {0: None, 1: None}


def test_data_fingerprints_name_what_differs():
    a = {"tokenizer": "ab", "dtype": "uint16", "val_fraction": 0.05, "arms": {"x": ["text", True, 10, 1, 2, 3]}}
    assert ranks.fingerprint_mismatch([a, dict(a)]) is None
    other = {**a, "tokenizer": "cd"}
    assert "rank 1's copy of the prepared data differs from rank 0's (tokenizer)" in ranks.fingerprint_mismatch(
        [a, other])
    assert "(tokenizer, dtype, val_fraction, arms)" in ranks.fingerprint_mismatch([a, a, None])


# --- the gathered commit -------------------------------------------------------------------------------------
def commit_gathered(dirs, n: int, payload: np.ndarray, step: int = 7, before_commit=None, spare_ino=None):
    """Every rank stages its slices of `payload` and commits step `step` through GatheredCheckpointWriter, each
    into its own directory; rank -> CommitResult."""
    def rank(world):
        world.shared_dir, world.view = False, world.rank
        writer = writer_for(world, dirs[world.rank], type("T", (), {"n": n})(), torch.device("cpu"), None,
                            retention=Retention(Policy(5, 0)))
        assert isinstance(writer, GatheredCheckpointWriter)
        lo, hi = shard_bounds(n, world.size, world.rank)
        for region, view in enumerate(writer.staging[0]):
            view.copy_(torch.from_numpy(payload[region * n + lo:region * n + hi]))
        return writer._commit(0, step, None, before_commit if world.leader else None)
    return run_ranks(len(dirs), rank)


@pytest.mark.parametrize("n,size", [(169_728, 2), (50_001, 3)])
def test_rank_0_gathers_and_writes_the_one_process_bytes_alone(tmp_path, n, size):
    payload = np.abs(np.random.default_rng(n).standard_normal(3 * n, dtype=np.float32))
    dirs = [tmp_path / f"node{r}" for r in range(size)]
    for d in dirs:
        d.mkdir()
    (tmp_path / "one").mkdir()
    expected = commit_checkpoint(tmp_path / "one", 7, payload)
    ino = released_spare(dirs[0], n)  # a spare to reuse: rank 0's whole image goes into it
    results = commit_gathered(dirs, n, payload)
    name = names.checkpoint_name(7)
    assert all(results[r].error is None and results[r].step == 7 for r in range(size)), results
    assert (dirs[0] / name).read_bytes() == expected.read_bytes()
    assert (dirs[0] / name).stat().st_ino == ino
    assert checksum.read(dirs[0] / name) == checksum.read(expected)  # the checksum, written before the rename
    assert ckpt.validate(dirs[0] / name, n, deep=True).checksum == ckpt.VERIFIED
    left = sorted(p.name for p in dirs[0].iterdir() if not p.name.startswith("step_000003."))  # the spare's sum
    assert left == [name, checksum.sum_path(dirs[0] / name).name]  # no .tmp, the spare became step 7
    assert all(list(d.iterdir()) == [] for d in dirs[1:])  # the other ranks write nothing, not even a .tmp


def test_a_failed_write_on_rank_0_reaches_every_rank_and_leaves_no_tmp(tmp_path):
    n, size = 50_001, 2
    payload = np.abs(np.random.default_rng(0).standard_normal(3 * n, dtype=np.float32))
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()

    def disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    results = commit_gathered(dirs, n, payload, before_commit=disk_full)
    assert all(results[r].error is not None and results[r].path is None for r in range(size))
    assert "No space left on device" in results[0].error and "failed on rank 0" in results[1].error
    assert all(list(d.iterdir()) == [] for d in dirs)
    assert commit_gathered(dirs, n, payload)[1].error is None  # the next commit lands whole
    assert ckpt.validate(dirs[0] / names.checkpoint_name(7), n, deep=True).checksum == ckpt.VERIFIED


def test_a_shared_directory_keeps_the_sharded_commit():
    world = World(0, 2)
    assert isinstance(writer_for(world, None, type("T", (), {"n": 3000})(), torch.device("cpu"), None,
                                 retention=Retention(Policy(5, 0))), ShardedCheckpointWriter)
