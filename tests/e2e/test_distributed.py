"""Data parallelism end to end: real `torchrun` launchers, 2 gloo ranks on CPU, the tiny preset, real signals.

What one process promises (docs/formats.md and operating.md), with two ranks: the same checkpoint format and files, losses that follow one
process, resume across world sizes (2 -> 1, 1 -> 2), bit-exact 2-rank resume, SIGTERM to the launcher ends in one
checkpoint, `ctl` reaches rank 0 and rank 0 shares it, a SIGKILLed worker leaves every checkpoint valid, two
launchers as two nodes are the same run as one launcher with two ranks, and so are two nodes whose run directories
are separate disks at one path (each launcher in a mount namespace of its own).
"""

import errno
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from andrea.control.commit import shards
from andrea.rundir import checkpoint as ckpt, checkpoint_write, names
from tests.runs import (ROOT, TINY, Launched, andrea, env, free_port, header, launcher_argv, ledger, seed_data,
                        steps_in_ledger, train, tree_digest)
from tests.disks import Disk, refusal_lines, refuse_o_direct_on_setfl
from tests.sharding import LOSS_RTOL, NORM_AT_START, NORM_RTOL, commit_with_threads, released_spare

TARGET, EVERY = 60, ["--checkpoint-every", "20"]
FAR = ["--checkpoint-every", "100000"]  # no cadence checkpoints: every file on disk was asked for
LIVE = ["--set", "train.log_every=1"]
# A job left running while the test waits on commands (ctl, pivot) sleeps after each step instead of training flat
# out: the steps it would take meanwhile are CPU no assertion needs (the test counts steps, not seconds).
PACED = {"ANDREA_TEST_STEP_DELAY": "0.05"}
POLICY = "[policy]\nfloors = { pydoc-topics = 0.6 }\ncaps = { stdlib-code = 0.1 }\n"


