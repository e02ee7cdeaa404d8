"""Kernel benchmarks on the GPU: each fused kernel against the best practical torch baseline.

Reads nothing; prints markdown tables and, with `--json PATH`, writes the same rows as JSON (the benches --only names):
  {"device": str, "peak_bandwidth_gbs": float, "bandwidth_source": "properties" | "measured copy",
   "attention": [{"T", "D", "B", "H", "impl", "pass", "ms", "tflops", "max_err"}...],
   "adamw": [{"params", "impl", "ms", "gbs", "pct_of_peak"}...],
   "cross_entropy": [{"N", "V", "impl", "ms", "gbs", "extra_mib", "max_err"}...],
   "layer_norm": [{"N", "C", "impl", "ms", "gbs", "max_err"}...],
   "rms_norm": [{"N", "C", "dtype", "impl", "ms", "gbs", "max_err"}...],
   "rotary": [{"B", "H", "T", "D", "impl", "ms", "gbs", "max_err"}...],
   "muon": [{"params", "impl", "ms", "gbs", "max_err"}...]}
Attention: bf16, causal, B * T = 16384 tokens and H * D = 2048 (the FlashAttention-2 paper's setup), FLOPs counted
as the FlashAttention papers do (4 * B * H * T^2 * D forward, halved for causal; backward 2.5x forward).
`max_err` is the forward's max |ours - baseline|, a correctness smoke check on real hardware.
AdamW: 28 bytes per parameter (read w, g, m, v; write w, m, v), the minimum traffic of any AdamW.
Cross-entropy: the presets' losses (bf16 logits from autocast, B * T rows, their vocabularies), forward + backward
against F.cross_entropy on an fp32 copy (what a model without the kernel does); GB/s on the minimum traffic (read
the logits twice, write dlogits: 6 bytes per bf16 logit) and `extra_mib`, the peak memory beyond logits and dlogits.
LayerNorm: the presets' (rows, C) in fp32 (the residual stream stays fp32 under autocast), forward + backward
against F.layer_norm; GB/s on 20 bytes per element (read x, write y; read x and dy, write dx).
RMSNorm (parameter-free, the modern presets'): the residual stream's (rows, C) in fp32 and QK-norm's (rows * heads,
head dim) in bf16, forward + backward against F.rms_norm and the eager reference; GB/s on 5 accesses per element (read
x, write y; read x and dy, write dx). Rotary: andrea-120m-modern's q in bf16, a strided (B, H, T, D) view as the model
hands it over, forward + backward against the eager reference; GB/s on 4 accesses per element. Muon's elementwise
step: momentum with Nesterov, then the apply of a bf16 orthogonalised update, over andrea-120m-modern's hidden matrices, against
the references; GB/s on the fused minimum, 26 bytes per parameter (read g, m; write m, u; read w, u; write w).
Without a CUDA GPU: prints one line and exits 2 (unless --device cpu). Timing: triton.testing.do_bench (median of
CUDA-event timings). `--only` picks benches (bench/gpu_check.sh: all but cross-entropy and LayerNorm).
Every bench function takes the device and the timer, so tests/e2e/test_bench_smoke.py runs them on tiny shapes on a
CPU under the Triton interpreter: the code a lent GPU runs has run before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

TOKENS, MODEL_DIM = 16384, 2048
ADAMW_BYTES_PER_PARAM = 28
CE_BYTES_PER_LOGIT = 6  # bf16: read in the forward, reread and dlogits written in the backward
LN_BYTES_PER_ELEMENT = 20  # fp32: x read and y written; x and dy read, dx written
CE_SHAPES = [(32 * 256, 8192), (16 * 1024, 22528)]  # andrea-12m and andrea-120m: (batch x block, vocabulary)
LN_SHAPES = [(32 * 256, 320), (16 * 1024, 768)]  # their (rows, n_embd)
RMS_SHAPES = [(16 * 1024, 768, "fp32"), (16 * 1024 * 12, 64, "bf16")]  # andrea-120m-modern's residual; its QK-norm
ROTARY_SHAPES = [(16, 12, 1024, 64)]  # andrea-120m-modern's q: (batch, heads, block, head dim)
MUON_PARAMS = [12 * (4 * 768 * 768 + 3 * 2048 * 768)]  # andrea-120m-modern's hidden matrices (Muon's share)
MUON_BYTES_PER_PARAM = 26  # fp32 g, m read; m, u written; w read and written; bf16 u read
BENCHES = ("attention", "adamw", "cross_entropy", "layer_norm", "rms_norm", "rotary", "muon")
Timer = Callable[[Callable[[], object]], float]  # runs fn, returns milliseconds


def cuda_timer(fn: Callable[[], object]) -> float:
    import triton.testing
    return triton.testing.do_bench(fn)


def wall_timer(fn: Callable[[], object]) -> float:
    """One call timed by the wall clock: for smoke runs on a CPU, where the figures mean nothing."""
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def peak_extra_mib(fn: Callable[[], object], device: torch.device, baseline_bytes: int) -> float | None:
    """Peak memory one call of fn allocates beyond what is live before it plus `baseline_bytes` (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before - baseline_bytes) / 2**20


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


