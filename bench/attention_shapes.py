"""Registers and spills of the attention dK/dV backward at head dim 64 (both presets) under candidate launch shapes,
compiled on a CPU for sm_80, sm_89 and sm_90 by the compile check's own machinery (andrea/kernels/compile_check.py:
the real launcher on meta tensors, Triton's binder, ptxas -v). The pinned shape spills; the others are what a GPU
run of bench/cuda_paths.py (attn_bwd_shapes) times against it. Reads nothing, writes the table to stdout.

    TRITON_INTERPRET=0 python bench/attention_shapes.py [--dtype bf16|fp16] [--workers 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.kernels import compile_check as cc  # noqa: E402

attention = importlib.import_module("andrea.kernels.attention")  # the package re-exports a function by this name


def candidates(dtype: torch.dtype) -> dict[str, "attention.AttentionConfig"]:
    pinned = attention.attention_config(64, dtype, "cuda")
    return {"pinned": pinned, "w8 (dkdv and dq)": pinned._replace(num_warps=8),
            "dkdv (32,64)": pinned._replace(dkdv=(32, 64)), "dkdv (16,128)": pinned._replace(dkdv=(16, 128)),
            "dkdv (64,64)": pinned._replace(dkdv=(64, 64)), "s2": pinned._replace(num_stages=2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    B, H, T, D = 16, 12, 1024, 64
    jobs = []
    for name, cfg in candidates(dtype).items():
        with cc.recording([attention._attn_bwd_dkdv_kernel, attention._attn_bwd_dq_kernel]) as launches:
            q, k, v, o, do = (torch.empty(B, H, T, D, dtype=dtype, device="meta") for _ in range(5))
            attention.attention_backward(do, q, k, v, o, torch.empty(B, H, T, device="meta"), config=cfg)
        dkdv = next(launch for launch in launches if launch.kernel is attention._attn_bwd_dkdv_kernel)
        jobs += [(name, cc.bind(dkdv, arch)) for arch in cc.ARCHS]
    with concurrent.futures.ProcessPoolExecutor(max(1, args.workers)) as pool:
        rows = list(pool.map(cc.compile_job, [job for _, job in jobs]))
    print(f"| {args.dtype} dK/dV, head dim 64 | config | arch | registers | spill st/ld B | shared B |")
    print("|---|---|---|---|---|---|")
    for (name, job), r in zip(jobs, rows):
        spills = f"{r['spill_stores']}/{r['spill_loads']}" if not r["error"] else r["error"]
        print(f"| {name} | {job.config} | sm_{r['arch']} | {r.get('regs')} | {spills} | {r.get('shared')} |")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
