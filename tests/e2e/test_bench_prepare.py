"""bench/prepare.py runs end to end on a tiny corpus and prints its table (the figures themselves are the bench's)."""

import subprocess
import sys

from tests.runs import ROOT, env


def test_the_prepare_bench_prints_its_table_with_a_verdict():
    r = subprocess.run([sys.executable, "bench/prepare.py", "--sizes", "2", "--quick", "--preset", "andrea-tiny"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| corpus | prepare (s) | floor (s) | ratio |" in r.stdout and "| 2 MB |" in r.stdout
    assert "targets (ratio <= 1.5x, every peak RSS <= 2 GiB):" in r.stdout
