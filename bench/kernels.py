"""Kernel benchmarks on the GPU: fused attention vs PyTorch's flash SDPA, fused AdamW vs torch's fused AdamW.

Reads nothing; prints a markdown table and, with `--json PATH`, writes the same rows as JSON:
  {"device": str, "peak_bandwidth_gbs": float, "bandwidth_source": "properties" | "measured copy",
   "attention": [{"T", "D", "B", "H", "impl", "pass", "ms", "tflops", "max_err"}...],
   "adamw": [{"params", "impl", "ms", "gbs", "pct_of_peak"}...]}
Attention: bf16, causal, B * T = 16384 tokens and H * D = 2048 (the FlashAttention-2 paper's setup), FLOPs counted
as the FlashAttention papers do (4 * B * H * T^2 * D forward, halved for causal; backward 2.5x forward).
`max_err` is the forward's max |ours - SDPA|, a correctness smoke check on real hardware.
AdamW: 28 bytes per parameter (read w, g, m, v; write w, m, v), the minimum traffic of any AdamW.
Without a CUDA GPU: prints one line and exits 2. Timing: triton.testing.do_bench (median of CUDA-event timings).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

TOKENS, MODEL_DIM = 16384, 2048
ADAMW_BYTES_PER_PARAM = 28


def attention_flops(B: int, H: int, T: int, D: int, causal: bool, backward: bool) -> float:
    flops = 4.0 * B * H * T * T * D  # two (T, T, D) matmuls, 2 FLOPs per multiply-add
    flops *= 0.5 if causal else 1.0
    return flops * 2.5 if backward else flops  # backward: five matmuls instead of two


def peak_bandwidth_gbs() -> tuple[float, str]:
    """Theoretical DRAM bandwidth from the device properties when torch exposes them, else a measured copy."""
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "properties"  # x2: double data rate
    import triton.testing
    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32)  # 1 GiB: far beyond L2
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9, "measured copy"  # read + write


def bench_attention(seq_lens: list[int], head_dims: list[int]) -> list[dict]:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from andrea.kernels import attention

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = []
    for D in head_dims:
        for T in seq_lens:
            B, H = max(1, TOKENS // T), MODEL_DIM // D
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))  # (B, H, T, D)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            reference = sdpa(q, k, v).detach()
            for impl, fn in (("andrea", attention), ("sdpa-flash", sdpa)):
                o = fn(q, k, v)
                max_err = (o.detach().float() - reference.float()).abs().max().item()
                fwd_ms = triton.testing.do_bench(lambda: fn(q, k, v))
                bwd_ms = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
                for name, ms in (("fwd", fwd_ms), ("bwd", bwd_ms)):
                    tflops = attention_flops(B, H, T, D, True, name == "bwd") / (ms * 1e-3) / 1e12
                    rows.append(dict(T=T, D=D, B=B, H=H, impl=impl, **{"pass": name}, ms=ms, tflops=tflops,
                                     max_err=max_err))
                del o
    return rows


def bench_adamw(sizes: list[int], peak_gbs: float) -> list[dict]:
    import triton.testing

    from andrea.kernels import adamw_step

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    rows = []
    for n in sizes:
        w, g, m, v = (torch.randn(n, device="cuda") for _ in range(4))
        m.zero_()
        v.zero_()
        mask = torch.rand(n, device="cuda") < 0.9
        param = torch.nn.Parameter(torch.randn(n, device="cuda"))
        param.grad = torch.randn(n, device="cuda")
        fused = torch.optim.AdamW([param], lr=hyper["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        impls = (
            ("andrea adamw_step", lambda: adamw_step(w, g, m, v, step=10, **hyper)),
            ("andrea adamw_step +mask +clip", lambda: adamw_step(w, g, m, v, step=10, decay_mask=mask,
                                                                 max_grad_norm=1.0, **hyper)),
            ("torch AdamW(fused=True)", fused.step),
        )
        for impl, fn in impls:
            ms = triton.testing.do_bench(fn)
            gbs = ADAMW_BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9
            rows.append(dict(params=n, impl=impl, ms=ms, gbs=gbs, pct_of_peak=100 * gbs / peak_gbs))
        del w, g, m, v, mask, param, fused
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--adamw-params", type=int, nargs="+", default=[12_800_000, 120_000_000])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU on this machine; nothing to benchmark", file=sys.stderr)
        return 2
    peak, source = peak_bandwidth_gbs()
    device = torch.cuda.get_device_name(0)
    attention_rows = bench_attention(args.seq_lens, args.head_dims)
    adamw_rows = bench_adamw(args.adamw_params, peak)
    print(f"# {device}: peak DRAM bandwidth {peak:.0f} GB/s ({source})\n\n## Attention (bf16, causal)\n")
    print(markdown(attention_rows, ["T", "D", "B", "H", "impl", "pass", "ms", "tflops", "max_err"]))
    print(f"\n## AdamW ({ADAMW_BYTES_PER_PARAM} B/param)\n")
    print(markdown(adamw_rows, ["params", "impl", "ms", "gbs", "pct_of_peak"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, peak_bandwidth_gbs=peak, bandwidth_source=source,
                           attention=attention_rows, adamw=adamw_rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
