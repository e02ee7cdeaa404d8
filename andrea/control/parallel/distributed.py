"""Data parallelism over `torch.distributed`, as `torchrun` launches it: the world, its process groups, the ZeRO-1
shard bounds and the few collectives andrea uses.

Reads only the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); writes nothing.
`World()` (the default) is one process and every method is a no-op, so the single-process path is unchanged.

Three process groups, one per thread that talks to the others — collectives on one group must be issued in the
same order on every rank, and a group shared by two threads would interleave differently per rank:
    default   the training thread: gradient reduce-scatter, grad-norm all-reduce, weight all-gather, the
              per-sequence losses (NCCL on CUDA, gloo on CPU);
    control   the event loop: start-up barrier and broadcast, the request exchange at each step boundary (gloo,
              CPU tensors: never waits behind the GPU stream);
    io        the I/O thread: the sharded checkpoint commit's exchange, votes and verdict (gloo).

Whether the ranks share one run directory (`shared_dir`, `view`) is not torchrun's to say: control/parallel/sharing.py
probes it at start and records it here, where every collaborator of the run already looks.

ZeRO-1 shard bounds: the flat length n is padded up to a multiple of the world size P (pad = P·ceil(n/P) - n zeros
at the end of the gradient and weight buffers, never in a checkpoint); rank r owns [r·s, min((r+1)·s, n)) with
s = ceil(n/P). A rank's slice may be shorter than s (the last) or empty (P > n, in principle).
With train.optimizer = "muon" the boundaries (`cuts`, P + 1 offsets) are placed by `whole_cuts` instead: each the
equal split's, moved to the nearer end of a Muon matrix it would cut (Muon orthogonalises whole matrices on the
rank that owns them, andrea/optim/muon.py). The ZeroTrainer records them on the World (`World.cuts`), where the
sharded and gathered checkpoint commits and the payload sharing read them: every slice of the run is the same.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

from andrea.model import memory
from andrea.config.check import ConfigError

log = logging.getLogger("andrea.control.parallel.distributed")
T = TypeVar("T")

CONTROL_TIMEOUT = timedelta(hours=6)
"""The control group waits this long at a barrier: long enough for rank 0's first-start data preparation
(tokenizer training on a large corpus); a dead peer is reported at once by gloo regardless."""


def shard_size(n: int, size: int) -> int:
    """Elements per rank after padding n up to a multiple of `size`."""
    return -(-n // size)


def shard_bounds(n: int, size: int, rank: int, cuts: tuple[int, ...] | None = None) -> tuple[int, int]:
    """[lo, hi) of the flat buffer owned by `rank`: contiguous, in rank order, covering [0, n) exactly once; the
    equal split, or `cuts[rank], cuts[rank + 1]` when the optimizer placed the boundaries (`whole_cuts`)."""
    if cuts is not None:
        return cuts[rank], cuts[rank + 1]
    s = shard_size(n, size)
    lo = min(rank * s, n)
    return lo, min(lo + s, n)


def whole_cuts(n: int, size: int, spans: list[tuple[int, int]]) -> tuple[int, ...]:
    """The P + 1 shard boundaries nearest the equal split's that cut no span (offset, numel) in two: a boundary
    inside one moves to its nearer end (its start on a tie). Monotone, 0 first and n last; a rank's slice may be
    empty when one span is larger than a shard. Pure: the same on every rank, in every process of the run."""
    s, cuts = shard_size(n, size), [0]
    for r in range(1, size):
        c = min(r * s, n)
        for offset, numel in spans:
            if offset < c < offset + numel:
                c = offset if c - offset <= offset + numel - c else offset + numel
                break
        cuts.append(max(c, cuts[-1]))
    return tuple(cuts + [n])


def row_bounds(batch_size: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the global batch's rows that `rank` computes (the batch is split evenly, in rank order)."""
    rows = batch_size // size
    return rank * rows, (rank + 1) * rows