def torchrun(run_dir, *args, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(launcher_argv(run_dir, *args, nproc=nproc), capture_output=True, text=True,
                            timeout=timeout, env=env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


class Launcher(Launched):
    """A live torchrun launcher; every worker's output comes through its stdout/stderr."""

    def worker_pids(self, size: int = 2) -> dict[int, int]:
        pids = {}
        for rank in range(size):
            line = self.wait_for(lambda l, r=rank: l.startswith("ready ") and f" rank={r}/{size}" in l, 120)
            pids[rank] = int(re.search(r"pid=(\d+)", line).group(1))
        return pids

    def wait_step(self, at_least: int, timeout: float = 60) -> int:
        def reached(line):
            m = re.search(r"progress\[0\]: step (\d+)/", line)
            return m and int(m.group(1)) >= at_least
        return int(re.search(r"step (\d+)/", self.wait_for(reached, timeout)).group(1))


def all_valid(run_dir) -> bool:
    """`andrea verify`'s check in-process (deep: sizes, headers, finite values, v >= 0), for every checkpoint."""
    found = ckpt.list_checkpoints(run_dir)
    return bool(found) and all(ckpt.validate(p, deep=True).step == s for s, p in found)


def checkpoints(run_dir) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(run_dir)]


def losses(run_dir) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm); the last entry wins (a resume from an older checkpoint repeats steps)."""
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in ledger(run_dir) if "event" not in e}


def regions(path) -> np.ndarray:
    n = header(path)[1]
    return np.fromfile(path, dtype="<f4", offset=8).reshape(3, n)


def assert_follows(run_dir, reference, steps) -> None:
    got, ref = losses(run_dir), losses(reference)
    for s in steps:
        assert got[s][0] == pytest.approx(ref[s][0], rel=LOSS_RTOL), (s, got[s], ref[s])
        assert got[s][1] == pytest.approx(ref[s][1], rel=NORM_AT_START if s == 1 else NORM_RTOL), (s, got[s], ref[s])


def assert_state_close(path, reference) -> None:
    """Weights and both moments near the reference's: v (beta2 = 0.999) remembers every step, so a resume that
    lost m and v would be off by tens of percent here, not by reduction order. m follows the last few gradients,
    the quantity the reduction order moves most (measured: 0.5 % of its largest entry after 60 steps with the
    bandit choosing the mixture, whose discrete draws amplify last-bit differences; w and v stay under 0.1 %)."""
    a, b = regions(path), regions(reference)
    for i, (name, rtol) in enumerate((("w", 1e-3), ("m", 2e-2), ("v", 1e-2))):
        scale = np.abs(b[i]).max()
        assert np.abs(a[i] - b[i]).max() <= rtol * scale, (name, np.abs(a[i] - b[i]).max() / scale)


@pytest.mark.parametrize("n,size", [(169_728, 2), (50_001, 3), (3_000, 4)])
def test_sharded_commit_writes_the_one_process_bytes(tmp_path, n, size):
    payload = np.random.default_rng(n).standard_normal(3 * n, dtype=np.float32)
    payload[2 * n:] = np.abs(payload[2 * n:])
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    checkpoint_write.commit_checkpoint(tmp_path / "one", 7, payload)
    assert commit_with_threads(tmp_path / "many", n, size, payload) == {}
    name = names.checkpoint_name(7)
    assert (tmp_path / "many" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    assert not list((tmp_path / "many").glob("*.tmp"))


@pytest.mark.parametrize("where", ["switching O_DIRECT on", "first write"])
def test_a_filesystem_refusing_o_direct_gets_the_same_sharded_bytes_buffered(tmp_path, monkeypatch, caplog, where):
    n, size = 50_001, 2
    payload = np.abs(np.random.default_rng(5).standard_normal(3 * n, dtype=np.float32))
    (tmp_path / "one").mkdir()
    expected = checkpoint_write.commit_checkpoint(tmp_path / "one", 7, payload).read_bytes()
    if where == "first write":
        Disk(monkeypatch, refuse_write=errno.EINVAL)
    else:
        refuse_o_direct_on_setfl(monkeypatch, shards)
    (tmp_path / "many").mkdir()
    with caplog.at_level(logging.INFO, logger="andrea"):
        assert commit_with_threads(tmp_path / "many", n, size, payload) == {}
    lines = refusal_lines(caplog)
    assert len(lines) == size, lines  # said once by each rank's writer
    assert (tmp_path / "many" / names.checkpoint_name(7)).read_bytes() == expected


def test_a_failed_slice_commits_nothing_and_every_rank_knows(tmp_path):
    n, size = 50_001, 3
    payload = np.abs(np.random.default_rng(0).standard_normal(3 * n, dtype=np.float32))
    errors = commit_with_threads(tmp_path, n, size, payload, fail_rank=1)
    assert sorted(errors) == [0, 1, 2] and all("failed on rank 1" in e for e in errors.values())
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no .tmp


def test_a_failed_publish_on_rank_0_reaches_every_rank_and_leaves_no_tmp(tmp_path):
    """Every rank's blocks are durable and rank 0's rename step fails: the verdict, not the votes, carries it."""
    n, size = 50_001, 3
    payload = np.abs(np.random.default_rng(4).standard_normal(3 * n, dtype=np.float32))

    def refused() -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    errors = commit_with_threads(tmp_path, n, size, payload, before_rename=refused)
    assert sorted(errors) == [0, 1, 2] and all("failed on rank 0" in e for e in errors.values())
    assert "Input/output error" in errors[0]
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no .tmp


def test_a_full_disk_on_one_rank_commits_nothing_and_damages_nothing(tmp_path, monkeypatch):
    n, size = 50_001, 2
    payload = np.abs(np.random.default_rng(1).standard_normal(3 * n, dtype=np.float32))
    old = checkpoint_write.commit_checkpoint(tmp_path, 3, payload)
    before = old.read_bytes()
    pwrite = checkpoint_write.pwrite_all

    def disk_full_for_rank_1(fd, view, offset):
        if threading.current_thread().name == "rank-1":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        pwrite(fd, view, offset)

    monkeypatch.setattr(checkpoint_write, "pwrite_all", disk_full_for_rank_1)
    errors = commit_with_threads(tmp_path, n, size, payload)
    assert sorted(errors) == [0, 1] and all("failed on rank 1" in e for e in errors.values())
    assert "No space left on device" in errors[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name, "step_000003.sum.json"]  # no new one, no .tmp
    assert old.read_bytes() == before


def test_after_a_failed_slice_no_rank_returns_before_the_tmp_is_gone(tmp_path, monkeypatch):
    """A retry of the same step opens the .tmp again without truncating it: no rank may start one while the
    failed attempt's file still exists (rank 0 could then delete the retry's bytes)."""
    n, size = 50_001, 2
    payload = np.abs(np.random.default_rng(2).standard_normal(3 * n, dtype=np.float32))
    returned, rank_1_out_at_removal = {r: threading.Event() for r in range(size)}, []
    unlink = Path.unlink

    def slow_unlink(self, *a, **k):
        if self.name.endswith(names.TMP_SUFFIX) and threading.current_thread().name == "rank-0":
            returned[1].wait(1.0)  # gives rank 1 every chance to leave first, were it allowed to
            rank_1_out_at_removal.append(returned[1].is_set())
        unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    errors = commit_with_threads(tmp_path, n, size, payload, fail_rank=1, returned=returned)
    assert sorted(errors) == [0, 1] and returned[1].is_set()
    assert rank_1_out_at_removal == [False]
    assert commit_with_threads(tmp_path, n, size, payload) == {}  # the retry of step 7 lands whole
    (tmp_path / "one").mkdir()
    checkpoint_write.commit_checkpoint(tmp_path / "one", 7, payload)
    name = names.checkpoint_name(7)
    assert (tmp_path / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


@pytest.mark.parametrize("n,size", [(169_728, 2), (3_000, 4)])
def test_a_sharded_commit_writes_into_the_spare(tmp_path, n, size):
    """Rank 0 renames the spare onto step_7.bin.tmp before the exchange; every rank then writes its blocks
    into the spare's, and nothing of its old bytes survives."""
    payload = np.abs(np.random.default_rng(3).standard_normal(3 * n, dtype=np.float32))
    ino = released_spare(tmp_path, n)
    assert commit_with_threads(tmp_path, n, size, payload) == {}
    final = tmp_path / names.checkpoint_name(7)
    assert final.stat().st_ino == ino
    (tmp_path / "one").mkdir()
    assert final.read_bytes() == checkpoint_write.commit_checkpoint(tmp_path / "one", 7, payload).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", final.name, "step_000007.sum.json"]  # spare -> 7