def bench_attention(seq_lens: list[int], head_dims: list[int], device: torch.device, timer: Timer,
                    dtype: torch.dtype = torch.bfloat16, tokens: int = TOKENS, model_dim: int = MODEL_DIM
                    ) -> list[dict]:
    return [row for D in head_dims for T in seq_lens
            for row in _attention_rows(max(1, tokens // T), max(1, model_dim // D), T, D, device, timer, dtype)]


def _attention_rows(B: int, H: int, T: int, D: int, device: torch.device, timer: Timer, dtype: torch.dtype
                    ) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from andrea.kernels import attention

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))  # (B, H, T, D)
    reference = sdpa(q, k, v).detach()
    rows = []
    for impl, fn in (("andrea", attention), ("sdpa-flash", sdpa)):
        o = fn(q, k, v)

        def backward(o=o):
            q.grad = k.grad = v.grad = None  # fresh gradients, as in training: no accumulation in the timing
            o.backward(do, retain_graph=True)

        max_err = (o.detach().float() - reference.float()).abs().max().item()
        for name, ms in (("fwd", timer(lambda fn=fn: fn(q, k, v))), ("bwd", timer(backward))):
            tflops = attention_flops(B, H, T, D, True, name == "bwd") / (ms * 1e-3) / 1e12
            rows.append({"T": T, "D": D, "B": B, "H": H, "impl": impl, "pass": name, "ms": ms, "tflops": tflops,
                         "max_err": max_err})
    return rows


def bench_adamw(sizes: list[int], peak_gbs: float, device: torch.device, timer: Timer) -> list[dict]:
    rows = [row for n in sizes for row in _adamw_rows(n, peak_gbs, device, timer)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _adamw_rows(n: int, peak_gbs: float, device: torch.device, timer: Timer) -> list[dict]:
    from andrea.kernels import adamw_step

    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    w, g = torch.randn(n, device=device), torch.randn(n, device=device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    mask = torch.rand(n, device=device) < 0.9
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device)
    fused = torch.optim.AdamW([param], lr=hyper["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    impls = (
        ("andrea adamw_step", lambda: adamw_step(w, g, m, v, step=10, **hyper)),
        ("andrea adamw_step +mask +clip",
         lambda: adamw_step(w, g, m, v, step=10, decay_mask=mask, max_grad_norm=1.0, **hyper)),
        ("torch AdamW(fused=True)", fused.step),
    )
    rows = []
    for impl, fn in impls:
        ms = timer(fn)
        gbs = ADAMW_BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9
        rows.append({"params": n, "impl": impl, "ms": ms, "gbs": gbs, "pct_of_peak": 100 * gbs / peak_gbs})
    return rows


def bench_cross_entropy(shapes: list[tuple[int, int]], device: torch.device, timer: Timer,
                        dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    return [row for N, V in shapes for row in _cross_entropy_rows(N, V, device, timer, dtype)]


def _cross_entropy_rows(N: int, V: int, device: torch.device, timer: Timer, dtype: torch.dtype) -> list[dict]:
    from andrea.kernels import cross_entropy

    gen = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(N, V, device=device, generator=gen)).to(dtype).requires_grad_()  # (N, V)
    targets = torch.randint(0, V, (N,), device=device, generator=gen)
    impls = (("andrea fused", lambda: cross_entropy(logits, targets)),
             ("torch F.cross_entropy(fp32 copy)", lambda: F.cross_entropy(logits.float(), targets)))
    reference = impls[1][1]().item()
    rows = []
    for impl, loss_fn in impls:
        def fwd_bwd(loss_fn=loss_fn):
            logits.grad = None  # dlogits written fresh each call, as in training
            loss_fn().backward()

        ms = timer(fwd_bwd)
        # the logits are live before the call and dlogits is its output: the rest is the method's scratch
        extra = peak_extra_mib(fwd_bwd, device, baseline_bytes=logits.numel() * logits.element_size())
        rows.append({"N": N, "V": V, "impl": impl, "ms": ms, "gbs": CE_BYTES_PER_LOGIT * N * V / (ms * 1e-3) / 1e9,
                     "extra_mib": extra, "max_err": abs(loss_fn().item() - reference)})
    return rows


def bench_layer_norm(shapes: list[tuple[int, int]], device: torch.device, timer: Timer) -> list[dict]:
    return [row for N, C in shapes for row in _layer_norm_rows(N, C, device, timer)]


def _layer_norm_rows(N: int, C: int, device: torch.device, timer: Timer) -> list[dict]:
    from andrea.kernels import layer_norm

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, C, device=device, generator=gen).requires_grad_()  # (N, C) fp32
    weight = (1 + 0.1 * torch.randn(C, device=device, generator=gen)).requires_grad_()
    bias = (0.1 * torch.randn(C, device=device, generator=gen)).requires_grad_()
    dy = torch.randn(N, C, device=device, generator=gen)
    impls = (("andrea fused", lambda: layer_norm(x, weight, bias, 1e-5)),
             ("torch F.layer_norm", lambda: F.layer_norm(x, (C,), weight, bias, 1e-5)))
    reference = impls[1][1]().detach()
    rows = []
    for impl, fn in impls:
        def fwd_bwd(fn=fn):
            x.grad = weight.grad = bias.grad = None
            fn().backward(dy)

        ms = timer(fwd_bwd)
        rows.append({"N": N, "C": C, "impl": impl, "ms": ms, "gbs": LN_BYTES_PER_ELEMENT * N * C / (ms * 1e-3) / 1e9,
                     "max_err": (fn().detach() - reference).abs().max().item()})
    return rows


def bench_rms_norm(shapes: list[tuple[int, int, str]], device: torch.device, timer: Timer) -> list[dict]:
    return [row for N, C, dtype in shapes for row in _rms_norm_rows(N, C, dtype, device, timer)]


def _rms_norm_rows(N: int, C: int, dtype_name: str, device: torch.device, timer: Timer) -> list[dict]:
    from andrea.kernels import rms_norm, rms_norm_reference

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, C, device=device, generator=gen).to(dtype).requires_grad_()  # (N, C)
    dy = torch.randn(N, C, device=device, generator=gen).to(dtype)
    impls = (("andrea fused", lambda: rms_norm(x, 1e-6)),
             ("torch F.rms_norm", lambda: F.rms_norm(x, (C,), eps=1e-6)),
             ("torch eager reference", lambda: rms_norm_reference(x, 1e-6)))
    reference = impls[2][1]().detach().float()
    rows = []
    for impl, fn in impls:
        def fwd_bwd(fn=fn):
            x.grad = None
            fn().backward(dy)

        ms = timer(fwd_bwd)
        rows.append({"N": N, "C": C, "dtype": dtype_name, "impl": impl, "ms": ms,
                     "gbs": 5 * N * C * x.element_size() / (ms * 1e-3) / 1e9,
                     "max_err": (fn().detach().float() - reference).abs().max().item()})
    return rows


def bench_rotary(shapes: list[tuple[int, int, int, int]], device: torch.device, timer: Timer,
                 dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    return [row for shape in shapes for row in _rotary_rows(*shape, device, timer, dtype)]


def _rotary_rows(B: int, H: int, T: int, D: int, device: torch.device, timer: Timer, dtype: torch.dtype
                 ) -> list[dict]:
    from andrea.kernels import rotary, rotary_reference, rotary_tables

    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(B, T, H, D, device=device, generator=gen).to(dtype).requires_grad_()  # (B, T, H, D)
    dy = torch.randn(B, H, T, D, device=device, generator=gen).to(dtype)
    cos, sin = rotary_tables(T, D, 10000.0, device)
    impls = (("andrea fused", rotary), ("torch eager reference", rotary_reference))
    reference = rotary_reference(base.transpose(1, 2), cos, sin).detach().float()
    rows = []
    for impl, fn in impls:
        def fwd_bwd(fn=fn):
            base.grad = None
            fn(base.transpose(1, 2), cos, sin).backward(dy)  # the strided (B, H, T, D) view the model passes

        ms = timer(fwd_bwd)
        out = fn(base.transpose(1, 2), cos, sin).detach().float()
        rows.append({"B": B, "H": H, "T": T, "D": D, "impl": impl, "ms": ms,
                     "gbs": 4 * base.numel() * base.element_size() / (ms * 1e-3) / 1e9,
                     "max_err": (out - reference).abs().max().item()})
    return rows


def bench_muon(sizes: list[int], device: torch.device, timer: Timer) -> list[dict]:
    return [row for n in sizes for row in _muon_rows(n, device, timer)]


def _muon_rows(n: int, device: torch.device, timer: Timer) -> list[dict]:
    from andrea.kernels import muon_apply, muon_apply_reference, muon_momentum, muon_momentum_reference

    gen = torch.Generator(device=device).manual_seed(0)
    g, m0, w0 = (torch.randn(n, device=device, generator=gen) for _ in range(3))
    orthogonalised = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)  # as Newton–Schulz leaves it
    impls = (("andrea fused", muon_momentum, muon_apply),
             ("torch references", muon_momentum_reference, muon_apply_reference))
    results, rows = [], []
    for impl, momentum_fn, apply_fn in impls:
        m, w = m0.clone(), w0.clone()

        def step(momentum_fn=momentum_fn, apply_fn=apply_fn, m=m, w=w):
            momentum_fn(g, m, 0.95, True)  # its update goes to Newton–Schulz (torch matmuls, not timed here)
            apply_fn(w, orthogonalised, 0.02, 0.1)

        ms = timer(step)
        m.copy_(m0), w.copy_(w0)
        step()
        results.append(w)
        rows.append({"params": n, "impl": impl, "ms": ms, "gbs": MUON_BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9})
    for row, w in zip(rows, results):  # the weights after one step from the same state, against the references'
        row["max_err"] = (w - results[-1]).abs().max().item()
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
    parser.add_argument("--rms-shapes", nargs="+", default=[f"{n}x{c}x{d}" for n, c, d in RMS_SHAPES],
                        help="RMSNorm (rows)x(C)x(fp32|bf16|fp16), default the modern presets' residual and QK-norm")
    parser.add_argument("--rotary-shapes", nargs="+", default=["x".join(map(str, s)) for s in ROTARY_SHAPES],
                        help="rotary BxHxTxD (default andrea-120m-modern's q)")
    parser.add_argument("--muon-params", type=int, nargs="+", default=MUON_PARAMS,
                        help="Muon elements (default andrea-120m-modern's hidden matrices)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=list(BENCHES), help="default: all of them")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"attention B * T (default {TOKENS})")
    parser.add_argument("--model-dim", type=int, default=MODEL_DIM, help=f"attention H * D (default {MODEL_DIM})")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the Triton interpreter and wall-clock timings that mean nothing, for a smoke run "
                             "of these very calls (bench/gpu_check.sh's self-test) on tiny shapes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU on this machine; nothing to benchmark", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before andrea.kernels imports triton
        device, timer, (peak, source), name = torch.device("cpu"), wall_timer, (1.0, "none (cpu)"), "cpu"
        dtype = torch.float32  # the interpreter cannot run bf16 dots faithfully (tests/unit/kernels/test_attention.py)
    else:
        device, timer, (peak, source), name = torch.device("cuda"), cuda_timer, peak_bandwidth_gbs(), \
            torch.cuda.get_device_name(0)
        dtype = torch.bfloat16
    results = dict(device=name, peak_bandwidth_gbs=peak, bandwidth_source=source)
    if "attention" in args.only:
        results["attention"] = bench_attention(args.seq_lens, args.head_dims, device, timer, dtype=dtype,
                                               tokens=args.tokens, model_dim=args.model_dim)
    if "adamw" in args.only:
        results["adamw"] = bench_adamw(args.adamw_params, peak, device, timer)
    if "cross_entropy" in args.only:
        results["cross_entropy"] = bench_cross_entropy(CE_SHAPES, device, timer)
    if "layer_norm" in args.only:
        results["layer_norm"] = bench_layer_norm(LN_SHAPES, device, timer)
    if "rms_norm" in args.only:
        shapes = [(int(n), int(c), d) for n, c, d in (x.split("x") for x in args.rms_shapes)]
        results["rms_norm"] = bench_rms_norm(shapes, device, timer)
    if "rotary" in args.only:
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.rotary_shapes]
        results["rotary"] = bench_rotary(shapes, device, timer, dtype=dtype)
    if "muon" in args.only:
        results["muon"] = bench_muon(args.muon_params, device, timer)
    print(f"# {name}: peak DRAM bandwidth {peak:.0f} GB/s ({source})")
    sections = {"attention": (f"Attention ({str(dtype).split('.')[-1]}, causal)",
                              ["T", "D", "B", "H", "impl", "pass", "ms", "tflops", "max_err"]),
                "adamw": (f"AdamW ({ADAMW_BYTES_PER_PARAM} B/param)", ["params", "impl", "ms", "gbs", "pct_of_peak"]),
                "cross_entropy": (f"Cross-entropy, forward + backward (bf16 logits, {CE_BYTES_PER_LOGIT} B/logit)",
                                  ["N", "V", "impl", "ms", "gbs", "extra_mib", "max_err"]),
                "layer_norm": (f"LayerNorm, forward + backward (fp32, {LN_BYTES_PER_ELEMENT} B/element)",
                               ["N", "C", "impl", "ms", "gbs", "max_err"]),
                "rms_norm": ("RMSNorm, parameter-free, forward + backward (5 accesses/element)",
                             ["N", "C", "dtype", "impl", "ms", "gbs", "max_err"]),
                "rotary": (f"Rotary, forward + backward ({str(dtype).split('.')[-1]}, 4 accesses/element)",
                           ["B", "H", "T", "D", "impl", "ms", "gbs", "max_err"]),
                "muon": (f"Muon's elementwise step: Nesterov momentum + apply ({MUON_BYTES_PER_PARAM} B/param)",
                         ["params", "impl", "ms", "gbs", "max_err"])}
    for key, (title, columns) in sections.items():
        if key in results:
            print(f"\n## {title}\n")
            print(markdown(results[key], columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
