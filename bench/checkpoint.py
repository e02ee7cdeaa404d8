"""Async checkpoint throughput: andrea's snapshot + CheckpointWriter against torch.save and DCP async_save.

What one checkpoint costs a run, measured side by side on the same state (the flat fp32 `[w | m | v]` of a preset,
or of `--synthetic-params N` parameters) and the same directory:

    andrea        stall = Trainer.snapshot into a CheckpointWriter staging buffer, launched on a training thread
                  as control/run/runtime.py does. The copy overlaps the next step (a copy stream on CUDA, the
                  trainer's copy thread on CPU): on CUDA stall = the host hand-off + the extra time of the next
                  step over the one before; on CPU (a step of the preset's batch takes seconds) and for a
                  synthetic size, until the copy is done (what a CPU run pays: bench/checkpoint_e2e.py).
                  Throughput = checkpoint bytes / the writer's commit seconds (O_DIRECT write of the staged image
                  + ftruncate + fsync + rename + directory fsync, on the I/O thread); CPU = the I/O thread's
                  user + sys over the commit (CommitResult.cpu_seconds).
    andrea buffered  the same writer with O_DIRECT off: the buffered path (page cache + fsync) that a filesystem
                  refusing O_DIRECT gets, and that every commit took before O_DIRECT: the CPU baseline.
    torch.save    torch.save({"model": state_dict, "optim": AdamW.state_dict()}) + fsync of a per-parameter
                  nn.Module holding the same values; synchronous, so stall = throughput time = the whole save.
    dcp.async     torch.distributed.checkpoint.async_save of that state dict (single-process gloo group on a
                  FileStore); stall = until it returns, throughput = bytes / until its future completes.
    buffered write   write() of the 8 + 12·n checkpoint bytes (64 MiB calls) + fsync: the page-cache floor.
    O_DIRECT write   the same bytes, padded to 4096, from an aligned buffer with O_DIRECT + fsync: the disk floor.
    memcpy        one copy of the 12·n payload into a preallocated host buffer: the staging floor.
CPU is time.thread_time() (user + sys) of the thread that made the write calls; "-" where that is not one thread.

Plus, for a preset, the cadence cost: median Trainer.train_step time on random tokens of the preset's batch and
overhead = andrea's stall / (every · step time), with every = checkpoint.every (100). The step after a snapshot
runs while its snapshot copy and its commit are in flight; its extra time is reported too (on CPU the copy and
I/O threads share the cores with training).

Each repeat runs every method once, in turn, after an untimed warm-up round (first-touch page faults, DCP's
staging set-up); files are deleted and the page cache flushed (os.sync) between methods, outside the timings.
So every file here is a new one, like the floors': a run's first keep_last + 1 commits. The commits after them
write into the spare (andrea/rundir/spare.py), measured against this case by `--writers 2` ("one writer, spare").
Targets, printed with PASS/MISS: stall <= 1.5x memcpy; andrea throughput >= 0.9x the O_DIRECT floor; andrea's
commit CPU <= 0.1x the buffered writer's (each the median of the per-round ratios: methods of one round share the
machine's state); cadence overhead <= 1%. Timings describe this machine; nothing here fails on them. The cost a
whole training process pays, measured from outside it: bench/checkpoint_e2e.py.

Reads the preset (andrea/presets/*.toml). Writes checkpoints only in a fresh temporary directory made under `--dir`
(default: beside the repository; not /dev/shm, which would measure RAM, not a disk) and removed afterwards; a
markdown report to stdout (bench/checkpoint_report.py); with `--json PATH`, the raw seconds of every repeat.

    python bench/checkpoint.py --preset andrea-12m --json out.json
    python bench/checkpoint.py --preset andrea-120m --repeats 3 --steps 0   # 1.45 GB; skip the minutes-long CPU step
    python bench/checkpoint.py --synthetic-params 50000000 --repeats 5 --dir /mnt/nvme/tmp
    python bench/checkpoint.py --preset andrea-12m --writers 2   # distributed mode: 2 ZeRO-1 writers vs one
    python bench/checkpoint.py --preset andrea-120m --methods andrea memcpy "O_DIRECT write"   # the stall vs the floors
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.rundir import checkpoint as ckpt  # noqa: E402
from andrea.rundir.checkpoint_write import DIRECT_ALIGN, DirectIO
from andrea.config import schema as config_mod
from andrea.config import load as configload  # noqa: E402
from andrea.control.commit.writer import CheckpointWriter, staging_image  # noqa: E402
from andrea.control.run.trainer import FlatState, Trainer, resolve_device  # noqa: E402
from andrea.rundir.retention import Policy, Retention  # noqa: E402
from checkpoint_report import fs_type, median, report, targets  # noqa: E402  (beside this file: sys.path[0])

METHODS = ("andrea", "andrea buffered", "torch.save", "dcp.async_save", "buffered write", "O_DIRECT write", "memcpy")
REQUIRED = ("andrea", "andrea buffered", "buffered write", "O_DIRECT write", "memcpy")  # failures here are errors


# --- the state under test ------------------------------------------------------------------------------------
def andrea_trainer(cfg: config_mod.RunConfig | None, n: int, device: torch.device) -> Trainer:
    """The real Trainer of a preset; for a synthetic size, a Trainer shell holding only a FlatState of n.

    The shell runs the real `Trainer.snapshot` (it reads only `state`, `device` and the copy stream). m and v are
    filled as training leaves them: a fresh torch.zeros maps the shared zero page, which copies unrealistically fast.
    """
    if cfg is not None:
        trainer = Trainer(cfg, device, "torch")
    else:
        trainer = Trainer.__new__(Trainer)
        trainer.device, trainer.state, trainer._snapshot_done = device, FlatState(n, device), None
        trainer._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        trainer._copier = None if device.type == "cuda" else ThreadPoolExecutor(1, thread_name_prefix="andrea-snapshot")
        trainer.state.w.normal_(0.0, 0.02)
    trainer.state.m.normal_(0.0, 1e-3)
    trainer.state.v.uniform_(0.0, 1e-6)
    return trainer


def reference_state(cfg: config_mod.RunConfig | None, trainer: Trainer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A per-parameter nn.Module + AdamW holding the same w, m, v as the trainer (what a plain-torch run saves)."""
    state = trainer.state
    if cfg is not None:
        from andrea.model.gpt import GPT
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.to_empty(device=trainer.device)
        params = list(model.parameters())
    else:  # a synthetic size: 16 tensors of about n/16 each
        sizes = [len(c) for c in torch.arange(state.n).chunk(16)]
        model = nn.ParameterList(nn.Parameter(torch.empty(s, device=trainer.device)) for s in sizes)
        params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    offset = 0
    with torch.no_grad():
        for p in params:
            k = p.numel()
            p.copy_(state.w[offset:offset + k].view_as(p))
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": state.m[offset:offset + k].view_as(p).clone(),
                            "exp_avg_sq": state.v[offset:offset + k].view_as(p).clone()}
            offset += k
    assert offset == state.n, (offset, state.n)
    return model, opt


