"""The report of bench/gpu_check.sh: every part's record and results in one summary, and the logs in one archive.
Standard library only: it runs whatever Python the machine has, even one that cannot import torch or andrea.

Reads, in the results directory RES:
  parts/plan.tsv        part, cap (s), what it proves: the plan the run followed
  parts/<part>.status   "exit-code seconds cap" as the driver recorded it (no file: the part never started)
  parts/<part>.json     what the part's program wrote (kernels: parts/kernels.xml, pytest's JUnit XML)
  parts/<part>.out      the part's stdout (markdown for the benches)
  logs/                 every part's stderr and every run's output
Writes RES/summary.json, RES/summary.md and RES/logs.tar.gz (parts/ and logs/ inside it), then removes parts/
and logs/: the device tool returns at most 8 files.

    python bench/gpu_report.py --res gpu_out/gpu_check --budget 570
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CUT = {124: "cut at its cap (SIGTERM)", 137: "cut at its cap (SIGKILL)"}


def junit(path: Path) -> dict:
    """pytest's JUnit XML as counts and the ids of what failed."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def part_record(parts: Path, name: str, cap: int, proves: str) -> dict:
    rec = {"part": name, "cap_s": cap, "proves": proves}
    status = parts / f"{name}.status"
    if not status.exists():
        return {**rec, "status": "not run", "rc": None, "seconds": None, "result": None}
    rc, seconds, _ = status.read_text().split()
    rc = int(rc)
    rec.update(rc=rc, seconds=float(seconds),
               status="ok" if rc == 0 else ("timeout" if rc in CUT else "fail"))
    if rc in CUT:
        rec["note"] = CUT[rc]
    result = None
    try:
        if (parts / f"{name}.json").exists():
            result = json.loads((parts / f"{name}.json").read_text())
        elif name == "kernels" and (parts / "kernels.xml").exists():
            result = junit(parts / "kernels.xml")
    except (ValueError, ET.ParseError) as e:  # a part cut while writing: say so, keep the rest
        rec["result_error"] = f"{type(e).__name__}: {e}"
    rec["result"] = result
    return rec


def markdown(summary: dict, parts: Path) -> str:
    env = next((p["result"] for p in summary["parts"] if p["part"] == "env"), None) or {}
    lines = [f"# GPU check: {env.get('device', 'unknown device')}" + (" (SELF-TEST on a CPU)" if summary["selftest"]
                                                                     else ""),
             f"python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda_version')}), "
             f"triton {env.get('imports', {}).get('triton')}; {summary['total_s']:.0f} s of a {summary['budget_s']} s "
             f"budget (caps sum to {summary['caps_sum_s']} s)", "",
             "| part | proves | cap s | seconds | status |", "|---|---|---|---|---|"]
    for p in summary["parts"]:
        status = p["status"] + (f" (exit {p['rc']}: {p.get('note', 'see its log')})" if p["status"] != "ok"
                                and p["rc"] is not None else "")
        seconds = "-" if p["seconds"] is None else f"{p['seconds']:.1f}"
        lines.append(f"| {p['part']} | {p['proves']} | {p['cap_s']} | {seconds} | {status} |")
    missing = {k: v for k, v in env.get("imports", {}).items() if str(v).startswith("MISSING")}
    if missing:
        lines += ["", "Modules that do not import here:"] + [f"- {k}: {v}" for k, v in missing.items()]
    for p in summary["parts"]:
        if p["part"] in ("env", "report"):
            continue
        lines += ["", f"## {p['part']}: {p['proves']}", ""]
        out = parts / f"{p['part']}.out"
        text = out.read_text(errors="replace").strip() if out.exists() else ""
        if p["part"] == "kernels":  # pytest's own output is no markdown: its counts, or its last lines if cut
            r = p["result"]
            if r:
                lines.append(f"{r['passed']} passed, {r['failures'] + r['errors']} failed, {r['skipped']} skipped")
                lines += [f"- FAILED {name}" for name in r["failed"][:30]]
                continue
            text = "```\n" + "\n".join(text.splitlines()[-30:]) + "\n```" if text else ""
        lines.append(text or ("(not run)" if p["status"] == "not run" else
                              f"(no output: {p['status']}; see logs/{p['part']}.log in logs.tar.gz)"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", required=True, help="the results directory")
    ap.add_argument("--budget", type=int, default=570)
    ap.add_argument("--selftest", default="0")
    args = ap.parse_args(argv)
    res = Path(args.res)
    parts = res / "parts"
    plan = [line.split("\t") for line in (parts / "plan.tsv").read_text().splitlines() if line]
    records = [part_record(parts, name, int(cap), proves) for name, cap, proves in plan if name != "report"]
    t0 = os.environ.get("GPU_CHECK_T0")
    total = time.time() - float(t0) if t0 else sum(r["seconds"] or 0 for r in records)
    summary = {"budget_s": args.budget, "caps_sum_s": sum(int(cap) for _, cap, _ in plan),
               "plan": [{"part": n, "cap_s": int(c), "proves": p} for n, c, p in plan], "total_s": total,
               "selftest": args.selftest == "1", "parts": records,
               "ok": all(r["status"] == "ok" for r in records)}
    (res / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (res / "summary.md").write_text(markdown(summary, parts))
    with tarfile.open(res / "logs.tar.gz", "w:gz") as tar:
        for sub in ("parts", "logs"):
            tar.add(res / sub, arcname=sub)
    for sub in ("parts", "logs"):
        shutil.rmtree(res / sub)
    return 0


if __name__ == "__main__":
    sys.exit(main())
