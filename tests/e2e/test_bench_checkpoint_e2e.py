"""Smoke test of bench/checkpoint_e2e.py: real trainer processes with and without a cadence, counted and reported.

On the tiny preset from the session's prepared run directory (4 steps, cadence 2, one repetition: about 15 s on
2 cores). Timings are printed, never asserted; what is checked is that the runs happened as configured.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_end_to_end_bench_runs_both_cadences_and_counts_their_checkpoints(prepared, tmp_path):
    out = tmp_path / "e2e.json"
    result = subprocess.run([sys.executable, "bench/checkpoint_e2e.py", "--preset", "andrea-tiny", "--steps", "4",
                             "--cadences", "2", "--repeats", "1", "--prepared", str(prepared),
                             "--dir", str(tmp_path / "disk"), "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = {r["every"]: r for r in res["runs"]}
    assert runs[2]["checkpoints"] == 2 and runs[10 ** 9]["checkpoints"] == 1  # steps 2, 4 / the final step only
    assert res["summary"]["all_direct"], "tmp_path's disk takes O_DIRECT: every commit should have used it"
    assert "Smallest cadence within 1 % wall overhead" in result.stdout and "| 2 | 2 |" in result.stdout
    assert list((tmp_path / "disk").iterdir()) == []  # the bench removes what it wrote