# --- one measurement per method: (stall seconds, total seconds, bytes on disk, CPU seconds or None) ------------
class AndreaCheckpoint:
    """Snapshot + commit exactly as control/run/runtime.py: snapshot on the training thread, commit on the I/O thread."""

    def __init__(self, trainer: Trainer, run_dir: Path, batch: tuple[torch.Tensor, torch.Tensor] | None):
        self.trainer, self.run_dir, self.batch = trainer, run_dir, batch
        self.train_pool = ThreadPoolExecutor(1, thread_name_prefix="andrea-train")
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix="andrea-io")
        self.writer = CheckpointWriter(run_dir, trainer.state.n, trainer.device, self.io_pool,
                                       retention=Retention(Policy(keep_last=1 << 30)))  # off: the bench deletes files
        self.step = 0

    def _timed_step(self) -> float:
        t0 = time.perf_counter()
        self.trainer.train_step(self.step, *self.batch)
        torch.cuda.synchronize(self.trainer.device)
        return time.perf_counter() - t0

    async def once(self, direct: bool = True) -> tuple[float, float, int, float, dict]:
        """One checkpoint; direct=False: the same writer with O_DIRECT off (the buffered path)."""
        loop = asyncio.get_running_loop()
        self.writer.direct = DirectIO(direct)
        self.step += 1
        extra = {}
        use_next_step = self.batch is not None
        if use_next_step:
            base = await loop.run_in_executor(self.train_pool, self._timed_step)
        slot = await self.writer.free_slot()
        t0 = time.perf_counter()
        fence = await loop.run_in_executor(self.train_pool, self.trainer.snapshot, self.writer.staging[slot])
        host_stall = time.perf_counter() - t0
        fut = self.writer.start_commit(slot, self.step, fence)
        stall = host_stall
        if not use_next_step:  # no step to hide behind: the copy is the stall
            fence.synchronize()
            stall = time.perf_counter() - t0
        else:  # the copy overlaps this step (copy stream / copy thread); only its slowdown is a stall
            nxt = await loop.run_in_executor(self.train_pool, self._timed_step)
            stall += max(0.0, nxt - base)
            extra = {"host_stall_s": host_stall, "base_step_s": base, "next_step_s": nxt}
        result = await fut
        if result.error:
            raise RuntimeError(result.error)
        if result.direct != direct:
            raise RuntimeError(f"{self.run_dir}: the filesystem refuses O_DIRECT ({self.writer.direct.refusal}); "
                               "pass --dir on a disk filesystem")
        return stall, result.seconds, ckpt.checkpoint_bytes(self.trainer.state.n), result.cpu_seconds, extra

    def close(self) -> None:
        self.train_pool.shutdown()
        self.io_pool.shutdown()