@pytest.fixture(scope="module")
def straight(prepared, tmp_path_factory):
    """The references: one process and two ranks, never stopped, to TARGET (checkpoints every 20)."""
    root = tmp_path_factory.mktemp("straight")
    one, two = seed_data(prepared, root / "one"), seed_data(prepared, root / "two")
    result = train(one, "--steps", str(TARGET), *EVERY)
    assert result.returncode == 0, result.stderr
    torchrun(two, "--steps", str(TARGET), *EVERY)
    return one, two


def test_two_ranks_follow_one_process_and_write_one_truth(straight):
    one, two = straight
    assert_follows(two, one, range(1, TARGET + 1))
    assert steps_in_ledger(two) == list(range(1, TARGET + 1))  # rank 0 alone writes the ledger: no duplicates
    assert checkpoints(two) == [20, 40, 60] and all_valid(two)
    assert header(two / names.checkpoint_name(TARGET)) == header(one / names.checkpoint_name(TARGET))
    companions = [sorted(p.name for p in d.glob("step_*.json")) for d in (one, two)]
    assert companions[0] == companions[1]  # the same sidecars, written once (by rank 0)
    assert (two / "run.toml").read_text() == (one / "run.toml").read_text()
    assert not (two / "train.pid").exists() and not list(two.glob("*.tmp"))
    assert_state_close(two / names.checkpoint_name(TARGET), one / names.checkpoint_name(TARGET))


def test_a_torchrun_start_of_a_run_at_its_target_says_so_in_one_line_and_trains_nothing(straight, tmp_path):
    run = tmp_path / "two"
    shutil.copytree(straight[1], run)  # the two-rank run at TARGET; run.toml keeps train.steps = TARGET
    before = tree_digest(run)
    result = torchrun(run)  # exit 0, as a one-process start's
    said = [line for line in result.stdout.splitlines() if "nothing to train" in line]
    assert said == [f"{run}: nothing to train: already at its target step {TARGET} (train.steps, kept in run.toml "
                    f"from an earlier --steps or --set); `--steps N` with N > {TARGET} trains further, and run.toml "
                    "keeps N"], result.stdout  # once: rank 0's
    assert not re.search(r"^ready ", result.stdout, re.M) and tree_digest(run) == before  # no rank started the run


