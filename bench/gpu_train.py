"""Parts 2 and 6 of bench/gpu_check.sh (the GPT presets, then the modern ones): the real `andrea train` on a
device, per preset: tokens/s and MFU read from its ledger, its peak device memory against `andrea info`'s estimate,
one SIGUSR1 checkpoint while it trains, SIGTERM's clean exit, and a bit-exact resume.

Per preset, in a scratch directory (--work), every run a real andrea process (its command line, its signals):
  prep      `andrea prepare` once (all presets side by side: CPU work), its tokenizer and token files copied into
            each run as tests/runs.py does, so the runs below pay only for training.
  live      `andrea train --steps 10**6` under bench/train_peak.py (andrea's CLI in that process; its peak device
            memory written at exit). Waits for the ready line, then for ledger step W (kernels compiled, warm)
            and step W + M: tokens/s = the ledger's tokens between those two entries / the ledger's time between
            them: the whole loop (control plane, records, ledger), no host sync added. MFU from it (andrea/control/observe/mfu.py).
            Then SIGUSR1: a checkpoint must be committed while the process keeps training (the ledger passes that
            step); then SIGTERM: exit 0 with the newest checkpoint at the ledger's last step S.
  verify    the live run's checkpoints (the SIGUSR1 one and S) read back in full as `andrea verify` does, then
  resume    `andrea train --steps S + R` in the live run's directory (resumes from S); side by side with both,
  straight  a fresh run of the same configuration to S + R in one go: their step_{S+R}.bin must be equal bytes.
Checkpoint and audit cadences are pushed past the runs (10**6) so only the signals checkpoint; W + M stays below
both presets' eval cadence, so no evaluation falls inside the measured window.

Writes --json after each preset (a part cut by its cap keeps what finished) and every run's output under --logs.
Exit 1 when a check fails; the figures never fail it.

    python bench/gpu_train.py --json out.json --work /tmp/w --logs /tmp/logs            # CUDA, both presets
    python bench/gpu_train.py --presets andrea-12m-modern andrea-120m-modern --json out.json --work /tmp/w --logs /tmp/l
    python bench/gpu_train.py --presets andrea-tiny --device cpu --kernels torch --warmup-steps 3 --measure-steps 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.control.observe.mfu import mfu, model_flops_per_token, table_peak  # noqa: E402

FAR = 10**6  # a step no run reaches: cadences and the live run's target
# (W, M) below eval_every (500, 1000); the modern presets' windows are shorter: bench/gpu_check.sh's part 6 has 90 s
WINDOWS = {"andrea-12m": (50, 300), "andrea-120m": (20, 100), "andrea-12m-modern": (40, 200),
           "andrea-120m-modern": (15, 60)}
WAIT_S = 90.0  # any one condition; the part's cap bounds the whole


class Failed(Exception):
    """A check that cannot go on (no ready line, no exit): recorded, the next preset still runs."""


def andrea_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "andrea", *args]


def wait_for(what: str, condition, timeout: float = WAIT_S, every: float = 0.05):
    """Poll `condition` until it returns something truthy; Failed(what) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Ledger:
    """The step entries of a run's `.loss.json`, read incrementally (whole lines only)."""

    def __init__(self, run_dir: Path):
        self.path, self.offset, self.steps = run_dir / ".loss.json", 0, []

    def read(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offset += end
            self.steps += [e for e in map(json.loads, chunk[:end].splitlines()) if "event" not in e]
        return self.steps

    def at(self, step: int) -> dict | None:
        return next((e for e in self.read() if e["step"] >= step), None)

    def last(self) -> int:
        steps = self.read()
        return steps[-1]["step"] if steps else 0


def newest_checkpoint(run_dir: Path) -> int | None:
    steps = [int(p.stem.split("_")[1]) for p in run_dir.glob("step_*.bin")]
    return max(steps) if steps else None


def seed(prep: Path, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True)
    shutil.copy(prep / "tokenizer.json", run_dir / "tokenizer.json")
    shutil.copytree(prep / "data", run_dir / "data")
    return run_dir


def info(preset: str, device: str, overrides: list[str]) -> dict:
    out = subprocess.run(andrea_cmd("info", "--preset", preset, "--device", device, *overrides), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out)


def live_run(args, preset: str, prep: Path, work: Path, logs: Path, train_args: list[str], res: dict) -> int:
    """The live run (module docstring); fills res and returns the step S it stopped at."""
    checks = res["checks"]
    run_dir, log = seed(prep, work / "live"), logs / f"{preset}_live.log"
    peak_file = work / "peak.json"
    cmd = [sys.executable, str(REPO / "bench" / "train_peak.py"), str(peak_file), "train", *train_args,
           "--run-dir", str(run_dir), "--steps", str(FAR)]
    W, M = (args.warmup_steps, args.measure_steps) if args.measure_steps else WINDOWS[preset]
    ledger = Ledger(run_dir)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for("the ready line", lambda: "\nready " in "\n" + text() or proc.poll() is not None)
        checks["ready"] = proc.poll() is None
        if not checks["ready"]:
            raise Failed(f"exited {proc.returncode} before its ready line")
        a = wait_for(f"ledger step {W}", lambda: ledger.at(W) or proc.poll() is not None)
        b = wait_for(f"ledger step {W + M}", lambda: ledger.at(W + M) or proc.poll() is not None)
        if proc.poll() is not None:
            raise Failed(f"exited {proc.returncode} while measuring")
        seconds = b["time"] - a["time"]
        res["window"] = {"from_step": a["step"], "to_step": b["step"], "seconds": seconds}
        res["tokens_per_s"] = (b["tokens"] - a["tokens"]) / seconds
        window = [e for e in ledger.read() if a["step"] <= e["step"] <= b["step"]]
        gaps = sorted(y["time"] - x["time"] for x, y in zip(window, window[1:]))
        res["step_ms_median"] = 1e3 * gaps[len(gaps) // 2] if gaps else None

        commits = lambda: text().count(" committed in ")  # noqa: E731  (the writer's log line)
        before = commits()
        proc.send_signal(signal.SIGUSR1)
        checks["usr1_checkpoint"] = bool(wait_for("the SIGUSR1 checkpoint", lambda: commits() > before
                                                  or proc.poll() is not None)) and proc.poll() is None
        at_commit = ledger.last()
        checks["usr1_keeps_training"] = bool(wait_for("steps after the SIGUSR1 checkpoint",
                                                      lambda: ledger.last() >= at_commit + 5 or proc.poll() is not None)
                                             ) and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=WAIT_S)
        checks["sigterm_exit_0"] = rc == 0
        stop, last = newest_checkpoint(run_dir), ledger.last()
        checks["checkpoint_at_last_step"] = stop is not None and stop == last
        res["stop_step"] = stop
        if stop is None:
            raise Failed("no checkpoint after SIGTERM")
        return stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if peak_file.exists():
            res["peak"] = json.loads(peak_file.read_text())


def resume_check(preset: str, prep: Path, work: Path, logs: Path, train_args: list[str], stop: int, extra: int,
                 res: dict) -> None:
    """verify, resume and straight (module docstring): straight starts at once beside the verification of the live
    run, which must finish before resume writes into that directory; the final checkpoints compared byte for byte."""
    target = stop + extra
    live, straight = work / "live", seed(prep, work / "straight")

    def start(name: str, run_dir: Path) -> subprocess.Popen:
        with open(logs / f"{preset}_{name}.log", "w") as out:
            return subprocess.Popen(andrea_cmd("train", *train_args, "--run-dir", str(run_dir), "--steps", str(target)),
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    procs = {"straight": start("straight", straight)}
    checks = res["checks"]
    checks["verify"] = verify(live, res)
    procs["resume"] = start("resume", live)
    rcs = {name: p.wait(timeout=600) for name, p in procs.items()}
    res["resume_to"] = target
    files = [d / f"step_{target:06d}.bin" for d in (live, straight)]
    checks["resume_exit_0"] = rcs["resume"] == 0 and rcs["straight"] == 0
    checks["resume_bit_exact"] = all(f.exists() for f in files) and files[0].read_bytes() == files[1].read_bytes()


def verify(run_dir: Path, res: dict) -> bool:
    """Every checkpoint of the run read back in full, as `andrea verify` does (cli.cmd_verify: the same call)."""
    from andrea.rundir import checkpoint as ckpt
    res["verified"] = []
    try:
        for _, path in ckpt.list_checkpoints(run_dir):
            res["verified"].append(ckpt.validate(path, res["n_params"], deep=True).step)
    except ckpt.CheckpointError as e:
        res["errors"].append(f"verify: {e}")
        return False
    return len(res["verified"]) >= 2  # the SIGUSR1 checkpoint and SIGTERM's


def figures(res: dict, est: dict, model_cfg, device_name: str) -> None:
    """MFU and peak-vs-estimate from what the runs measured."""
    res["flops_per_token"] = fpt = model_flops_per_token(model_cfg, est["n_params"])
    tps = res.get("tokens_per_s")
    res["mfu_bf16"] = mfu(tps, fpt, table_peak(device_name, "bf16")) if tps else None
    res["mfu_tf32"] = mfu(tps, fpt, table_peak(device_name, "tf32")) if tps else None
    res["estimate_bytes"] = est["memory"]["total"]
    peak = res.get("peak") or {}
    measured = peak.get("max_allocated", peak.get("max_rss"))
    res["peak_bytes"] = measured
    res["peak_over_estimate"] = measured / res["estimate_bytes"] if measured else None


def bench_preset(args, preset: str, prep: Path, prep_proc, work: Path, logs: Path, device_name: str) -> dict:
    from andrea.config import load as configload
    overrides = [x for o in args.set for x in ("--set", o)]
    train_args = ["--preset", preset, "--device", args.device, "--kernels", args.kernels,
                  "--checkpoint-every", str(FAR), *overrides]  # sample.every = 0 follows checkpoint.every
    res = {"preset": preset, "device": device_name, "kernels": args.kernels, "checks": {}, "errors": []}
    t0 = time.monotonic()
    try:
        est = info(preset, "cuda" if args.device == "cuda" else "cpu", overrides)
        res["n_params"] = est["n_params"]
        if prep_proc.wait(timeout=600) != 0:
            raise Failed(f"andrea prepare exited {prep_proc.returncode} (logs/{preset}_prepare.log)")
        stop = live_run(args, preset, prep, work, logs, train_args, res)
        resume_check(preset, prep, work, logs, train_args, stop, args.resume_steps, res)
    except Exception as e:  # noqa: BLE001 - recorded with the preset; the next preset still runs
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        if "n_params" in res:
            figures(res, est, configload.load(preset=preset, overrides=args.set).model, device_name)
        res["seconds"] = time.monotonic() - t0
    res["ok"] = not res["errors"] and bool(res["checks"]) and all(res["checks"].values())
    return res


def markdown(results: list[dict]) -> str:
    lines = ["| preset | tokens/s (`andrea train`) | step ms | MFU bf16 | peak / estimate | checks |",
             "|---|---|---|---|---|---|"]
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in results:
        ratio = r.get("peak_over_estimate")
        peak = "-" if not ratio else (f"{r['peak_bytes'] / 2**30:.2f} / {r['estimate_bytes'] / 2**30:.2f} GiB "
                                      f"({ratio:.2f}x)")
        failed = [k for k, v in r["checks"].items() if not v] + r["errors"]
        mfu_pct = "-" if r.get("mfu_bf16") is None else f"{100 * r['mfu_bf16']:.1f}%"
        lines.append(f"| {r['preset']} | {num(r.get('tokens_per_s'), ',.0f')} | {num(r.get('step_ms_median'), '.1f')} "
                     f"| {mfu_pct} | {peak} | {'ok' if r['ok'] else 'FAIL: ' + '; '.join(failed)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--presets", nargs="+", default=["andrea-12m", "andrea-120m"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kernels", default="triton", choices=["torch", "triton"])
    p.add_argument("--warmup-steps", type=int, default=20, help="W (with --measure-steps; default per preset)")
    p.add_argument("--measure-steps", type=int, default=0, help="M: the measured window (default per preset)")
    p.add_argument("--resume-steps", type=int, default=10, help="R: steps past the SIGTERM stop (default 10)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    p.add_argument("--work", required=True, help="scratch directory for the runs (a real disk)")
    p.add_argument("--logs", required=True, help="where every run's output goes")
    p.add_argument("--json", help="the results, rewritten after each preset")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to run", file=sys.stderr)
            return 2
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = "cpu"
    work, logs = Path(args.work), Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    preps = {}
    for preset in args.presets:  # every preparation at once: tokenizer training and tokenizing are CPU work
        prep = work / preset / "prep"
        prep.mkdir(parents=True)
        with open(logs / f"{preset}_prepare.log", "w") as out:
            preps[preset] = (prep, subprocess.Popen(
                andrea_cmd("prepare", "--preset", preset, "--run-dir", str(prep),
                           *[x for o in args.set for x in ("--set", o)]),
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
    results = []
    for preset in args.presets:
        prep, proc = preps[preset]
        results.append(bench_preset(args, preset, prep, proc, work / preset, logs, device_name))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": device_name, "results": results}, indent=1))
    print(markdown(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