def torch_save_once(model, opt, path: Path) -> tuple[float, float, int, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    return seconds, seconds, path.stat().st_size, time.thread_time() - c0


def dcp_once(model, opt, path: Path) -> tuple[float, float, int, None]:
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(path))
    stall = time.perf_counter() - t0
    getattr(pending, "upload_completion", pending).result()  # AsyncSaveResponse (custom stager) or Future
    total = time.perf_counter() - t0
    return stall, total, sum(p.stat().st_size for p in path.rglob("*") if p.is_file()), None  # its own threads


def floor_write_once(image: memoryview, size: int, path: Path, direct: bool) -> tuple[float, float, int, float]:
    """write() + fsync of the checkpoint's `size` bytes: buffered, or O_DIRECT of the aligned image up to 4096."""
    length = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN if direct else size
    t0, c0 = time.perf_counter(), time.thread_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for lo in range(0, length, ckpt.WRITE_CHUNK):
            chunk = image[lo:min(length, lo + ckpt.WRITE_CHUNK)]
            written = 0
            while written < len(chunk):
                written += os.pwrite(fd, chunk[written:], lo + written)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    return seconds, seconds, size, time.thread_time() - c0


def memcpy_once(src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, int, None]:
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=src.device.type == "cuda")
    if src.device.type == "cuda":
        torch.cuda.synchronize(src.device)
    seconds = time.perf_counter() - t0
    return seconds, seconds, src.numel() * src.element_size(), None  # torch may copy on several threads


def settle(directory: Path) -> None:
    """Delete what a method wrote and flush the page cache, so no method pays for another's write-back."""
    for p in directory.iterdir():
        if p.name == "pg-store":
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    os.sync()


def init_single_process_group(directory: Path) -> str:
    """DCP runs without a group in torch 2.13 (with a warning); a 1-rank gloo group is what a real job has."""
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed unavailable"
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{directory / 'pg-store'}", rank=0, world_size=1)
    return "gloo, 1 rank, FileStore"