def test_sigterm_to_the_launcher_then_resume_on_two_ranks_and_on_one_then_two(straight, prepared, tmp_path):
    one, two = straight
    run = seed_data(prepared, tmp_path / "run")
    t = Launcher(launcher_argv(run, "--steps", str(TARGET), *FAR, *LIVE))
    try:
        t.worker_pids()
        t.wait_step(random.Random(13).randint(3, 12))
        t.proc.send_signal(signal.SIGTERM)
        t.wait_exit(60)  # torchrun itself exits 1 after a death signal (SignalException), by design
    finally:
        t.kill()
    out = t.output()
    (stopped,) = checkpoints(run)  # exactly one checkpoint ...
    assert stopped == steps_in_ledger(run)[-1] < TARGET  # ... at the ledger's last step
    assert not list(run.glob("*.tmp")) and all_valid(run)
    for rank in (0, 1):  # every worker finished its stop (and returned 0): no traceback from a worker
        assert f"andrea.control.run[{rank}]: stopped at step {stopped} (SIGTERM)" in out, out[-3000:]
    assert "andrea: error" not in out

    # 2 -> 1: the same stopped run, resumed by one process, follows the references to step 40 ...
    single, half = tmp_path / "single", 40
    shutil.copytree(run, single)
    result = train(single, "--steps", str(half), *FAR)
    assert result.returncode == 0, result.stderr
    assert_follows(single, one, range(stopped + 1, half + 1))
    assert_state_close(single / names.checkpoint_name(half), one / names.checkpoint_name(half))
    # ... and 1 -> 2: that checkpoint, written by one process, resumed by two ranks to TARGET.
    torchrun(single, "--steps", str(TARGET), *FAR)
    assert [e["step"] for e in ledger(single) if e.get("event") == "resume"] == [stopped, half]
    assert_follows(single, one, range(half + 1, TARGET + 1))
    assert_state_close(single / names.checkpoint_name(TARGET), one / names.checkpoint_name(TARGET))

    # 2 -> 2: bit-exact, the same bytes as the never-stopped two-rank run.
    torchrun(run, "--steps", str(TARGET), *FAR)
    name = names.checkpoint_name(TARGET)
    assert (run / name).read_bytes() == (two / name).read_bytes()
    assert [e["step"] for e in ledger(run) if e.get("event") == "resume"] == [stopped]