def check_batch(batch_size: int, size: int, micro_batch_size: int | str = 0) -> None:
    """The global batch splits evenly over the ranks, and each rank's rows into equal micro-batches."""
    if batch_size % size:
        raise ConfigError(f"train.batch_size={batch_size} (the global batch) is not divisible by the world size "
                          f"{size} (torchrun --nnodes × --nproc_per_node)")
    rows = batch_size // size
    problem = memory.check_micro_batch(micro_batch_size, rows, f"the {rows} rows of each of the {size} ranks "
                                       f"(train.batch_size={batch_size})" if size > 1 else None)
    if problem:
        raise ConfigError(problem)


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    groups: dict[str, Any] = field(default_factory=dict)  # "control", "io" (the default group is torch's)
    shared_dir: bool = True  # every rank sees rank 0's run directory (control/parallel/sharing.py; one process: trivially)
    view: int = 0  # the lowest rank that sees the same run directory as this one (rank 0's: 0)
    cuts: tuple[int, ...] | None = None  # ZeRO-1's boundaries when the optimizer placed them (whole_cuts), else None

    def shard_bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of `rank`'s (this rank's) ZeRO-1 slice of the flat n: the run's bounds, `cuts` or equal."""
        return shard_bounds(n, self.size, self.rank if rank is None else rank, self.cuts)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "World":
        """The world torchrun describes in the environment; one process when WORLD_SIZE is absent or 1."""
        try:
            size = int(env.get("WORLD_SIZE", "1"))
            rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={size})")
        return cls(rank, size, local)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def device(self, device: torch.device) -> torch.device:
        """On CUDA each process drives the GPU of its LOCAL_RANK. This makes it current on the calling thread
        only: every other thread that touches the GPU starts with `thread_initializer(device)`."""
        if not self.distributed or device.type != "cuda":
            return device
        torch.cuda.set_device(self.local_rank)
        return torch.device("cuda", self.local_rank)

    @staticmethod
    def thread_initializer(device: torch.device) -> Callable[[], None] | None:
        """A thread pool's `initializer` that makes `device` its threads' current CUDA device (None off CUDA).

        CUDA's current device is per host thread, and a new thread starts on device 0. Triton's launcher takes
        its device and stream from torch.cuda.current_device(), and an event recorded without a stream lands on
        the current device's current stream: a thread left on device 0 makes rank r > 0 launch into GPU 0's
        context with cuda:r pointers. A device without an index (one process) means the caller's current one:
        device 0 until someone chose another (asked without initializing CUDA on the caller's thread)."""
        if device.type != "cuda":
            return None
        index = device.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0

        def make_current() -> None:
            torch.cuda.set_device(index)
        return make_current

    def init(self, device: torch.device, timeout_s: float | None = None) -> None:
        """Join the process group (env:// rendezvous prepared by torchrun) and create the side groups.

        `timeout_s` (the watchdog's collective_timeout_s, config/schema.py): how long a collective of the training or the
        I/O thread waits for a peer before it fails; past it the job comes down instead of waiting forever on a
        hung rank (the watchdog of each rank has spoken first). None: torch's default."""
        if not self.distributed:
            return
        import torch.distributed as dist
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group(backend, rank=self.rank, world_size=self.size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        self.groups["control"] = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.groups["io"] = dist.new_group(backend="gloo", timeout=timeout)
        root = logging.getLogger()
        for h in root.handlers:  # every rank logs to the launcher's stderr: say which one speaks
            fmt = getattr(h.formatter, "_fmt", None)
            if fmt and "%(name)s" in fmt:
                h.setFormatter(logging.Formatter(fmt.replace("%(name)s", f"%(name)s[{self.rank}]")))
        log.info("rank %d of %d (local rank %d, %s)", self.rank, self.size, self.local_rank, backend)

    def quiet(self) -> None:
        """After the run's signal handlers are gone: a launcher's late forward of SIGTERM/SIGINT (it signals
        workers one by one) must not turn a clean exit into a death by signal."""
        if self.distributed:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_IGN)

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()

    # --- control-group helpers (event loop / start-up) --------------------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier(group=self.groups["control"])

    def leader_first(self, fn: Callable[..., T], *args: Any) -> T:
        """Rank 0 runs fn first (it may create files); the others wait, then run it (and only read)."""
        if self.leader:
            out = fn(*args)
        self.barrier()
        return fn(*args) if not self.leader else out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (pickled; small objects only)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.groups["control"])
        return box[0]

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank (pickled; small objects only)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.groups["control"])
        return out

    def all_gather_bytes(self, t: torch.Tensor, group: str = "io") -> list[torch.Tensor]:
        """Every rank's `t` (a small uint8 tensor of the same shape on every rank), in rank order (one gloo
        all-gather)."""
        if not self.distributed:
            return [t]
        import torch.distributed as dist
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.groups[group])
        return out

    def to_leader(self, value: int, group: str = "io") -> list[int] | None:
        """Every rank's int at rank 0, in rank order (point to point: each rank sends one message and goes on;
        rank 0 waits for them all); None on the others."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        if not self.leader:
            dist.send(t, group=self.groups[group], group_dst=0)
            return None
        out = [value]
        for r in range(1, self.size):
            dist.recv(t, group=self.groups[group], group_src=r)
            out.append(int(t))
        return out

    def from_leader(self, value: int, group: str = "io") -> int:
        """Rank 0's int on every rank (point to point: rank 0 sends it to each and goes on, without the
        round trip of a collective; the others wait for it). `value` is read on rank 0 only."""
        if not self.distributed:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        if self.leader:
            for r in range(1, self.size):
                dist.send(t, group=self.groups[group], group_dst=r)
            return value
        dist.recv(t, group=self.groups[group], group_src=0)
        return int(t)

    def broadcast_tensor(self, t: torch.Tensor, group: str = "control") -> None:
        """Rank 0's `t` into every rank's `t` (a contiguous CPU tensor of the same shape everywhere)."""
        if self.distributed:
            import torch.distributed as dist
            dist.broadcast(t, group=self.groups[group], group_src=0)

    def send(self, t: torch.Tensor, to: int, group: str) -> None:
        """`t` (contiguous, CPU) to rank `to`, which receives it with `recv` into a tensor of its shape."""
        import torch.distributed as dist
        dist.send(t, group=self.groups[group], group_dst=to)

    def recv(self, t: torch.Tensor, src: int, group: str) -> None:
        """Rank `src`'s `send` into `t` (contiguous, CPU, of the sent shape)."""
        import torch.distributed as dist
        dist.recv(t, group=self.groups[group], group_src=src)

    def max_ints(self, values: list[int], group: str = "control") -> list[int]:
        """Elementwise MAX over ranks of a short int64 vector (one tiny gloo all-reduce)."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups[group])
        return t.tolist()


# --- default-group collectives (the training thread) --------------------------------------------------------
def reduce_scatter_mean(out: torch.Tensor, flat: torch.Tensor) -> None:
    """out (s,) = this rank's slice of the mean over ranks of flat (P·s,)."""
    import torch.distributed as dist
    dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.AVG)


def all_reduce_min(t: torch.Tensor) -> None:
    import torch.distributed as dist
    dist.all_reduce(t, op=dist.ReduceOp.MIN)


def all_reduce_sum(t: torch.Tensor) -> None:
    import torch.distributed as dist
    dist.all_reduce(t, op=dist.ReduceOp.SUM)


def all_gather(out: torch.Tensor, part: torch.Tensor) -> None:
    """out (P·k,) = every rank's part (k,), in rank order."""
    import torch.distributed as dist
    dist.all_gather_single(out, part)
