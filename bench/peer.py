"""Part 5 of bench/gpu_check.sh: andrea beside its peer, a nanoGPT-style loop on the same model and batch, and
where the peer is faster, the gap named by kernel.

The peer is bench/train.py's ReferenceLoop (its ReferenceGPT: one tensor per parameter, SDPA attention, andrea's
initial weights; AdamW(fused=True) on CUDA with decay on matrices only; bf16 autocast; clip_grad_norm_) with the
model wrapped in torch.compile, as nanoGPT trains. Both sides run in this process on the same random batches:
andrea's Trainer.train_step with the kernels `andrea train` uses (--kernels) and the peer's step. Each side: warm-up
steps (the peer's first compiles), then --steps steps timed as one window with a single device sync at its end
(nanoGPT reads the loss only every few steps; neither side gets a host sync per step). Beside those two, the
tokens/s of the real `andrea train` loop that part 2 measured (--andrea-json: bench/gpu_train.py's JSON).

The gap: torch.profiler over --profile-steps more steps of each side; per step, the device time of every kernel
(self time of the CUDA kernels; on a CPU, the self time of every op), summed by category (attention, matmul,
optimizer, ...). Where the peer is faster, the categories in which andrea spends more than the peer are listed,
largest first, each with its heaviest kernels on both sides; and so is the host gap (wall time per step less the
device's busy time per step: launch overhead, Python, syncs).

Writes --json (after each preset) and a markdown report to stdout. Figures never fail it; exit 1 only when a side
cannot run.

    python bench/peer.py --json peer.json --andrea-json train.json                 # CUDA, both presets
    python bench/peer.py --presets andrea-tiny --device cpu --compile eager --steps 2 --warmup 1 --profile-steps 1
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.control.observe.mfu import mfu, model_flops_per_token, table_peak  # noqa: E402
from train import ReferenceLoop, batches  # noqa: E402

from andrea.config import load as configload  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402

CATEGORIES = [  # first match wins: a fused inductor kernel named after LayerNorm and a copy is LayerNorm
    ("attention", r"flash|fmha|attn|attention|sdpa"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|matmul|aten::mm|aten::addmm|aten::bmm|aten::linear|cublas"),
    ("optimizer", r"adam|multi_tensor|foreach|optim"),
    ("layernorm", r"layer_norm|layernorm"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|softmax"),
    ("grad norm", r"norm"),
    ("elementwise", r"gelu|tanh|elementwise|vectorized|unrolled|triton_poi|aten::add|aten::mul|aten::div"),
    ("copy/fill", r"memcpy|memset|copy|cat|fill|zero|embedding|index"),
    ("other", r""),
]


def category(kernel: str) -> str:
    name = kernel.lower()
    return next(cat for cat, pattern in CATEGORIES if re.search(pattern, name))


class AndreaSide:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def train_step(self, step: int, x, y):
        return self.trainer.train_step(step, x, y).loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(side, data: list, start: int, device: torch.device) -> float:
    """Seconds for len(data) steps with one sync at the end."""
    sync(device)
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(data):
        loss = side.train_step(start + i, x, y)
    float(loss)  # the host waits for the last step, as a loop that logs now and then does
    sync(device)
    return time.perf_counter() - t0


def profile(side, data: list, start: int, device: torch.device) -> dict:
    """Per-step device time by kernel (or CPU self time by op on a CPU) over len(data) steps, and the wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(data):
            loss = side.train_step(start + i, x, y)
        float(loss)
        sync(device)
        wall = time.perf_counter() - t0
    steps = len(data)
    events = prof.key_averages()

    def per_step(chosen) -> dict[str, float]:
        out: dict[str, float] = {}
        for e, us in chosen:
            if us > 0:
                out[e.key] = out.get(e.key, 0.0) + us / 1e3 / steps  # ms per step
        return out

    if device.type == "cuda":
        kernels = per_step((e, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA)
        if not kernels:  # a profiler that files kernels under the ops that launched them: the ops' device time
            kernels = per_step((e, e.self_device_time_total) for e in events)
    else:
        kernels = per_step((e, e.self_cpu_time_total) for e in events)
    by_cat: dict[str, float] = {}
    for name, ms in kernels.items():
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + ms
    busy = sum(kernels.values())
    return {"wall_ms_per_step": 1e3 * wall / steps, "busy_ms_per_step": busy,
            "host_gap_ms_per_step": max(0.0, 1e3 * wall / steps - busy) if device.type == "cuda" else None,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])), "categories": by_cat}