def test_ctl_and_pivot_reach_rank_0_and_a_sigkilled_worker_leaves_valid_checkpoints(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    t = Launcher(launcher_argv(run, "--steps", "100000", *FAR, *LIVE), extra_env=PACED)
    try:
        pids = t.worker_pids()
        t.wait_step(3)
        assert (run / "train.pid").read_text() == f"{pids[0]}\n"  # rank 0's: ctl never signals the launcher
        assert andrea("ctl", str(run), "checkpoint", "--timeout", "60").returncode == 0
        (first,) = checkpoints(run)  # one checkpoint for one step, written by both ranks
        t.wait_step(first + 5)  # training continues
        assert t.proc.poll() is None and checkpoints(run) == [first]
        for rank in (0, 1):
            assert f"andrea.writer[{rank}]: checkpoint {names.checkpoint_name(first)} committed" in t.output()
        # The hot pivot: `andrea pivot` signals rank 0 (SIGHUP to the launcher would kill the job); rank 0 shares
        # it at the next boundary and every rank switches policy at the same checkpoint.
        (tmp_path / "p.toml").write_text(POLICY)
        assert andrea("pivot", str(run), "--policy", str(tmp_path / "p.toml")).returncode == 0
        pivoted = [re.search(r"pivot at step (\d+)", t.wait_for(lambda l, r=r: f"andrea.control.run[{r}]: pivot at step" in l,
                                                                60)).group(1) for r in (0, 1)]
        assert pivoted[0] == pivoted[1]
        pivot_step = int(pivoted[0])
        t.wait_step(pivot_step + 3)
        (mark,) = [e for e in ledger(run) if e.get("event") == "pivot"]
        assert mark["step"] == pivot_step and (run / "archive" / "phase-0" / ".state.json").exists()
        assert checkpoints(run) == [first, pivot_step] and not (run / "policy.next.toml").exists()
        os.kill(pids[1], signal.SIGKILL)  # one worker, not the launcher
        assert t.wait_exit(120) != 0  # torchrun tears the job down
    finally:
        t.kill()
    assert checkpoints(run) == [first, pivot_step] and all_valid(run)
    newest = checkpoints(run)[-1]
    resumed = train(run, "--steps", str(newest + 3), *FAR)  # any world size resumes: here one process
    assert resumed.returncode == 0, resumed.stderr
    assert [e for e in ledger(run) if e.get("event") == "resume"][-1]["step"] == newest == pivot_step
    assert json.loads((run / ".state.json").read_text())["phase"] == 1  # the pivot's policy survives the resume
    assert not list(run.glob("*.tmp")) and all_valid(run)


def test_two_launchers_as_two_nodes_are_the_same_run_and_a_signal_to_one_worker_stops_both(straight, prepared,
                                                                                           tmp_path):
    _, two = straight
    run = seed_data(prepared, tmp_path / "run")
    port = free_port()
    nodes = [Launcher(launcher_argv(run, "--steps", "100000", *EVERY, *LIVE, launch=(
        "--nnodes=2", f"--node_rank={k}", "--nproc_per_node=1", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=andrea-test"))) for k in (0, 1)]
    try:
        rank1 = int(re.search(r"pid=(\d+)", nodes[1].wait_for(
            lambda l: l.startswith("ready ") and " rank=1/2" in l, 120)).group(1))
        nodes[0].wait_step(25)
        os.kill(rank1, signal.SIGTERM)  # SLURM may signal only some workers: one is enough
        assert [node.wait_exit(120) for node in nodes] == [0, 0]  # every worker exited 0
    finally:
        for node in nodes:
            node.kill()
    name = names.checkpoint_name(20)  # world size 2 across two nodes = the same run as two ranks on one
    assert (run / name).read_bytes() == (two / name).read_bytes()
    stopped = checkpoints(run)[-1]
    assert checkpoints(run) == list(range(20, stopped, 20)) + [stopped]  # the cadence's, then one for the stop
    assert stopped == steps_in_ledger(run)[-1] >= 25  # signalled once step 25 was reported
    assert steps_in_ledger(run) == list(range(1, stopped + 1)) and all_valid(run)
    assert "SIGTERM reached another rank" in nodes[0].output()


def node_on_its_own_disk(backing: Path, view: Path, k: int, port: int, *args: str) -> list[str]:
    """Node k's torchrun launcher (static rendezvous: node k holds rank k) in a mount namespace of its own where
    `view`, the run directory every node is told, is `backing`: the same path names another disk per node."""
    launcher = launcher_argv(view, *args, launch=("--nnodes=2", f"--node_rank={k}", "--nproc_per_node=1",
                                                  "--master_addr=127.0.0.1", f"--master_port={port}"))
    return ["unshare", "-m", "bash", "-c",
            f"mount --bind {shlex.quote(str(backing))} {shlex.quote(str(view))} && exec {shlex.join(launcher)}"]


def run_two_nodes(backing: list[Path], view: Path, *args: str) -> str:
    port = free_port()
    nodes = [Launcher(node_on_its_own_disk(backing[k], view, k, port, *args)) for k in (0, 1)]
    try:
        codes = [node.wait_exit(300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    out = "\n".join(node.output() for node in nodes)
    assert codes == [0, 0], out[-4000:]
    return out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_two_nodes_on_separate_disks_write_the_shared_runs_bytes_on_node_0_alone(straight, prepared, tmp_path):
    _, two = straight
    node0, node1, view = seed_data(prepared, tmp_path / "node0"), tmp_path / "node1", tmp_path / "run"
    node1.mkdir()  # nothing prepared: node 1 prepares its own copy of the data
    view.mkdir()
    out = run_two_nodes([node0, node1], view, "--steps", "20", "--checkpoint-every", "10")
    assert "is not one directory for all ranks" in out and list(view.iterdir()) == []
    assert checkpoints(node0) == [10, 20] and all_valid(node0)
    name = names.checkpoint_name(20)
    assert (node0 / name).read_bytes() == (two / name).read_bytes()  # the shared run's bytes
    assert steps_in_ledger(node0) == list(range(1, 21))
    # Node 1 holds its data, byte for byte node 0's, and nothing else: no checkpoint, no .tmp, no sidecar.
    held = {str(p.relative_to(node1)) for p in node1.rglob("*") if p.is_file()}
    assert held and all(p == "tokenizer.json" or p.startswith("data/") for p in held), held
    assert all((node1 / p).read_bytes() == (node0 / p).read_bytes() for p in held)

    # Resumed, with the run copied to both disks (node 1's copy must be neither read nor written) and a
    # retention that recycles the spare at every commit: still the shared run's bytes.
    shutil.rmtree(node1)
    shutil.copytree(node0, node1)
    before = tree_digest(node1)
    orphan = node1 / (names.checkpoint_name(30) + ".tmp")  # what main's sharded commit left on node 1
    orphan.write_bytes(b"\0" * 4096)
    out = run_two_nodes([node0, node1], view, "--steps", "40", "--checkpoint-every", "5",
                        "--set", "checkpoint.keep_last=1", "--set", "guard.enabled=false")  # no candidate kept
    assert [e["step"] for e in ledger(node0) if e.get("event") == "resume"] == [20]
    # 25 and 30 released in turn: 35 and 40 were written into the spare
    assert checkpoints(node0)[-1] == 40 and not {25, 30, 35} & set(checkpoints(node0))
    assert (node0 / names.SPARE_NAME).exists()
    name = names.checkpoint_name(40)
    assert (node0 / name).read_bytes() == (two / name).read_bytes() and all_valid(node0)
    assert tree_digest(node1) == before and not orphan.exists()  # node 1's first rank removed the orphan
    assert not list(node0.glob("*.tmp")) and "andrea: error" not in out


def test_a_global_batch_that_does_not_split_is_one_line(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    result = andrea("train", *TINY, "--run-dir", str(run), "--set", "train.batch_size=7",
                    extra_env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "andrea: error: train.batch_size=7 (the global batch) is not divisible by the world size 2 "
        "(torchrun --nnodes × --nproc_per_node)")
    assert sorted(p.name for p in run.rglob("*")) == before


def test_ranks_that_disagree_on_the_weights_are_an_incident_rolled_back_to_an_agreed_checkpoint(prepared, tmp_path):
    """Issue 46: a silently corrupted GPU. The test hook flips one mantissa bit of one weight on rank 1 after step 40
    (control/parallel/agreement.py): at step 40's checkpoint the ranks' digests differ. That checkpoint is never written;
    a rank_mismatch marker and notice, the guard's incident and its rollback to step 20 (known-good, committed while
    the ranks agreed) follow, and the run reaches its target with every checkpoint valid."""
    from tests.notices import Inbox
    run = seed_data(prepared, tmp_path / "run")
    inbox = Inbox()
    quiet = [a for k in ("loss_sigmas", "loss_margin", "grad_sigmas", "grad_margin") for a in ("--set", f"guard.{k}=1e9")]
    result = subprocess.run(launcher_argv(run, "--steps", str(TARGET), *EVERY, "--set", "guard.confirm_steps=10",
                                          *quiet, "--set", f'notify.url="{inbox.url}"'),
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**env(), "ANDREA_TEST_FLIP_WEIGHT": "40@1"})
    assert result.returncode == 0, result.stderr[-4000:]
    events = [e for e in ledger(run) if e.get("event") in ("rank_mismatch", "incident", "rollback")]
    assert [(e["event"], e["step"]) for e in events] == [("rank_mismatch", 40), ("incident", 40), ("rollback", 20)]
    mismatch, incident, rollback = events
    assert mismatch["ranks"] == [1] and len(set(mismatch["digests"])) == 2
    assert "ranks disagree on the weights" in incident["reason"] and rollback["checkpoint"] == "step_000020.bin"
    assert inbox.wait_for("rank_mismatch")["ranks"] == [1]
    assert checkpoints(run) == [20, 40, 60] and all_valid(run)  # 40: the one trained again, agreed on
