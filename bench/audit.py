"""Sample audits' cost on the training loop, measured from outside the process, and the old generation path
against the new one in process.

1. End to end (the figure the target is about). A prepared run directory (the tokenizer and token files of a
   first start, made once, or `--prepared DIR`) is copied into a fresh directory per run, so every run starts
   at step 0 of the same data; each run is `python -m andrea train --preset P --steps N` at the preset's batch,
   either with `--set sample.every=1` (an audit of the preset's prompts at every step boundary) or with
   `--set sample.prompts=[]` (none). The two alternate and their order reverses at every repetition
   (A B, B A, ...). A run's step time is read from its ledger: the `time` of consecutive step entries, which the
   control plane records right after each step; the interval from step s to s + 1 holds boundary s (with its
   audit, s >= 1) and step s + 1. Checkpoints (every 100 steps in the presets) and evals (every 500) fall
   outside the measured intervals. Audit cost = median interval with audits - median interval without, printed
   as a fraction of the latter, pooled over all runs and as the median of the per-repetition fractions.
   Target: <= 0.08 of a training step (ANDREA-12M, preset batch, CPU).
2. In process, on the same weights (the preset's initialisation) and the preset's prompts: the old loop
   (`generate.decode_uncached`: a full forward of each prompt's whole context per new token, prompt by prompt)
   against the new batched KV-cached call (`Trainer.generate`), median seconds of `--micro-repeats` calls each,
   alternating, and whether both chose the same tokens from the same generators. The old loop runs twice: on
   the process's threads, as training ran it, and on one thread, as the new path decodes (on a loaded machine
   the old loop's two-thread barriers alone cost it several times its one-thread time: see `_one_cpu_thread`
   in andrea/model/generate.py).

Reads the presets and, with --prepared, that directory; writes run directories only under a fresh temporary
directory (removed afterwards) and a markdown report to stdout. Timings describe this machine (a shared or
busy machine makes step times noisy: use more --repeats); nothing here fails on them.

    python bench/audit.py                                   # ANDREA-12M: ~3-5 min on 2 CPU cores
    python bench/audit.py --steps 6 --repeats 3 --prepared runs/andrea-12m
    python bench/audit.py --preset andrea-tiny --steps 6    # seconds: a smoke run of the bench itself
    python bench/audit.py --threads 1                       # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andrea.config import load as configload  # noqa: E402
from andrea.model import generate as generation  # noqa: E402
from andrea.data.store import TextCodec  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402

TARGET = 0.08
VARIANTS = {"audits": "sample.every=1", "none": "sample.prompts=[]"}


def andrea_train(args: argparse.Namespace, run_dir: Path, steps: int, *sets: str) -> None:
    cmd = [sys.executable, "-m", "andrea", "train", "--preset", args.preset, "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", 'train.device="cpu"', *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode != 0:
        sys.exit(f"bench/audit.py: {' '.join(cmd[1:])} failed:\n{result.stderr[-2000:]}")


def prepare(args: argparse.Namespace, into: Path) -> Path:
    """A first start (tokenizer training, tokenization) with no step taken."""
    run_dir = into / "prepared"
    t0 = time.perf_counter()
    andrea_train(args, run_dir, 0)
    print(f"prepared {run_dir} in {time.perf_counter() - t0:.0f} s (first start: tokenizer and token files)")
    return run_dir


def step_intervals(args: argparse.Namespace, prepared: Path, work: Path, variant: str) -> list[float]:
    steps = args.steps
    run_dir = work / f"run-{variant}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shutil.copy(prepared / "tokenizer.json", run_dir / "tokenizer.json")
    shutil.copytree(prepared / "data", run_dir / "data")
    andrea_train(args, run_dir, steps, VARIANTS[variant])
    entries = [json.loads(line) for line in (run_dir / ".loss.json").read_text().splitlines() if line]
    times = {e["step"]: e["time"] for e in entries if "event" not in e}
    if variant == "audits":
        audited = json.loads((run_dir / ".samples.json").read_text())["audits"]
        assert {a["step"] for a in audited} >= set(range(1, steps)), "an audit is missing"
    shutil.rmtree(run_dir)
    return [times[s + 1] - times[s] for s in range(1, steps)]


def end_to_end(args: argparse.Namespace, prepared: Path, work: Path) -> None:
    runs: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for rep in range(args.repeats):
        for variant in order:
            intervals = step_intervals(args, prepared, work, variant)
            runs[variant].append(intervals)
            print(f"  rep {rep} {variant:6s} step intervals (s): {', '.join(f'{x:.3f}' for x in intervals)}")
        order.reverse()
    with_, none = (statistics.median(x for r in runs[v] for x in r) for v in ("audits", "none"))
    pooled = (with_ - none) / none
    paired = statistics.median((statistics.median(a) - statistics.median(b)) / statistics.median(b)
                               for a, b in zip(runs["audits"], runs["none"]))
    print(f"\n| {args.preset}, batch {args.batch}, CPU ({torch.get_num_threads()} threads) | seconds |\n|---|---|")
    print(f"| median step interval, no audits | {none:.3f} |")
    print(f"| median step interval, an audit at every step | {with_:.3f} |")
    print(f"| audit cost | {with_ - none:.3f} |")
    verdict = "PASS" if pooled <= TARGET else "MISS"
    print(f"\naudit cost = **{pooled:.3f}** of a training step pooled, {paired:.3f} median of the per-repetition "
          f"fractions ({args.repeats} x {args.steps - 1} intervals per variant); target <= {TARGET}: {verdict}")


def microbench(args: argparse.Namespace, prepared: Path) -> None:
    cfg = configload.load(preset=args.preset)
    sc = cfg.sample
    codec = TextCodec.load(prepared / "tokenizer.json")
    prompts = [codec.encode(p) or [codec.eot] for p in sc.prompts]
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.model.eval()

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(r) for r in range(len(prompts))]

    def old() -> list[list[int]]:
        pick = generation.sampler(sc.temperature, sc.top_k, gens())
        return generation.decode_uncached(trainer.model, prompts, sc.max_new_tokens, pick)

    def old_one_thread() -> list[list[int]]:
        with generation._one_cpu_thread(torch.device("cpu")):
            return old()

    def new() -> list[list[int]]:
        return trainer.generate(prompts, sc.max_new_tokens, temperature=sc.temperature, top_k=sc.top_k,
                                generators=gens())

    subjects = [("old", old), ("old, 1 thread", old_one_thread), ("new", new)]
    times: dict[str, list[float]] = {name: [] for name, _ in subjects}
    outputs = {}
    new()  # warm-up (first-call allocations)
    for _ in range(args.micro_repeats):
        for name, fn in subjects:
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
        subjects.reverse()
    t = {name: statistics.median(ts) for name, ts in times.items()}
    lengths = "+".join(str(len(p)) for p in prompts)
    print(f"\nIn process, {args.preset} (init weights), {len(prompts)} prompts ({lengths} tokens) x "
          f"{sc.max_new_tokens} new tokens, median of {args.micro_repeats}:")
    print("| path | seconds per audit |\n|---|---|")
    print(f"| old: uncached, a full forward per token, prompt by prompt, {torch.get_num_threads()} threads (as "
          f"training) | {t['old']:.3f} |")
    print(f"| old, on one thread | {t['old, 1 thread']:.3f} |")
    print(f"| new: one batch, KV cache (decodes on one thread, see andrea/model/generate.py) | {t['new']:.3f} |")
    same = "yes" if outputs["old"] == outputs["new"] else "no (float rounding at a sampling boundary)"
    print(f"\nspeed-up {t['old'] / t['new']:.1f}x ({t['old, 1 thread'] / t['new']:.1f}x against the old loop on one "
          f"thread); same tokens from the same generators: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="andrea-12m")
    p.add_argument("--steps", type=int, default=4, help="steps per run (steps - 1 measured intervals)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant, order reversed each time")
    p.add_argument("--micro-repeats", type=int, default=3)
    p.add_argument("--prepared", type=Path, help="a run directory with tokenizer.json and data/ to copy")
    p.add_argument("--dir", type=Path, default=None, help="where the temporary run directories go")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the runs and torch threads here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 2:
        sys.exit("bench/audit.py: --steps must be >= 2 (one measured interval)")
    args.batch = configload.load(preset=args.preset).train.batch_size
    print(f"# Sample-audit cost: {args.preset}, CPU, {os.cpu_count()} cores\n")
    work = Path(tempfile.mkdtemp(prefix="andrea-audit-bench-", dir=args.dir))
    try:
        prepared = args.prepared or prepare(args, work)
        end_to_end(args, prepared, work)
        microbench(args, prepared)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
