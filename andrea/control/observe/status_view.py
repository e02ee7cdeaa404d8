"""`andrea status`'s human view: a dozen lines read at a glance, drawn from the JSON report (`--json` prints it).

`pace` measures, from the ledger's step entries, what the report's `pace` holds (the last loss and tokens seen,
seconds per step over the newest steps of one process, the wall time since the first step, the time to the target
step at that pace); `view` writes the lines from the whole report (commands/operate.py `run_status`). Both are pure
functions over plain data: no file is read here.
"""

from __future__ import annotations

import statistics
from typing import Any

PACE_STEPS = 50  # the newest step intervals the pace is measured over (one process's: a restart's gap is no step)


def pace(steps: list[dict[str, Any]], target: int | None) -> dict[str, Any] | None:
    """The pace of a run from its effective step entries (ledger.history), oldest first; None before a step."""
    if not steps:
        return None
    last = steps[-1]
    window = steps[-PACE_STEPS - 1:]
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(window, window[1:])
            if b["step"] > a["step"] and "time" in a and "time" in b]
    # the median: a checkpoint write or a restart between two entries is one slow interval, not the pace
    per_step = statistics.median(gaps) if gaps else None
    left = max(target - last["step"], 0) if target is not None else None
    return {"loss": last.get("loss"), "tokens": last.get("tokens"), "target_step": target,
            "seconds_per_step": per_step,
            "elapsed_s": last["time"] - steps[0]["time"] if "time" in last and "time" in steps[0] else None,
            "eta_s": left * per_step if left is not None and per_step is not None else None}


def duration(seconds: float | None) -> str:
    """1d 04:05:06, 04:05:06 or '-'."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    clock = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {clock}" if days else clock


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def last_incident(report: dict[str, Any]) -> dict[str, Any] | None:
    """The newest incident marker of any kind (the report's `incidents`: the newest of each)."""
    found = [m for m in (report.get("incidents") or {}).values() if m]
    return max(found, key=lambda m: (m.get("time", 0), m.get("step", 0))) if found else None


def view(report: dict[str, Any]) -> list[str]:
    """The lines of `andrea status RUN_DIR` for the report `run_status` builds (any state, before the first step
    included)."""
    p = report.get("pace") or {}
    who = f"running, pid {report['pid']}" if report.get("running") else "not running"
    lines = [f"{report['run_dir']}: {report['state']} ({who})"]
    if report.get("step") is None:
        lines.append("no training step yet")
    else:
        target = p.get("target_step")
        lines.append(f"step      {report['step']:,}" + (f" of {target:,} ({100 * report['step'] / target:.1f} %)"
                                                          if target else ""))
        lines.append(f"loss      {_num(p.get('loss'))} last, {_num(report.get('loss_ema'))} EMA"
                     + (f", {_num(report['val_loss'])} held-out (step {report['val_step']:,})"
                        if report.get("val_loss") is not None else ", no held-out loss yet"))
        mfu = (report.get("mfu") or {}).get("value")
        unmeasured = (report.get("mfu") or {}).get("peak")  # why there is none: a CPU, a GPU not in the table
        lines.append(f"pace      {_num(p.get('seconds_per_step'), '.3g')} s/step"
                     + (f", MFU {100 * mfu:.1f} %" if mfu is not None
                        else ", MFU not measured (set train.peak_tflops)" if unmeasured else "")
                     + (f", {p['tokens']:,} tokens seen" if p.get("tokens") is not None else ""))
        at_target = target is not None and report["step"] >= target
        lines.append(f"time      {duration(p.get('elapsed_s'))} since the first step, "
                     + ("at its target (`--steps N` trains further)" if at_target
                        else f"{duration(p.get('eta_s'))} to the target at this pace" if p.get("eta_s") is not None
                        else "no pace yet"))
    lines.append(f"saved     {report.get('newest_checkpoint') or 'no checkpoint yet'}"
                 + (f" ({len(report['not_whole'])} not whole: `andrea verify`)" if report.get("not_whole") else ""))
    rep = report.get("replica")
    if rep:
        lag = rep.get("lag_steps") or 0
        lines.append(f"replica   {rep.get('uri', '?')}: step {rep.get('step')}"
                     + (f", {lag:,} steps behind" if lag else ", up to date")
                     + (f"; error: {rep['error']}" if rep.get("error") else ""))
    incident = last_incident(report)
    guard = report.get("guard") or {}
    if incident is not None:
        detail = incident.get("reason") or incident.get("error") or incident.get("detail") or ""
        lines.append(f"incident  {incident['event']} at step {incident.get('step'):,}"
                     + (f": {detail}" if detail else "") + (f" ({guard.get('rollbacks')} rollbacks in all)"
                                                            if guard.get("rollbacks") else ""))
    else:
        lines.append("incident  none")
    if report.get("phase"):
        lines.append(f"phase     {report['phase']} (a pivot or a policy change starts the next)")
    lines.append("more: `andrea status RUN_DIR --json` (arms' shares, data, guard, replica, W&B)")
    return lines
