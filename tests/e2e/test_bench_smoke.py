"""Smoke test of the benchmarks: they run end to end and report every method; timings never decide pass/fail.

Runs `bench/checkpoint.py --synthetic-params 200000 --repeats 1 --json` as a subprocess (writes a few MB in a
temporary directory under pytest's tmp_path, and the JSON there), `bench/train.py` on the tiny preset (its
`--help` through its main() in process), bench/kernels.py's functions on tiny CPU shapes under the Triton
interpreter (its GPU-only entry point, main() in process, must refuse here), and the other benches at smoke sizes,
each bench process on one torch thread. Run: `pytest tests/e2e/test_bench_smoke.py`.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from andrea.config.load import load
from tests.runs import env

REPO = Path(__file__).resolve().parents[2]
MEASURED_HERE = ("andrea", "andrea buffered", "torch.save", "buffered write", "O_DIRECT write",
                 "memcpy")  # need nothing beyond torch and a disk (that takes O_DIRECT, as tmp_path's does)


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The bench as a subprocess on one torch thread (tests/runs.py's env: OMP_NUM_THREADS=1): nothing here reads
    a timing, and torch's idle threads spinning at every barrier of these tiny shapes cost more CPU than the
    work (bench/mixture.py: 24 s of CPU on its default threads, 7 s on one; the same losses either way)."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env())


def test_checkpoint_bench_reports_every_method(tmp_path):
    out = tmp_path / "ckpt.json"
    result = run_bench("bench/checkpoint.py", "--synthetic-params", "200000", "--repeats", "1",
                       "--device", "cpu", "--dir", str(tmp_path / "disk"), "--json", str(out))
    assert result.returncode == 0, result.stderr
    res = json.loads(out.read_text())
    assert res["n_params"] == 200_000 and res["payload_bytes"] == 12 * 200_000
    methods = res["methods"]
    assert set(methods) == {"andrea", "andrea buffered", "torch.save", "dcp.async_save", "buffered write",
                            "O_DIRECT write", "memcpy"}
    for name, m in methods.items():
        if name not in MEASURED_HERE and m["status"] != "ok":
            assert m["reason"], f"{name} skipped without a reason"  # DCP may be unavailable: it must say why
            continue
        assert m["status"] == "ok", (name, m)
        assert len(m["stall_s"]) == len(m["total_s"]) == 1, name
        assert all(s > 0 for s in m["stall_s"] + m["total_s"]), (name, m)
        assert m["bytes"] >= 12 * 200_000, (name, m["bytes"])
    assert len(methods["andrea"]["cpu_s"]) == len(methods["andrea buffered"]["cpu_s"]) == 1  # I/O-thread CPU
    assert res["cadence"]["status"] == "skipped" and res["cadence"]["reason"]  # a synthetic size has no model
    assert {t["verdict"] for t in res["targets"]} <= {"PASS", "MISS"}  # reported, never asserted
    assert "| andrea |" in result.stdout and "## Targets" in result.stdout
    assert list((tmp_path / "disk").iterdir()) == []  # the bench removes what it wrote


def test_train_bench_help(capsys):
    """Its parser, through its main() in this process: `--help` prints and exits 0 before anything runs."""
    with pytest.raises(SystemExit) as done:
        _load_bench("train").main(["--help"])
    assert done.value.code == 0
    stdout = capsys.readouterr().out
    assert "--include-120m-cpu" in stdout and "--json" in stdout


def test_train_bench_runs_both_loops_in_parity(tmp_path):
    """bench/train.py end to end on the tiny preset: both subjects timed on every step, and the same model, init and
    batches really are trained by both (the first losses agree to fp32 rounding, and after three AdamW updates the
    losses still agree: a subject training something else would drift by >1e-3)."""
    out = tmp_path / "train.json"
    result = run_bench("bench/train.py", "--presets", "andrea-tiny", "--warmup", "1", "--steps", "3",
                       "--batch-size", "2", "--threads", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = {r["subject"]: r for r in json.loads(out.read_text())["results"][0]["rows"]}
    assert set(rows) == {"andrea (torch)", "reference (torch.optim.AdamW)"}
    andrea, reference = rows["andrea (torch)"], rows["reference (torch.optim.AdamW)"]
    assert len(andrea["step_s"]) == len(reference["step_s"]) == 3 and len(andrea["warmup_s"]) == 1
    assert andrea["first_loss"] == pytest.approx(reference["first_loss"], rel=1e-6)
    assert andrea["last_loss"] == pytest.approx(reference["last_loss"], rel=1e-5)
    assert andrea["last_loss"] != andrea["first_loss"]  # the updates happened
    assert "| andrea-tiny | andrea (torch) | 2 x 64 |" in result.stdout
    assert re.search(r"^- andrea-tiny: \d+\.\d\dx -> (PASS|MISS)$", result.stdout, re.M)  # the verdict is printed


def _load_bench(name: str):
    """bench/<name>.py as a module, for its functions (and main(argv)) in this process."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_bench_runs_every_kernel_on_tiny_shapes():
    """bench/kernels.py's functions on a CPU under the interpreter: the rows the GPU run will print, computed by the
    same code, with each kernel's result checked against its baseline (max_err) on the way."""
    kb = _load_bench("kernels")
    cpu = torch.device("cpu")
    attention = kb.bench_attention([17], [16], cpu, kb.wall_timer, dtype=torch.float32, tokens=34, model_dim=32)
    assert {(r["impl"], r["pass"]) for r in attention} == {(i, p) for i in ("andrea", "sdpa-flash")
                                                           for p in ("fwd", "bwd")}
    assert all(r["B"] == 2 and r["H"] == 2 and r["max_err"] < 1e-5 for r in attention)  # fp32: ~1e-7 apart
    adamw = kb.bench_adamw([1000], peak_gbs=1.0, device=cpu, timer=kb.wall_timer)
    assert [r["impl"] for r in adamw] == ["andrea adamw_step", "andrea adamw_step +mask +clip",
                                          "torch AdamW(fused=True)"]
    ce = kb.bench_cross_entropy([(5, 300)], cpu, kb.wall_timer, dtype=torch.float16)
    assert [r["impl"] for r in ce] == ["andrea fused", "torch F.cross_entropy(fp32 copy)"]
    assert all(r["max_err"] < 1e-5 and r["extra_mib"] is None for r in ce)  # same fp16 logits, fp32 math
    ln = kb.bench_layer_norm([(7, 100)], cpu, kb.wall_timer)
    assert [r["impl"] for r in ln] == ["andrea fused", "torch F.layer_norm"] and ln[0]["max_err"] < 1e-5
    rms = kb.bench_rms_norm([(7, 100, "fp32")], cpu, kb.wall_timer)
    assert [r["impl"] for r in rms] == ["andrea fused", "torch F.rms_norm", "torch eager reference"]
    assert all(r["max_err"] < 1e-5 for r in rms)  # fp32 math on both sides: a few ulps apart
    rotary = kb.bench_rotary([(1, 2, 17, 16)], cpu, kb.wall_timer, dtype=torch.float32)
    assert [r["impl"] for r in rotary] == ["andrea fused", "torch eager reference"]
    assert all(r["max_err"] < 1e-6 for r in rotary)
    muon = kb.bench_muon([1000], cpu, kb.wall_timer)
    assert [r["impl"] for r in muon] == ["andrea fused", "torch references"] and muon[0]["max_err"] < 1e-6
    for row in attention + adamw + ce + ln + rms + rotary + muon:
        assert row["ms"] > 0 and all(v is not None for k, v in row.items() if k != "extra_mib"), row
    table = kb.markdown(ce, ["N", "V", "impl", "ms", "gbs", "extra_mib", "max_err"])
    assert table.count("\n") == 3 and "| 5 | 300 | andrea fused |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole benchmark")
