"""The chaos run, short (bench/chaos.py; `make chaos` is the long one): andrea-tiny meets a poisoned step, a flipped
bit in its newest checkpoint and the loss of its machine, under the supervisor loop, with a real S3 server and a
loopback webhook; it must reach its target with the bytes of the same command on a perfect machine, and the
report must show each fault with what it left on the record. Timings are printed by the bench, never asserted.
Marked slow: `make chaos` runs it before its own run, as `make campaign` runs the campaign's replays (a minute of a
worker, which `make test`'s 10 minutes on 2 cores could not spare; 2026-12-06).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, env

FAULTS = ["poison", "bitflip", "loss"]  # a guard rollback, a checksum quarantine, a restore: one start each at most


@pytest.mark.slow
def test_the_chaos_run_reaches_its_target_with_the_fault_free_bytes_and_reports_every_fault(prepared, tmp_path):
    # Steps held to >= 40 ms (andrea/testhooks.py): on a quiet machine andrea-tiny trains 150 steps in ~2 s, before
    # the faults (2 s apart) could strike; the delay only sleeps, so the bytes are those of an undelayed run.
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, "bench/chaos.py", "--preset", "andrea-tiny", "--steps", "150",
                        "--checkpoint-every", "10", "--every", "2", "--faults", ",".join(FAULTS),
                        "--template", str(prepared), "--import-probes", "0", "--json", str(out), "--keep"],
                       capture_output=True, text=True, timeout=300, env={**env(), "TMPDIR": str(tmp_path), "ANDREA_TEST_STEP_DELAY": "0.04"}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["verdict"]["target_reached"] and figures["outcome"] == "done"
    assert figures["skipped"] == [] and [f["kind"] for f in figures["faults"]] == FAULTS
    assert figures["bytes"]["same_checkpoint"] and figures["bytes"]["same_ledger"], figures["bytes"]
    assert figures["bytes"]["checkpoint"] == "step_000150.bin"
    rows = {f["kind"]: f for f in figures["faults"]}
    assert {"incident", "rollback"} <= set(rows["poison"]["markers"]) and rows["poison"]["lost"] > 0
    assert {"incident", "rollback"} <= set(rows["poison"]["notices"])
    for kind in ("bitflip", "loss"):  # SIGKILLed: an exit, a resume, a first new step after it
        assert rows[kind]["rc"] == -9 and "resume" in rows[kind]["markers"] and rows[kind]["seconds"] > 0, rows[kind]
    assert rows["bitflip"]["lost"] >= 10  # the flipped checkpoint was not resumed: one cadence at least trained again
    assert {"quarantine", "resume_below"} <= set(rows["bitflip"]["markers"]) & set(rows["bitflip"]["notices"])
    assert all(not rows[kind]["missing"] for kind in FAULTS), [(k, rows[k]["missing"]) for k in FAULTS]
    assert [n["event"] for n in figures["notices"]][-1] == "finished"
    assert figures["verdict"]["first_broken"] == "no fault changed the bytes"
    kept = [line.split("kept: ", 1)[1] for line in r.stderr.splitlines() if line.startswith("kept: ")]
    assert len(kept) == 1 and (Path(kept[0]) / "step_000150.bin").is_file(), r.stderr[-2000:]  # --keep: the run
    for kind in FAULTS:
        assert f"| {kind} |" in r.stdout, r.stdout
    assert 0 < figures["goodput"]["goodput"] and "### Goodput" in r.stdout
    # the bench cleans up all but the work directory --keep keeps, the run in it
    assert [p for p in tmp_path.iterdir() if p.name.startswith("andrea-chaos-")] == [Path(kept[0]).parent]
