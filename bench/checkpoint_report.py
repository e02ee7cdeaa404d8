"""The report of bench/checkpoint.py: its results dict as a markdown table, the ratios against the floors, and
the targets with PASS/MISS.

Reads the dict `measure` returns (per method: status, stall_s, total_s, cpu_s, bytes, note; plus cadence, and
the machine facts `main` adds); writes nothing. Every ratio is the median over rounds of the ratio within a
round: the methods of one round share the machine's state, so its noise mostly cancels.
"""

from __future__ import annotations

import statistics
from pathlib import Path

STALL_VS_MEMCPY, THROUGHPUT_VS_DIRECT, CPU_VS_BUFFERED, MAX_OVERHEAD = 1.5, 0.9, 0.1, 0.01


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fs_type(directory: Path) -> str:
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype = line.split()[:3]
            if str(directory.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(res: dict) -> str:
    gb = 1e9
    lines = [f"# Checkpoint benchmark: {res['subject']} ({res['n_params']:,} params, "
             f"{res['payload_bytes'] / gb:.3f} GB payload) on {res['device']}",
             f"directory {res['dir']} ({res['fs']}), {res['repeats']} repeats after a warm-up round, medians; "
             f"torch {res['torch']}, {res['threads']} threads", "",
             "| method | stall s | write s | min stall s | min write s | CPU s | bytes | GB/s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in res["methods"].items():
        if m["status"] != "ok":
            lines.append(f"| {name} | - | - | - | - | - | - | - | not measured: {m['reason']} |")
            continue
        stall, total = median(m["stall_s"]), median(m["total_s"])
        cpu = f"{median(m['cpu_s']):.4f}" if m["cpu_s"] else "-"
        lines.append(f"| {name} | {stall:.4f} | {total:.4f} | {min(m['stall_s']):.4f} | {min(m['total_s']):.4f} | "
                     f"{cpu} | {m['bytes']:,} | {m['bytes'] / total / gb:.2f} | {m['note']} |")
    c = res.get("cadence")
    lines += ["", "## Cadence cost (train_step on random tokens)", ""]
    if c is None or c.get("status") != "ok":
        lines.append(f"not measured: {c['reason'] if c else 'no model'}")
    else:
        lines += [f"train_step: batch {c['batch_size']} x {c['block_size']}, median {c['step_median_s']:.3f} s of "
                  f"{len(c['step_s'])} measured (+{len(c['warmup_s'])} warm-up); checkpoint every {c['every']} steps",
                  f"overhead = stall / (every x step) = {c['stall_s']:.4f} / ({c['every']} x {c['step_median_s']:.3f})"
                  f" = {100 * c['overhead']:.4f}%",
                  f"step after a snapshot, its O_DIRECT commit in flight: {c['during_commit']['next_step_s']:.3f} s "
                  f"(commit {c['during_commit']['commit_s']:.3f} s, {c['during_commit']['commit_cpu_s']:.4f} s CPU) "
                  f"-> with that slowdown {100 * c['overhead_with_interference']:.4f}% (one sample, informational)",
                  f"the same with a buffered commit in flight: {c['during_buffered_commit']['next_step_s']:.3f} s "
                  f"(commit {c['during_buffered_commit']['commit_s']:.3f} s, "
                  f"{c['during_buffered_commit']['commit_cpu_s']:.4f} s CPU)"]
    lines += ["", "## The two floors", ""] + comparisons(res)
    lines += ["", "## Targets (ratios: median over rounds of the ratio within a round)", "",
              "| target | measured | verdict |", "|---|---|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {t['verdict']} |")
    lines.append("\nandrea's stall: the snapshot overlaps the next forward and backward (a non-blocking device-to-host "
                 "copy on a side stream on CUDA, the trainer's copy thread on CPU); it is the host hand-off plus the "
                 "extra time of that step on CUDA, the whole copy here on CPU (bench/checkpoint_e2e.py measures what "
                 "a CPU run pays for it).")
    return "\n".join(lines)


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of per-round ratios a[r] / b[r]: both ran in the same round, so machine noise mostly cancels."""
    return median([x / y for x, y in zip(a, b)])


def throughput_ratio(m: dict, subject: str, floor: str) -> tuple[float, str]:
    """(bytes_s / t_s) / (bytes_f / t_f), paired by round, and its one-line description."""
    scale = m[subject]["bytes"] / m[floor]["bytes"]
    ratio = scale * paired_ratio(m[floor]["total_s"], m[subject]["total_s"])
    ts = m[subject]["bytes"] / median(m[subject]["total_s"])
    tf = m[floor]["bytes"] / median(m[floor]["total_s"])
    return ratio, f"{ratio:.2f}x ({ts / 1e9:.2f} vs {tf / 1e9:.2f} GB/s)"


def comparisons(res: dict) -> list[str]:
    """Informational ratios against the two floors (no target)."""
    m, out = res["methods"], []
    for subject, floor in (("O_DIRECT write", "buffered write"), ("andrea", "buffered write"),
                           ("andrea buffered", "buffered write")):
        if m[subject]["status"] == "ok" and m[floor]["status"] == "ok":
            out.append(f"- {subject} throughput vs {floor}: {throughput_ratio(m, subject, floor)[1]}")
    if m["O_DIRECT write"]["status"] == "ok" and m["buffered write"]["status"] == "ok":
        ratio = paired_ratio(m["O_DIRECT write"]["cpu_s"], m["buffered write"]["cpu_s"])
        out.append(f"- O_DIRECT write CPU vs buffered write CPU: {ratio:.3f}x")
    return out


def targets(res: dict) -> list[dict]:
    out, m = [], res["methods"]

    def ok(name):
        return m[name]["status"] == "ok"

    def at_most(subject: str, base: str, key: str, limit: float, target: str, digits: int, unit: str = "") -> None:
        """The target `subject`'s `key` <= limit x `base`'s, as the paired ratio with both medians."""
        ratio = paired_ratio(m[subject][key], m[base][key])
        out.append(dict(target=target, measured=f"{ratio:.{digits}f}x ({median(m[subject][key]):.4f} s vs "
                                                f"{median(m[base][key]):.4f} s{unit})",
                        verdict=verdict(ratio <= limit)))

    if ok("andrea") and ok("memcpy"):
        at_most("andrea", "memcpy", "stall_s", STALL_VS_MEMCPY, f"andrea stall <= {STALL_VS_MEMCPY}x memcpy", 2)
    if ok("andrea") and ok("O_DIRECT write"):
        ratio, measured = throughput_ratio(m, "andrea", "O_DIRECT write")
        out.append(dict(target=f"andrea throughput >= {THROUGHPUT_VS_DIRECT}x O_DIRECT write", measured=measured,
                        verdict=verdict(ratio >= THROUGHPUT_VS_DIRECT)))
    if ok("andrea") and ok("andrea buffered"):
        at_most("andrea", "andrea buffered", "cpu_s", CPU_VS_BUFFERED,
                f"andrea commit CPU <= {CPU_VS_BUFFERED}x the buffered writer's", 3, " of I/O-thread CPU")
    c = res.get("cadence")
    if c and c.get("status") == "ok":
        out.append(dict(target=f"cadence-{c['every']} overhead <= {100 * MAX_OVERHEAD:g}%",
                        measured=f"{100 * c['overhead']:.4f}%", verdict=verdict(c["overhead"] <= MAX_OVERHEAD)))
    return out
