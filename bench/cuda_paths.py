"""GPU only: the CUDA paths the CPU suite tests with fakes (tests/e2e/test_cuda_paths.py), measured on a real device.

Each probe prints one row (probe, verdict, figures) and decides something issue #27 left to a GPU:
    thread_device    every executor thread started with World.thread_initializer sees the rank's device, through
                     torch and through Triton's own driver (what a launch uses). With >= 2 GPUs the probe plays the
                     last GPU's rank and also shows the bug it fixes: a bare thread sees device 0.
    pinned_staging   the checkpoint's staging image (control/commit/writer.py) registered at its exact size vs PyTorch's
                     pinned allocator (rounded up to a power of two): bytes reserved, is_pinned(), D2H GB/s into
                     each, and the copy landing intact. Decides: keep the registration (equal GB/s) or not.
    o_direct_pinned  commit_image with O_DIRECT from each kind of pinned image: whether this host refuses it
                     (EFAULT: memory the kernel cannot pin for DMA) and falls back to buffered.
    blocking_event   CPU seconds a host thread burns in synchronize() on a ~0.3 s kernel: a default event (spins)
                     vs blocking=True (sleeps). Decides whether the fences' blocking=True pays (it frees a core).
    sdpa_backward    two identical bf16 SDPA backwards (the `--kernels torch` attention) compared bit for bit,
                     then again under torch.use_deterministic_algorithms(True). Decides docs/architecture.md's line on
                     `--kernels torch` on CUDA: keep "curve, not bytes", or offer the deterministic switch.
    attn_bwd_shapes  the bf16 attention backward at head dim 64 (both presets' shape) timed under the pinned launch
                     shape, whose dK/dV kernel spills (255 registers, 24-28 B on sm_80/89/90 by the compile check),
                     and under the spill-free candidates the compile check found (docs/testing.md, "Compiled for
                     real GPUs"). Decides item 6: adopt the fastest spill-free one if it is at least as fast (it changes
                     the GPU bits of the backward, never the CPU's), else keep the spills.
Exit 1 when a correctness property fails (a wrong device, a copy that did not land, a refused O_DIRECT that did
not fall back); figures never fail it.

    python bench/cuda_paths.py [--json out.json] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.rundir import checkpoint as ckpt, checkpoint_write  # noqa: E402
from andrea.config import load as configload  # noqa: E402
from andrea.control.commit import writer  # noqa: E402
from andrea.control.parallel.distributed import World  # noqa: E402
from andrea.model.gpt import layout_for, n_params  # noqa: E402

ROWS: list[dict] = []


def row(probe: str, ok: bool | None, **figures) -> None:
    ROWS.append({"probe": probe, "ok": ok, **figures})
    verdict = "ok" if ok else ("FAIL" if ok is not None else "info")
    print(f"| {probe} | {verdict} | " + ", ".join(f"{k}={v}" for k, v in figures.items()) + " |", flush=True)


def thread_device() -> None:
    import triton
    count = torch.cuda.device_count()
    device = torch.device("cuda", count - 1)  # the last GPU: the one a rank > 0 drives when there are several
    torch.cuda.set_device(device)
    probe = lambda: (torch.cuda.current_device(), triton.runtime.driver.active.get_current_device())  # noqa: E731
    with ThreadPoolExecutor(1, initializer=World.thread_initializer(device)) as pool:
        seen = pool.submit(probe).result()
    with ThreadPoolExecutor(1) as bare:
        unbound = bare.submit(probe).result()
    row("thread_device", seen == (device.index, device.index), gpus=count, rank_device=device.index,
        executor_sees=seen, bare_thread_sees=unbound,
        note="one GPU: nothing to mismatch" if count == 1 else "bare thread shows the bug the initializer fixes")


def pinned_staging(preset: str) -> list[tuple[str, torch.Tensor]]:
    n = n_params(layout_for(configload.load(preset=preset).model))
    size = checkpoint_write.image_bytes(n)

    def held() -> int:  # bytes PyTorch's pinned allocator holds (rounded block sizes), where this torch says
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        return stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", -1))

    before = held()
    registered = writer.staging_image(n, pinned=True)
    after_registered = held()
    raw = torch.zeros(size + checkpoint_write.DIRECT_ALIGN, dtype=torch.uint8, pin_memory=True)  # the former allocation
    allocator = raw[-raw.data_ptr() % checkpoint_write.DIRECT_ALIGN:][:size]
    after_allocator = held()
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    figures = {}
    intact = True
    for name, dst in (("registered", registered), ("allocator", allocator)):
        dst.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        returned = time.perf_counter() - t0  # an async copy returns at once; a pageable one only when done
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        intact &= bool(torch.equal(dst[::4096].cuda(), src[::4096]))
        figures[f"{name}_pinned"] = dst.is_pinned()
        figures[f"{name}_GBps"] = round(size / seconds / 1e9, 1)
        figures[f"{name}_call_ms"] = round(returned * 1e3, 2)
    row("pinned_staging", intact and figures["registered_pinned"], preset=preset, image_bytes=size,
        allocator_reserved=after_allocator - after_registered, registered_reserved=after_registered - before,
        **figures)
    return [("registered", registered), ("allocator", allocator)]


def o_direct_pinned(images: list[tuple[str, torch.Tensor]], directory: Path) -> None:
    for name, image in images:
        n = (image.numel() - ckpt.HEADER.size) // 12
        direct = checkpoint_write.DirectIO()
        run_dir = Path(tempfile.mkdtemp(prefix=f"odirect_{name}_", dir=directory))
        try:
            path = checkpoint_write.commit_image(run_dir, 1, image.numpy(), n, direct=direct)
            ok = path.stat().st_size == ckpt.checkpoint_bytes(n)
            row("o_direct_pinned", ok, image=name, o_direct=direct.enabled, refusal=direct.refusal or "-")
        except OSError as e:
            row("o_direct_pinned", False, image=name, error=e.strerror or str(e))
        finally:
            for p in run_dir.iterdir():
                p.unlink()
            run_dir.rmdir()


def blocking_event() -> None:
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000  # not in every torch
    cycles = int(0.3 * khz * 1e3)  # ~0.3 s of one spinning kernel
    figures = {}
    for blocking in (False, True):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event(blocking=blocking)
        event.record(torch.cuda.current_stream())
        t0, cpu0 = time.perf_counter(), time.thread_time()
        event.synchronize()
        figures[f"{'blocking' if blocking else 'default'}_cpu_s"] = round(time.thread_time() - cpu0, 3)
        figures[f"{'blocking' if blocking else 'default'}_wall_s"] = round(time.perf_counter() - t0, 3)
    row("blocking_event", None, **figures)


def sdpa_backward() -> None:
    import torch.nn.functional as F
    gen = torch.Generator(device="cuda")
    shape = (16, 12, 1024, 64)  # ANDREA-120M-like: batch 16, 12 heads, T 1024, head dim 64

    def grads() -> list[torch.Tensor]:
        gen.manual_seed(0)  # the same q, k, v every call
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        return [t.grad.clone() for t in (q, k, v)]

    def same() -> bool:
        a, b = grads(), grads()
        return all(torch.equal(x, y) for x, y in zip(a, b))

    figures = {"default": same()}
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        figures["use_deterministic_algorithms"] = same()
    finally:
        torch.use_deterministic_algorithms(previous)
    row("sdpa_backward", None, bitwise_equal_reruns=figures, torch=torch.__version__)


def attn_bwd_shapes() -> None:
    from attention_shapes import attention, candidates  # beside this file (sys.path[0]): one candidate list

    shapes = candidates(torch.bfloat16)
    pinned = shapes["pinned"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, T, D = 16, 12, 1024, 64
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    o, lse = attention.attention_forward(q, k, v)
    reference = attention.attention_backward(do, q, k, v, o, lse, config=pinned)
    figures = {}
    for name, cfg in shapes.items():
        out = attention.attention_backward(do, q, k, v, o, lse, config=cfg)  # compiles; also the error vs pinned
        err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, reference))
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            attention.attention_backward(do, q, k, v, o, lse, config=cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        figures[name] = f"{sorted(times)[len(times) // 2]:.3f} ms (max diff vs pinned {err:.1e})"
    row("attn_bwd_shapes", None, shape=(B, H, T, D), **figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--dir", default=str(REPO), help="where the O_DIRECT probe writes (a real disk)")
    parser.add_argument("--preset", default="andrea-120m", help="whose checkpoint image is staged")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 2
    print("| probe | verdict | figures |\n|---|---|---|")
    def staging() -> None:
        o_direct_pinned(pinned_staging(args.preset), Path(args.dir))

    for probe in (thread_device, staging, blocking_event, sdpa_backward, attn_bwd_shapes):
        try:
            probe()
        except Exception as e:  # noqa: BLE001 - one probe failing never hides the others
            row(getattr(probe, "__name__", "probe"), False, error=repr(e)[:300])
        gc.collect()
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1, default=str))
    return 1 if any(r["ok"] is False for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