def test_kernel_bench_refuses_without_a_gpu(capsys):
    """Its main() with no arguments (`python bench/kernels.py`), in this process: the refusal is its first act."""
    rc = _load_bench("kernels").main([])
    captured = capsys.readouterr()
    assert rc == 2 and "no CUDA GPU" in captured.err and captured.out == ""


def test_audit_bench_times_both_variants_and_the_in_process_audit(prepared, tmp_path):
    """bench/audit.py on the tiny preset, from the session's prepared run: the end-to-end table (with and without
    an audit per step) and the in-process comparison of the cached and uncached paths are printed."""
    result = run_bench("bench/audit.py", "--preset", "andrea-tiny", "--steps", "2", "--repeats", "1",
                       "--micro-repeats", "1", "--threads", "1", "--prepared", str(prepared),
                       "--dir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| median step interval, an audit at every step |" in result.stdout
    assert re.search(r"audit cost = \*\*-?\d+\.\d{3}\*\* of a training step", result.stdout), result.stdout
    assert re.search(r"speed-up \d+\.\dx", result.stdout), result.stdout
    assert list(tmp_path.iterdir()) == []  # its temporary run directories are removed


def test_zero_dist_bench_reports_the_share_of_a_step_in_collectives():
    result = run_bench("bench/zero_dist.py", "--preset", "andrea-tiny", "--ranks", "2", "--steps", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| 1 process |" in result.stdout
    assert re.search(r"^\| 2 ranks \| \d+\.\d{4} \| \d+\.\d{4} \| \d+\.\d % \|$", result.stdout, re.M), result.stdout


def test_mixture_bench_compares_each_policy_with_uniform(tmp_path):
    """bench/mixture.py at a smoke size: each policy's final held-out target loss against uniform's, per arm set."""
    out = tmp_path / "mixture.json"
    result = run_bench("bench/mixture.py", "--steps", "20", "--eval-every", "10", "--seeds", "1",
                       "--max-bytes", "40000", "--sets", "noise", "--policies", "default", "--json", str(out),
                       timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())["noise"]
    assert set(runs) == {"default", "uniform"}  # uniform is always added: it is the reference
    for kind, seeds in runs.items():
        [evals] = seeds
        assert [e["step"] for e in evals] == [10, 20] and all(e["target_loss"] > 0 for e in evals), (kind, evals)
    assert "| default |" in result.stdout and "| uniform |" in result.stdout and "vs uniform" in result.stdout


def test_verify_tokens_bench_prints_its_cost_per_gb(tmp_path):
    result = run_bench("bench/verify_tokens.py", "--gb", "0.01", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert re.search(r"token_digest of 0\.01 GB \((cold|warm) page cache\): [\d.]+ s, [\d.]+ s per GB", result.stdout)
    assert not list(tmp_path.iterdir())  # its file is removed


def test_anytime_bench_quick_prints_an_anneal_a_cosine_and_an_average_at_each_point():
    """bench/anytime.py --quick: one row per point (12 steps: 5, 10 and the run's end), each with four distinct
    held-out losses where the anneal has more than one step (an anneal, a cosine, a tail average that all equal
    the plateau's would mean one of them never ran)."""
    result = run_bench("bench/anytime.py", "--quick", "--jobs", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \(anneal from (\d+)\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      result.stdout, re.M)
    assert [(int(p), int(s)) for p, s, *_ in rows] == [(5, 4), (10, 8), (12, 10)]
    for _, _, *losses in rows[1:]:
        assert len(set(losses)) == 4, losses


def test_recipe_bench_quick_prints_the_sweeps_and_the_anchors(tmp_path):
    """bench/recipe.py --quick: every subject swept on the same batches, its best row with the held-out loss and the
    steps to nanoGPT's final loss, and the anchors' figures printed as measured elsewhere."""
    out = tmp_path / "recipe.json"
    result = run_bench("bench/recipe.py", "--quick", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["sweeps"]) == ["gpt2+AdamW", "modern+Muon", "modern+NorMuon", "modern+NorMuon, wsd",
                                   "modern+NorMuon+ve+smear"]  # andrea's best: the modern presets' parts
    assert all(len(runs) == 2 and runs[0]["curve"][0][0] == 0 for runs in res["sweeps"].values())
    assert "| andrea, modern+NorMuon | muon_lr 0.02, 0.04 | " in result.stdout
    assert re.search(r"^\| \*\*nanochat\*\* .*measured elsewhere\) \| \| \| \| 3\.712 \| 49 \|$", result.stdout, re.M)
    for preset in ("andrea-12m-modern", "andrea-120m-modern"):  # the presets' lrs, beside the sweep's best
        tc = load(preset=preset).train
        assert re.search(rf"^\| {preset} \| {tc.optimizer} \| {tc.muon_lr:g} \| ", result.stdout, re.M), preset


def test_clip_bench_quick_prints_a_row_per_clip_with_the_gradient_norms():
    """bench/clip.py --quick: one row per grad_clip value, each with its held-out loss and the pre-clip norms; a
    clip that binds on every step (0.05 here, below every norm) changes the loss, one that never binds does not."""
    result = run_bench("bench/clip.py", "--quick", "--clips", "0,100,0.05", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line
            and "grad_clip" not in line]
    assert [float(r[0]) for r in rows] == [0.0, 100.0, 0.05]
    off, loose, tight = (float(r[1]) for r in rows)
    assert off == loose != tight  # clipping at 100 never binds: the same bytes; at 0.05 every step is cut
    assert all(int(r[6]) >= 0 and " of " in r[7] for r in rows)


def test_recipe_bench_ablation_runs_a_subject_with_model_extras_against_the_plain_one(tmp_path):
    """bench/recipe.py's "<subject>+<extra>" subjects: the extra reaches the model (another loss on the same tokens),
    and the ablation table gives its change against the plain subject run alongside, and its relative step cost;
    --until stops the runs early."""
    out = tmp_path / "recipe.json"
    result = run_bench("bench/recipe.py", "--quick", "--only", "modern+NorMuon", "modern+NorMuon+softcap+relu2",
                       "--grid", "modern+NorMuon=0.04", "--grid", "modern+NorMuon+softcap+relu2=0.04",
                       "--until", "8", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sweeps = json.loads(out.read_text())["sweeps"]
    plain, extra = sweeps["modern+NorMuon"][0]["final"], sweeps["modern+NorMuon+softcap+relu2"][0]["final"]
    assert plain != extra
    row = re.search(r"^\| softcap\+relu2 \| 0\.04 \| ([\d.]+) \| ([+-][\d.]+) \| \S+ \| ([\d.]+)× \|$", result.stdout,
                    re.M)
    assert row and abs(float(row[2]) - (round(extra, 3) - round(plain, 3))) < 1.5e-3, result.stdout
    # --until 8: the runs stop there (of quick's 12 steps), the table says so
    assert [run["curve"][-1][0] for runs in sweeps.values() for run in runs] == [8, 8]
    assert "| extras | muon_lr | held-out loss at step 8 |" in result.stdout
