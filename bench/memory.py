"""Peak memory and throughput of training steps with micro-batches and activation checkpointing, beside
`andrea info`'s estimate (andrea/model/memory.py).

    python bench/memory.py [--preset andrea-12m] [--micro 32 8 4] [--steps 3] [--threads 1]

Each configuration (micro-batch b in --micro, activation checkpointing off and on) runs in its own process, so
its peak is its own: the trainer of the preset (the plain-torch path, fp32 on CPU; Triton and bf16 on CUDA) on
random tokens of a fixed seed: a warm-up step and one more. Peak memory is the process's peak RSS (getrusage) on
CPU, less the RSS just before the trainer was built (the interpreter and torch's libraries, warmed by one step of
the tiny preset); on CUDA torch.cuda.max_memory_allocated. Throughput is measured apart, every configuration in
one more process, in --steps interleaved rounds after a warm-up round (see `throughput`), per wall second and per
CPU second of the process. The table's last columns compare each peak with the
plain run's (micro-batch = the whole batch, no checkpointing) and with the estimate.
Targets (issue #22, CPU): micro-batch 4 at <= 0.6x the plain run's peak, activation checkpointing at <= 0.75x,
the micro-batches' tokens/s at >= 0.9x the plain run's. Reads and writes no files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(preset: str, micro: int, ac: str, device):
    from andrea.config import load as configload
    from andrea.control.run.trainer import Trainer, resolve_kernels
    cfg = configload.load(preset=preset, overrides=[f"train.micro_batch_size={micro}",
                                                f'train.activation_checkpointing="{ac}"'])
    return cfg, Trainer(cfg, device, resolve_kernels("auto", device))


def random_batch(cfg, seed: int):
    import torch
    gen = torch.Generator().manual_seed(seed)
    B, T, V = cfg.train.batch_size, cfg.model.block_size, cfg.model.vocab_size
    return torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)


def peak(preset: str, micro: int, ac: str, device_name: str) -> dict:
    """One configuration's peak memory, in this process: a warm-up step, then one measured step."""
    import torch

    from andrea.config import load as configload
    from andrea.model import memory
    from andrea.control.run import allocator
    from andrea.control.run.trainer import Trainer, resolve_device, resolve_kernels
    device = resolve_device(device_name)
    warm = configload.load(preset="andrea-tiny")  # touch torch's kernels and libraries once: their pages are baseline
    Trainer(warm, device, resolve_kernels("auto", device)).train_step(0, *random_batch(warm, 0))
    batches = [random_batch(configload.load(preset=preset), s) for s in range(2)]
    gc.collect()
    allocator.release_freed_memory()  # a CPU trainer keeps freed memory (control/run/allocator.py): not the baseline's
    base = rss_bytes()
    cfg, trainer = build(preset, micro, ac, device)
    for s, (x, y) in enumerate(batches):  # the first also allocates what later steps reuse
        float(trainer.train_step(s, x, y).loss)
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device)
    else:
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    est = memory.estimate(cfg.model, trainer.n, micro, activation_checkpointing=ac, device=device.type)
    return {"micro": micro, "ac": ac, "peak": used, "estimate": est.total, "device": device.type}