# --- the cadence cost ------------------------------------------------------------------------------------------
def random_batch(cfg: config_mod.RunConfig, batch_size: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch_size, cfg.model.block_size + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def step_times(trainer: Trainer, batch, warmup: int, steps: int, start: int = 0) -> tuple[list[float], list[float]]:
    """(warm-up seconds, measured seconds) of train_step, synchronised on CUDA."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        trainer.train_step(start + i, *batch)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        times.append(time.perf_counter() - t0)
    return times[:warmup], times[warmup:]


async def step_during_commit(bench: AndreaCheckpoint, trainer: Trainer, batch, direct: bool) -> dict:
    """One checkpoint taken between steps as the runtime does, then the next step while the commit is in flight."""
    loop = asyncio.get_running_loop()
    bench.writer.direct = DirectIO(direct)
    slot = await bench.writer.free_slot()
    t0 = time.perf_counter()
    fence = await loop.run_in_executor(bench.train_pool, trainer.snapshot, bench.writer.staging[slot])
    stall = time.perf_counter() - t0
    bench.step += 1
    fut = bench.writer.start_commit(slot, bench.step, fence)
    t1 = time.perf_counter()
    await loop.run_in_executor(bench.train_pool, lambda: step_times(trainer, batch, 0, 1, start=10_000))
    next_step = time.perf_counter() - t1
    result = await fut
    return {"stall_s": stall, "next_step_s": next_step, "commit_s": result.seconds, "commit_cpu_s": result.cpu_seconds,
            "commit_overlapped_step": result.seconds < next_step}


# --- main ------------------------------------------------------------------------------------------------------
async def measure(args, cfg, trainer: Trainer, directory: Path) -> dict:
    device = trainer.device
    n = trainer.state.n
    batch = random_batch(cfg, args.batch_size or cfg.train.batch_size, device) if cfg is not None else None
    methods: dict[str, dict] = {name: {"status": "ok", "stall_s": [], "total_s": [], "cpu_s": [], "warmup": None,
                                       "bytes": 0} for name in METHODS}
    notes = {"andrea": "stall: snapshot on the copy thread (CPU) or copy stream (CUDA); write: O_DIRECT commit on "
                       "the I/O thread",
             "andrea buffered": "the same writer, O_DIRECT off (the fallback path; every commit before O_DIRECT)",
             "torch.save": "synchronous: stall = whole save + fsync",
             "dcp.async_save": "stall: until async_save returns; write: until its future completes",
             "buffered write": "write() + fsync of the 8+12n bytes: the page-cache floor",
             "O_DIRECT write": "O_DIRECT write + fsync of the same bytes (padded to 4096): the disk floor",
             "memcpy": "copy of 12n bytes into a preallocated host buffer: the staging floor"}
    for name, m in methods.items():
        m["note"] = notes[name]
        if name not in args.methods:
            methods[name] = {"status": "skipped", "reason": "not in --methods"}

    andrea_bench = AndreaCheckpoint(trainer, directory, batch if device.type == "cuda" else None)
    wants_copy = {"torch.save", "dcp.async_save"} & set(args.methods)  # a second copy of the state: only for them
    model, opt = reference_state(cfg, trainer) if wants_copy else (None, None)
    try:
        if "dcp.async_save" in args.methods:
            methods["dcp.async_save"]["process_group"] = init_single_process_group(directory)
    except Exception as e:  # noqa: BLE001 - any failure here is reported in the table instead of a number
        methods["dcp.async_save"] = {"status": "skipped", "reason": f"process group: {type(e).__name__}: {e}"}
    # The floors' file image: header + [w | m | v] at byte 8 of an aligned buffer, as the writer stages it; the
    # memcpy floor copies into its payload view (zeroed first: the floor is a warm copy).
    image = staging_image(n, pinned=device.type == "cuda")
    host = image[ckpt.HEADER.size:ckpt.HEADER.size + 12 * n].view(torch.float32)
    image[:ckpt.HEADER.size].copy_(torch.frombuffer(bytearray(ckpt.header(1, n)), dtype=torch.uint8))
    host.copy_(trainer.state.buffer)
    image_view, size = memoryview(image.numpy()).cast("B"), ckpt.checkpoint_bytes(n)

    runners = {
        "andrea": lambda r: andrea_bench.once(direct=True),
        "andrea buffered": lambda r: andrea_bench.once(direct=False),
        "torch.save": lambda r: torch_save_once(model, opt, directory / f"torch_{r}.pt"),
        "dcp.async_save": lambda r: dcp_once(model, opt, directory / f"dcp_{r}"),
        "buffered write": lambda r: floor_write_once(image_view, size, directory / f"buffered_{r}.bin", False),
        "O_DIRECT write": lambda r: floor_write_once(image_view, size, directory / f"direct_{r}.bin", True),
        "memcpy": lambda r: memcpy_once(trainer.state.buffer, host),
    }
    for r in range(-1, args.repeats):  # round -1: the untimed warm-up
        for name in METHODS:
            m = methods[name]
            if m["status"] != "ok":
                continue
            try:
                if name.startswith("andrea"):
                    stall, total, nbytes, cpu, extra = await runners[name](r)
                    if extra:
                        m.setdefault("cuda_detail", []).append(extra)
                else:
                    stall, total, nbytes, cpu = runners[name](r)
            except Exception as e:  # noqa: BLE001 - e.g. DCP unsupported here: say why, keep the others
                if name in REQUIRED:
                    raise
                methods[name] = {"status": "skipped", "reason": f"{type(e).__name__}: {e}"}
                settle(directory)
                continue
            if r < 0:
                m["warmup"] = {"stall_s": stall, "total_s": total, "cpu_s": cpu}
            else:
                m["stall_s"].append(stall)
                m["total_s"].append(total)
                if cpu is not None:
                    m["cpu_s"].append(cpu)
            m["bytes"] = nbytes
            settle(directory)
    del model, opt, host, image, image_view

    cadence = None
    if cfg is None:
        cadence = {"status": "skipped", "reason": "a synthetic size has no model to step; use --preset"}
    elif args.steps == 0:
        cadence = {"status": "skipped", "reason": "--steps 0"}
    else:
        warm, measured = step_times(trainer, batch, args.warmup_steps, args.steps)
        during = await step_during_commit(andrea_bench, trainer, batch, direct=True)
        settle(directory)
        during_buffered = await step_during_commit(andrea_bench, trainer, batch, direct=False)
        settle(directory)
        step = median(measured)
        stall = median(methods["andrea"]["stall_s"])
        every = cfg.checkpoint.every
        cadence = {"status": "ok", "batch_size": batch[0].shape[0], "block_size": batch[0].shape[1],
                   "warmup_s": warm, "step_s": measured, "step_median_s": step, "every": every, "stall_s": stall,
                   "overhead": stall / (every * step), "during_commit": during,
                   "during_buffered_commit": during_buffered,
                   "overhead_with_interference": (stall + max(0.0, during["next_step_s"] - step)) / (every * step)}
    andrea_bench.close()
    return {"methods": methods, "cadence": cadence}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--preset", help="an andrea preset (default andrea-12m): its Trainer and its real state size")
    size.add_argument("--synthetic-params", type=int, metavar="N", help="a flat state of N parameters, no model")
    p.add_argument("--dir", help="target directory (default: a temporary directory beside the repository)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up round (default 5)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured train steps for the cadence cost (default 3; 1 for andrea-120m on CPU; 0 skips)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed train steps before those (default 1; 0 for andrea-120m on CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="train-step batch (default: the preset's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--json", metavar="PATH", help="also write every raw timing as JSON")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                   help="measure only these (default: all); the others are reported as not measured")
    p.add_argument("--writers", type=int, default=1,
                   help="N > 1: the distributed mode (bench/checkpoint_dist.py): N ZeRO-1 writers into one "
                        "file against one writer, on the same bytes, printed as ratios")
    args = p.parse_args(argv)
    if args.preset is None and args.synthetic_params is None:
        args.preset = "andrea-12m"
    if args.repeats < 1 or (args.synthetic_params is not None and args.synthetic_params < 1):
        p.error("--repeats and --synthetic-params must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.writers > 1:
        import checkpoint_dist  # beside this file (sys.path[0] when run as a script)
        forwarded = ["--writers", str(args.writers), "--repeats", str(args.repeats)]
        for flag, value in (("--preset", args.preset), ("--synthetic-params", args.synthetic_params),
                            ("--dir", args.dir), ("--json", args.json)):
            if value is not None:
                forwarded += [flag, str(value)]
        return checkpoint_dist.main(forwarded)
    device = resolve_device(args.device)
    cfg = configload.load(preset=args.preset) if args.preset else None
    slow = args.preset == "andrea-120m" and device.type == "cpu"  # minutes per step on a few cores
    if args.steps is None:
        args.steps = 1 if slow else 3
    if args.warmup_steps is None:
        args.warmup_steps = 0 if slow else 1
    trainer = andrea_trainer(cfg, args.synthetic_params or 0, device)
    parent = Path(args.dir) if args.dir else REPO.parent
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="andrea-bench-ckpt-", dir=parent))  # ours alone: settle() empties it
    try:
        res = asyncio.run(measure(args, cfg, trainer, directory))
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(directory, ignore_errors=True)
    n = trainer.state.n
    res.update(subject=args.preset or "synthetic", n_params=n, payload_bytes=12 * n, device=str(device),
               dir=str(directory), fs=fs_type(parent), repeats=args.repeats,
               torch=torch.__version__, threads=torch.get_num_threads())
    if device.type == "cuda":
        res["device"] = f"cuda ({torch.cuda.get_device_name(device)})"
    res["targets"] = targets(res)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
