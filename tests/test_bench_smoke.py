"""Smoke test of the benchmarks: they run end to end and report every method; timings never decide pass/fail.

Runs `bench/checkpoint.py --synthetic-params 200000 --repeats 1 --json` as a subprocess (writes a few MB in a
temporary directory under pytest's tmp_path, and the JSON there) and `bench/train.py --help`. About 10 s on
2 CPU cores. Run: `pytest tests/test_bench_smoke.py`.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURED_HERE = ("andrea", "torch.save", "raw write", "memcpy")  # need nothing beyond torch and a disk


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_checkpoint_bench_reports_every_method(tmp_path):
    out = tmp_path / "ckpt.json"
    result = run_bench("bench/checkpoint.py", "--synthetic-params", "200000", "--repeats", "1",
                       "--device", "cpu", "--dir", str(tmp_path / "disk"), "--json", str(out))
    assert result.returncode == 0, result.stderr
    res = json.loads(out.read_text())
    assert res["n_params"] == 200_000 and res["payload_bytes"] == 12 * 200_000
    methods = res["methods"]
    assert set(methods) == {"andrea", "torch.save", "dcp.async_save", "raw write", "memcpy"}
    for name, m in methods.items():
        if name not in MEASURED_HERE and m["status"] != "ok":
            assert m["reason"], f"{name} skipped without a reason"  # DCP may be unavailable: it must say why
            continue
        assert m["status"] == "ok", (name, m)
        assert len(m["stall_s"]) == len(m["total_s"]) == 1, name
        assert all(s > 0 for s in m["stall_s"] + m["total_s"]), (name, m)
        assert m["bytes"] >= 12 * 200_000, (name, m["bytes"])
    assert res["cadence"]["status"] == "skipped" and res["cadence"]["reason"]  # a synthetic size has no model
    assert {t["verdict"] for t in res["targets"]} <= {"PASS", "MISS"}  # reported, never asserted
    assert "| andrea |" in result.stdout and "## Targets" in result.stdout
    assert list((tmp_path / "disk").iterdir()) == []  # the bench removes what it wrote


def test_train_bench_help():
    result = run_bench("bench/train.py", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--include-120m-cpu" in result.stdout and "--json" in result.stdout