def name_the_gap(andrea: dict, peer: dict, top: int = 3) -> list[str]:
    """One line per category where andrea spends more than the peer, largest difference first, naming the
    heaviest kernels of that category on each side; the host gap last when it is andrea's larger one."""
    lines = []
    cats = {c for c in andrea["categories"]} | set(peer["categories"])
    diffs = sorted(((andrea["categories"].get(c, 0.0) - peer["categories"].get(c, 0.0), c) for c in cats),
                   reverse=True)
    for diff, cat in diffs:
        if diff <= 0:
            break

        def heaviest(prof: dict) -> str:
            names = [(n, ms) for n, ms in prof["kernels"].items() if category(n) == cat][:top]
            return ", ".join(f"{n[:60]} {ms:.3f}" for n, ms in names) or "none"

        lines.append(f"{cat}: +{diff:.3f} ms/step (andrea {andrea['categories'].get(cat, 0.0):.3f}: {heaviest(andrea)}"
                     f" | peer {peer['categories'].get(cat, 0.0):.3f}: {heaviest(peer)})")
    a_gap, p_gap = andrea.get("host_gap_ms_per_step"), peer.get("host_gap_ms_per_step")
    if a_gap is not None and p_gap is not None and a_gap > p_gap:
        lines.append(f"host (device idle): +{a_gap - p_gap:.3f} ms/step (andrea {a_gap:.3f}, peer {p_gap:.3f})")
    return lines


def andrea_train_tps(path: str | None, preset: str) -> float | None:
    if not path or not Path(path).exists():
        return None
    results = json.loads(Path(path).read_text()).get("results", [])
    return next((r.get("tokens_per_s") for r in results if r["preset"] == preset), None)


