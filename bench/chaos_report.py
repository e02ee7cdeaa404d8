"""The chaos run's report (bench/chaos.py): plain tables on stdout, and the same figures as a dict (`--json`).

Sections: the faults (per fault: its time, the exit it caused, steps lost, seconds from the exit to the first new
step, the ledger markers and notices it left and those expected but missing); the final bytes (the newest
checkpoint's sha256 and the ledger's settled entries against the fault-free run's); every ledger marker and every
notice, each with the fault it belongs to; each start's seconds by phase; the goodput and where the rest went.
Reads what bench/chaos.py hands it; writes nothing but the report.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

from andrea.rundir.ledger import history
from bench import chaos_plan as plan

QUIET_MARKERS = ("eval", "tasks")  # markers that record a measurement, not something that happened to the run


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def final_bytes(run: Path, newest: int | None, led: list[dict], ref: dict) -> dict:
    name = f"step_{newest:06d}.bin" if newest is not None else None
    ref_name = f"step_{ref['newest']:06d}.bin"
    mine = sha256(run / name) if name and (run / name).exists() else None
    theirs = sha256(ref["dir"] / ref_name)
    upto = min(newest or 0, ref["newest"])
    a, b = plan.settled(history(led), upto), plan.settled(history(ref["ledger"]), upto)
    diverged = next((x[0] for x, y in zip(a, b) if x != y), None)
    return {"checkpoint": name, "sha256": mine, "reference_checkpoint": ref_name, "reference_sha256": theirs,
            "same_checkpoint": mine == theirs, "settled_entries": len(a), "reference_settled_entries": len(b),
            "same_ledger": a == b, "first_different_step": diverged}


def restart_phases(segments: list[dict], led: list[dict]) -> list[dict]:
    rows = []
    for s in segments:
        if s["kind"] == "restore":
            rows.append({"kind": "restore", "rc": s["rc"], "seconds": s["exit"] - s["spawned"]})
            continue
        first = plan.first_step_after(led, s["spawned"])
        first_t = first["time"] if first and first["time"] <= s["exit"] else None
        rows.append({"kind": s["kind"], "rc": s["rc"], "action": s.get("action"),
                     "imports": (s["first_line"] - s["spawned"]) if s["first_line"] else None,
                     "to_ready": (s["ready"] - s["first_line"]) if s["ready"] and s["first_line"] else None,
                     "ready_to_step": (first_t - s["ready"]) if first_t and s["ready"] else None,
                     "alive": s["exit"] - s["spawned"]})
    return rows


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def report(args, chaos, ref: dict, final: list[dict], led: list[dict], newest: int | None, notices: list[dict],
           out) -> dict:
    """Print the report to `out`; return its figures. `final` is the chaos run's ledger at the end, `led` every
    line of it ever read (lines the loss of the machine took included), `newest` its newest checkpoint's step,
    `ref` the fault-free run (its dir, ledger and newest step)."""
    w = lambda *a: print(*a, file=out)  # noqa: E731
    injected, t0 = chaos.injected, chaos.t0
    kept_lines = {json.dumps(e, sort_keys=True) for e in final}
    target_reached = newest is not None and newest >= args.steps

    ref_incident = next((e["time"] for e in ref["ledger"] if e.get("event") == "incident"), None)
    ref_steps = [e for e in ref["ledger"] if "event" not in e and (ref_incident is None or e["time"] < ref_incident)]
    ref_rate = plan.steady_rate(ref_steps)
    own_rate = plan.segment_rate(led, [(s["spawned"], s["exit"]) for s in chaos.segments if s["kind"] == "train"])
    rate = max(ref_rate, own_rate or 0.0)  # a shared machine's speed drifts: the faster of the two, never flattering
    steps = [e for e in history(final) if "event" not in e]
    first, last = (steps[0], steps[-1]) if steps else (None, None)
    all_steps = [e for e in led if "event" not in e]
    wall = (all_steps[-1]["time"] - all_steps[0]["time"]) if all_steps else 0.0
    kept = (last["step"] - first["step"]) if steps else 0
    good = plan.goodput(kept, wall, rate) if wall > 0 else 0.0

    markers = [e for e in led if "event" in e and e["event"] not in QUIET_MARKERS and e["time"] >= t0 - 1]
    m_owner = plan.attribute([e["time"] for e in markers], injected)
    n_owner = plan.attribute([e["time"] for e in notices], injected)

    w(f"## andrea chaos run: {args.preset}, target step {args.steps}, a checkpoint every {args.checkpoint_every} "
      f"steps, one fault every {args.every:g} s\n")
    w(f"supervisor: {chaos.outcome}; newest checkpoint step {newest} -> target "
      f"{'REACHED' if target_reached else 'NOT REACHED'}; {len(chaos.segments)} processes; work directory {chaos.work}")
    if getattr(args, "calibration", None):
        w(f"target from a calibration run: {args.calibration['steps_per_s']:.2f} steps/s")
    if chaos.skipped:
        w(f"not injected (the run reached its target first): {', '.join(chaos.skipped)}")

    w("\n### Faults\n")
    w("| # | fault | at (s) | exit | reached | resumed | steps lost | exit -> first step (s) | markers found | "
      "notices found | missing | notes |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, f in enumerate(injected):
        fault = plan.FAULTS[f.kind]
        rec = plan.recovery(f, led, injected[i + 1].at if i + 1 < len(injected) else None)
        seen_m = [e["event"] for e, o in zip(markers, m_owner) if o == i]
        seen_n = [e["event"] for e, o in zip(notices, n_owner) if o == i]
        found_m, found_n = plan.matches(fault.markers, seen_m), plan.matches(fault.notices, seen_n)
        missing = [f"marker {names}" for names, hit in found_m if hit is None] + \
                  [f"notice {names}" for names, hit in found_n if hit is None]
        rc = next((s["rc"] for s in chaos.segments if f.exit_at and abs(s["exit"] - f.exit_at) < 1e-6), None)
        rows.append({"kind": f.kind, "at": f.at - t0, "rc": rc, "reached": rec.reached, "resumed": rec.resumed,
                     "lost": rec.lost, "seconds": rec.seconds, "markers": seen_m, "notices": seen_n,
                     "missing": missing, "notes": f.notes})
        w(f"| {i + 1} | {f.kind} | {f.at - t0:.1f} | {fmt(rc, 'd', 'no exit')} | {fmt(rec.reached, 'd')} | "
          f"{fmt(rec.resumed, 'd')} | {fmt(rec.lost, 'd')} | {fmt(rec.seconds)} | {', '.join(seen_m) or '-'} | "
          f"{', '.join(seen_n) or '-'} | {'; '.join(missing) or '-'} | "
          f"{'; '.join(n for n in f.notes if n != 'ended') or '-'} |")

    bytes_ = final_bytes(chaos.run, newest, final, ref)
    keeps = [k for k in dict.fromkeys(f.kind for f in injected) if plan.FAULTS[k].keeps_bytes]
    w("\n### Final bytes\n")
    w("| | chaos run | fault-free run (the same command, one process) |\n|---|---|---|")
    w(f"| newest checkpoint | {bytes_['checkpoint']} | {bytes_['reference_checkpoint']} |")
    w(f"| sha256 | {bytes_['sha256']} | {bytes_['reference_sha256']} |")
    w(f"| settled ledger step entries (step, loss, lr, grad_norm, tokens, phase) | {bytes_['settled_entries']} | "
      f"{bytes_['reference_settled_entries']} |")
    same = bytes_["same_checkpoint"] and bytes_["same_ledger"]
    w(f"\nverdict: {'SAME BYTES' if same else 'DIFFERENT BYTES'} (checkpoint "
      f"{'equal' if bytes_['same_checkpoint'] else 'differs'}, ledger "
      f"{'equal' if bytes_['same_ledger'] else 'differs from step ' + str(bytes_['first_different_step'])})")
    culprit = plan.first_broken([(r["kind"], r["resumed"]) for r in rows], bytes_["same_checkpoint"],
                                bytes_["first_different_step"], min(newest or 0, ref["newest"]))
    if not same:
        w(f"- which fault: {culprit}")
    w(f"- faults here that {'keep' if same else 'must keep'} the bytes: {', '.join(keeps) or 'none'}")
    for k in dict.fromkeys(f.kind for f in injected):
        w(f"  - {k}: {plan.FAULTS[k].why}")

    w("\n### Incidents on the record\n")
    w("Ledger markers (every marker since the chaos began, but eval/tasks):\n")
    w("| t (s) | event | step | fault | in the final ledger | detail |\n|---|---|---|---|---|---|")
    for e, o in zip(markers, m_owner):
        detail = {k: v for k, v in e.items() if k not in ("event", "step", "time", "identity", "peak", "peak_flops",
                                                          "flops_per_token")}
        kept_here = "yes" if json.dumps(e, sort_keys=True) in kept_lines else "no: lost with the machine"
        w(f"| {e['time'] - t0:.1f} | {e['event']} | {e['step']} | {injected[o].kind if o is not None else '-'} | "
          f"{kept_here} | {str(detail)[:120]} |")
    w("\nNotices received by the webhook:\n")
    w("| t (s) | event | step | fault | message |\n|---|---|---|---|---|")
    for e, o in zip(notices, n_owner):
        w(f"| {e['time'] - t0:.1f} | {e['event']} | {e['step']} | {injected[o].kind if o is not None else '-'} | "
          f"{str(e.get('message'))[:120]} |")

    phases = restart_phases(chaos.segments, led)
    w("\n### Each start's seconds\n")
    w("| # | kind | exit | next | spawn -> first log line | -> ready (what the first line leaves of: torch's import, "
      "the data, the checkpoint read and checked) | "
      "ready -> first step | alive |\n|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(phases):
        if p["kind"] == "restore":
            w(f"| {i} | restore | {p['rc']} | | | | | {p['seconds']:.1f} |")
        else:
            w(f"| {i} | {p['kind']} | {p['rc']} | {p.get('action')} | {fmt(p['imports'], '.2f')} | "
              f"{fmt(p['to_ready'], '.2f')} | {fmt(p['ready_to_step'], '.2f')} | {p['alive']:.1f} |")
    trains = [p for p in phases if p["kind"] == "train" and p["imports"] is not None and p["to_ready"] is not None]
    med = {k: statistics.median([p[k] for p in trains if p[k] is not None] or [0.0])
           for k in ("imports", "to_ready", "ready_to_step")}
    if getattr(chaos, "torch_import_s", None):
        w(f"\n`python -c 'import torch'` alone on this machine now: {chaos.torch_import_s:.2f} s "
          f"(median of --import-probes)")
    w(f"median one-process start: first line {med['imports']:.2f} s, to ready {med['to_ready']:.2f} s, ready to the "
      f"first step {med['ready_to_step']:.2f} s")

    # Each fault's window runs from it to the next fault (the last one's to the last step); the windows' losses add
    # up to the run's, wall - kept / rate. A window's loss is split into dying (fault -> exit), starting again (exit ->
    # the next process's `ready`, a restore included), the steps trained again, and the rest (the first step's
    # warm-up, slower steps beside the store's or a full disk's troubles, noise).
    first_t, last_t = (all_steps[0]["time"], all_steps[-1]["time"]) if all_steps else (t0, t0)
    bounds = [max(f.at, first_t) for f in injected] + [last_t]
    before_gain, before_loss = (plan.window_loss(led, first_t, bounds[0], rate) if injected
                                else (kept, wall - kept / rate))
    windows = []
    for i, (f, r) in enumerate(zip(injected, rows)):
        gained, loss = plan.window_loss(led, bounds[i], bounds[i + 1], rate)
        dying = (f.exit_at - f.at) if f.exit_at else 0.0
        nxt = next((s for s in chaos.segments if f.exit_at and s["kind"] != "restore" and s["spawned"] >= f.exit_at
                    and s.get("ready")), None)
        starting = (nxt["ready"] - f.exit_at) if nxt else 0.0
        again = (r["lost"] or 0) / rate
        windows.append({"kind": f.kind, "seconds": bounds[i + 1] - bounds[i], "new_steps": gained, "lost_s": loss,
                        "dying_s": dying, "starting_s": starting, "again_s": again,
                        "rest_s": loss - dying - starting - again})
    w("\n### Goodput\n")
    w(f"steps kept {kept} (step {first['step'] if first else '-'} to {last['step'] if last else '-'}) / (wall "
      f"{wall:.1f} s from the first step to the last x fault-free {rate:.3f} steps/s) = **{100 * good:.1f} %** "
      f"(target >= 90 % at one fault a minute on andrea-12m)\n")
    w(f"fault-free steps/s: the fault-free run {ref_rate:.3f}, the chaos run's own processes while they trained "
      f"{fmt(own_rate, '.3f')}; the larger is used\n")
    w("Where the rest went, fault by fault (each from it to the next; the rows add up to wall - kept / rate):\n")
    w("| window | seconds | new steps | lost (s) | dying: fault -> exit | starting: exit -> ready | steps again | "
      "the rest (first step, slower steps) |\n|---|---|---|---|---|---|---|---|")
    w(f"| before the first fault | {bounds[0] - first_t:.1f} | {before_gain} | {before_loss:.1f} | | | | |")
    for x in windows:
        w(f"| {x['kind']} | {x['seconds']:.1f} | {x['new_steps']} | {x['lost_s']:.1f} | {x['dying_s']:.1f} | "
          f"{x['starting_s']:.1f} | {x['again_s']:.1f} | {x['rest_s']:.1f} |")
    total = {k: sum(x[k] for x in windows) for k in ("lost_s", "dying_s", "starting_s", "again_s", "rest_s")}
    lost_all = total["lost_s"] + before_loss
    w(f"| **all** ({100 * lost_all / wall if wall else 0:.1f} % of the wall) | {wall:.1f} | {kept} | {lost_all:.1f} | "
      f"{total['dying_s']:.1f} | {total['starting_s']:.1f} | {total['again_s']:.1f} | "
      f"{total['rest_s'] + before_loss:.1f} |")

    return {"target": args.steps, "every": args.every, "preset": args.preset, "outcome": chaos.outcome,
            "faults": rows, "bytes": bytes_, "verdict": {"target_reached": target_reached, "same_bytes": same,
                                                          "first_broken": culprit, "keeps_bytes": keeps},
            "markers": [dict(e, fault=injected[o].kind if o is not None else None) for e, o in zip(markers, m_owner)],
            "notices": [dict(e, fault=injected[o].kind if o is not None else None) for e, o in zip(notices, n_owner)],
            "starts": phases, "goodput": {"steps_kept": kept, "wall_s": wall, "rate": rate, "reference_rate": ref_rate,
                                          "own_rate": own_rate, "goodput": good,
                                          "windows": windows, "lost_s": lost_all}, "skipped": chaos.skipped}
