"""False-positive check of the divergence guard's defaults (andrea/control/guard/decisions.py, config `[guard]`).

Trains a healthy run with the preset's own settings (a real `python -m andrea train` process, guard on by
default) and reports: the incidents and rollbacks the guard recorded (the claim: zero), and how close the run
came to one — the detector replayed offline over the ledger's step entries gives, for every step, loss / its
band edge and grad norm / its band edge (1.0 = anomalous) and the most anomalies in any persistence window
(`persist` = 3 of 5 makes an incident).

    python bench/guard.py                                   # andrea-tiny, its whole schedule (2000 steps)
    python bench/guard.py --preset andrea-12m --steps 300 --batch-size 4 --max-bytes 2000000
    python bench/guard.py --json out.json

Reads the presets; writes a temporary run directory (removed unless --keep DIR) and a markdown report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from andrea.config.schema import GuardConfig  # noqa: E402
from andrea.config.load import load  # noqa: E402
from andrea.control.guard.detector import Detector, band  # noqa: E402
from andrea.rundir.ledger import history, read_ledger  # noqa: E402


def headroom(entries: list[dict], cfg: GuardConfig, warmup_steps: int = 0) -> dict:
    """Replay the detector over the step entries: the closest each signal came to its band edge (the gradient
    norm once its warm-up grace, `warmup_steps + window`, is over)."""
    det = Detector(cfg)
    worst = {"loss_ratio": 0.0, "loss_step": None, "grad_ratio": 0.0, "grad_step": None, "max_flags": 0}
    for e in entries:
        judged = e["step"] > warmup_steps + cfg.window
        if det.losses:
            lr_ = e["loss"] / band(det.losses, cfg.loss_sigmas, cfg.loss_margin)
            gr_ = e["grad_norm"] / band(det.grads, cfg.grad_sigmas, cfg.grad_margin) if judged else 0.0
            if lr_ > worst["loss_ratio"]:
                worst.update(loss_ratio=lr_, loss_step=e["step"])
            if gr_ > worst["grad_ratio"]:
                worst.update(grad_ratio=gr_, grad_step=e["step"])
        det.feed(e["loss"], e["grad_norm"], judge_grad=judged)
        worst["max_flags"] = max(worst["max_flags"], sum(det.flags))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="andrea-tiny")
    ap.add_argument("--steps", type=int, help="default: the preset's lr_decay_steps (its whole schedule)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--max-bytes", type=int, help="data.max_bytes_per_arm (a faster first start)")
    ap.add_argument("--keep", help="train into this directory and keep it")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = load(preset=args.preset)
    steps = args.steps or cfg.train.lr_decay_steps
    sets = [f"train.batch_size={args.batch_size}"] if args.batch_size else []
    sets += [f"data.max_bytes_per_arm={args.max_bytes}"] if args.max_bytes else []
    run_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="andrea-guard-"))
    cmd = [sys.executable, "-m", "andrea", "train", "--preset", args.preset, "--run-dir", str(run_dir),
           "--steps", str(steps), "--device", "cpu", "--checkpoint-every", str(max(100, steps // 10))]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    entries = read_ledger(run_dir / ".loss.json").entries
    count = {k: sum(e.get("event") == k for e in entries) for k in ("incident", "rollback", "guard_stop")}
    worst = headroom(history(entries), cfg.guard, cfg.train.warmup_steps)
    report = {"preset": args.preset, "steps": steps, "batch_size": args.batch_size or cfg.train.batch_size,
              "exit": proc.returncode, "seconds": round(seconds, 1), **count, **worst}
    print(f"| preset | steps | batch | exit | incidents | rollbacks | max loss/band (step) | "
          f"max grad/band (step) | max anomalies in {cfg.guard.persist_window} |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {steps} | {report['batch_size']} | {proc.returncode} | {count['incident']} | "
          f"{count['rollback']} | {worst['loss_ratio']:.3f} ({worst['loss_step']}) | {worst['grad_ratio']:.3f} "
          f"({worst['grad_step']}) | {worst['max_flags']} (incident at {cfg.guard.persist}) |")
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if not args.keep:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if proc.returncode == 0 and count["incident"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