def bench_preset(args, preset: str, device: torch.device) -> dict:
    cfg = configload.load(preset=preset)
    batch = args.batch_size or cfg.train.batch_size
    trainer = Trainer(cfg, device, args.kernels)
    peer = ReferenceLoop(cfg, device, trainer)  # andrea's initial weights, before andrea's first step
    t0 = time.perf_counter()
    if args.compile != "none":
        peer.model = torch.compile(peer.model, backend=args.compile)
    sides = {"andrea": AndreaSide(trainer), "peer": peer}
    n = args.warmup + args.steps + args.profile_steps
    data = batches(cfg, batch, n, device, cfg.train.seed)
    warm, timed_data, prof_data = data[:args.warmup], data[args.warmup:-args.profile_steps], data[-args.profile_steps:]
    tokens = batch * cfg.model.block_size
    fpt = model_flops_per_token(cfg.model, trainer.n)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = {"preset": preset, "batch": batch, "block": cfg.model.block_size, "kernels": args.kernels,
           "compile": args.compile, "steps": args.steps, "sides": {}}
    for side_name, side in sides.items():
        w0 = time.perf_counter()
        for i, (x, y) in enumerate(warm):
            float(side.train_step(i, x, y))
        warm_s = time.perf_counter() - w0
        seconds = timed(side, timed_data, args.warmup, device)
        tps = tokens * args.steps / seconds
        res["sides"][side_name] = {"tokens_per_s": tps, "warmup_s": warm_s, "ms_per_step": 1e3 * seconds / args.steps,
                                   "mfu_bf16": mfu(tps, fpt, table_peak(name, "bf16")),
                                   "profile": profile(side, prof_data, args.warmup + args.steps, device)}
    res["compile_and_warmup_s"] = res["sides"]["peer"]["warmup_s"]
    res["andrea_train_tokens_per_s"] = andrea_train_tps(args.andrea_json, preset)
    a, p = res["sides"]["andrea"], res["sides"]["peer"]
    res["peer_over_andrea"] = p["tokens_per_s"] / a["tokens_per_s"]
    res["gap"] = name_the_gap(a["profile"], p["profile"]) if res["peer_over_andrea"] > 1 else []
    real = res["andrea_train_tokens_per_s"]
    res["loop_gap"] = None  # the real loop slower than the peer: how much of that is the loop around train_step
    if real and p["tokens_per_s"] > real:
        res["loop_gap"] = (f"the loop: `andrea train` {real:,.0f} tokens/s against its bare train_step "
                           f"{a['tokens_per_s']:,.0f} ({1e3 * tokens * (1 / real - 1 / a['tokens_per_s']):+.3f} "
                           f"ms/step: control plane, records, ledger, signals)")
    res["seconds"] = time.perf_counter() - t0
    del trainer, peer, sides
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def markdown(results: list[dict]) -> str:
    lines = ["| preset | `andrea train` tokens/s (part 2) | andrea train_step tokens/s | peer tokens/s | peer / andrea "
             "| MFU andrea / peer |", "|---|---|---|---|---|---|"]
    for r in results:
        a, p = r["sides"]["andrea"], r["sides"]["peer"]
        real = r["andrea_train_tokens_per_s"]
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        lines.append(f"| {r['preset']} | {'-' if real is None else format(real, ',.0f')} | {a['tokens_per_s']:,.0f} "
                     f"| {p['tokens_per_s']:,.0f} | {r['peer_over_andrea']:.2f}x | {pct(a['mfu_bf16'])} / "
                     f"{pct(p['mfu_bf16'])} |")
    for r in results:
        lines += ["", f"### {r['preset']}: per step (ms), by category: andrea vs peer", "",
                  "| category | andrea | peer |", "|---|---|---|"]
        a, p = r["sides"]["andrea"]["profile"], r["sides"]["peer"]["profile"]
        for cat, _ in CATEGORIES:
            if cat in a["categories"] or cat in p["categories"]:
                lines.append(f"| {cat} | {a['categories'].get(cat, 0.0):.3f} | {p['categories'].get(cat, 0.0):.3f} |")
        lines.append(f"| wall per step (profiled) | {a['wall_ms_per_step']:.3f} | {p['wall_ms_per_step']:.3f} |")
        if r["gap"]:
            lines += ["", "Where the peer is faster (andrea minus peer, heaviest kernels in ms/step):", ""]
            lines += [f"- {g}" for g in r["gap"]]
        else:
            lines += ["", "andrea's train_step is at least as fast as the peer's here."]
        if r.get("loop_gap"):
            lines += ["", f"- {r['loop_gap']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--presets", nargs="+", default=["andrea-120m", "andrea-12m"],
                   help="the headline first: a part cut by its cap keeps what finished")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kernels", default=None, choices=["torch", "triton"], help="default: triton on CUDA")
    p.add_argument("--compile", default="inductor", help="torch.compile backend for the peer, or none")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side (the peer compiles in the first)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--andrea-json", help="bench/gpu_train.py's JSON: the real loop's tokens/s beside these")
    p.add_argument("--json", help="the results, rewritten after each preset")
    args = p.parse_args(argv)
    if args.steps < 1 or args.profile_steps < 1 or args.warmup < 1:
        p.error("--warmup, --steps and --profile-steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    args.kernels = args.kernels or ("triton" if device.type == "cuda" else "torch")
    results, errors = [], {}
    for preset in args.presets:
        try:
            results.append(bench_preset(args, preset, device))
        except Exception as e:  # noqa: BLE001 - one preset failing (a compile error, OOM) never hides the next
            errors[preset] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        if args.json:
            Path(args.json).write_text(json.dumps({"device": str(device), "results": results, "errors": errors},
                                                  indent=1))
    print(markdown(results))
    for preset, error in errors.items():
        print(f"\n- {preset}: FAILED: {error.splitlines()[0] if error else ''}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