def throughput(preset: str, configs: list[tuple[int, str]], rounds: int, device_name: str) -> dict:
    """tokens/s of every configuration, measured in ONE process in interleaved rounds (each round runs one step
    of each configuration, in an order that rotates), so a change in the machine's other load falls on all of
    them alike; the first round is a warm-up; the fastest step of each counts (others' load only slows a step)."""
    from andrea.control.run.trainer import resolve_device
    device = resolve_device(device_name)
    built = {c: build(preset, *c, device) for c in configs}
    wall = {c: [] for c in configs}
    cpu = {c: [] for c in configs}
    for r in range(rounds + 1):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            cfg, trainer = built[c]
            x, y = random_batch(cfg, r)
            t0, c0 = time.perf_counter(), time.process_time()
            float(trainer.train_step(r, x, y).loss)  # waits for the device
            if r:
                wall[c].append(time.perf_counter() - t0)
                cpu[c].append(time.process_time() - c0)
    tokens = {c: built[c][0].train.batch_size * built[c][0].model.block_size for c in configs}
    return {f"{m} {ac}": {"tokens_per_s": tokens[(m, ac)] / min(wall[(m, ac)]),
                          "tokens_per_cpu_s": tokens[(m, ac)] / min(cpu[(m, ac)])} for m, ac in configs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--micro", type=int, nargs="+", default=[32, 8, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (OMP_NUM_THREADS) per run; 1 (the default): a step never waits for a "
                         "second free core, so the figures move less with the load of a shared machine")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--one", nargs=2, metavar=("MICRO", "AC"), help=argparse.SUPPRESS)  # a child: one peak
    ap.add_argument("--speed", action="store_true", help=argparse.SUPPRESS)  # a child: the interleaved rounds
    args = ap.parse_args()
    configs = [(m, ac) for ac in ("none", "blocks") for m in args.micro]
    if args.one:
        print(json.dumps(peak(args.preset, int(args.one[0]), args.one[1], args.device)))
        return 0
    if args.speed:
        print(json.dumps(throughput(args.preset, configs, args.steps, args.device)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    common = ["--preset", args.preset, "--steps", str(args.steps), "--device", args.device, "--micro",
              *map(str, args.micro)]
    rows = []
    for micro, ac in configs:
        out = subprocess.run([sys.executable, __file__, *common, "--one", str(micro), ac],
                             capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.splitlines()[-1]))
        print(f"  peak of micro-batch {micro}, activation checkpointing {ac}", file=sys.stderr, flush=True)
    out = subprocess.run([sys.executable, __file__, *common, "--speed"], capture_output=True, text=True, env=env,
                         check=True)
    speed = json.loads(out.stdout.splitlines()[-1])
    for r in rows:
        r.update(speed[f"{r['micro']} {r['ac']}"])
    plain = next(r for r in rows if r["ac"] == "none" and r["micro"] == max(args.micro))
    kind = "peak RSS - baseline" if plain["device"] == "cpu" else "max_memory_allocated"
    print(f"{args.preset} on {plain['device']}, {args.threads} threads; peak = {kind}; tokens/s = the fastest of "
          f"{args.steps} interleaved steps")
    print(f"{'micro':>5} {'act. ckpt':>9} {'peak MiB':>9} {'x plain':>7} {'estimate MiB':>12} {'est/peak':>8} "
          f"{'tokens/s':>9} {'x plain':>7} {'tok/CPU-s':>9} {'x plain':>7}")
    for r in rows:
        print(f"{r['micro']:>5} {r['ac']:>9} {r['peak'] / 2**20:>9,.0f} {r['peak'] / plain['peak']:>7.2f} "
              f"{r['estimate'] / 2**20:>12,.0f} {r['estimate'] / r['peak']:>8.2f} {r['tokens_per_s']:>9,.0f} "
              f"{r['tokens_per_s'] / plain['tokens_per_s']:>7.2f} {r['tokens_per_cpu_s']:>9,.0f} "
              f"{r['tokens_per_cpu_s'] / plain['tokens_per_cpu_s']:>7.2f}")
    small = min(args.micro)
    checks = {f"micro-batch {small} peak <= 0.6x plain":
              next(r for r in rows if r["ac"] == "none" and r["micro"] == small)["peak"] <= 0.6 * plain["peak"],
              "activation checkpointing peak <= 0.75x plain":
              next(r for r in rows if r["ac"] == "blocks" and r["micro"] == plain["micro"])["peak"]
              <= 0.75 * plain["peak"],
              "micro-batches tokens/s >= 0.9x plain":
              all(r["tokens_per_s"] >= 0.9 * plain["tokens_per_s"] for r in rows if r["ac"] == "none"),
              "micro-batches tokens per CPU-s >= 0.9x plain":
              all(r["tokens_per_cpu_s"] >= 0.9 * plain["tokens_per_cpu_s"] for r in rows if r["ac"] == "none")}
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'MISS'} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
