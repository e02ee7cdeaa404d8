"""bench/gpu_check.sh on a CPU: its plan and budget arithmetic, and its choreography in self-test mode.

The GPU run happens once, on a lent machine, with no second try; what can go wrong without a GPU is proven here.
GPU_CHECK_DRY=1 prints the plan, whose caps must sum to the 570 s budget. GPU_CHECK_SELFTEST=1 runs every part's
real program on tiny shapes and steps (andrea-tiny on the CPU, the Triton interpreter, torch.compile's eager
backend): each must run, and its result must land in the one results directory under $OUT. A second self-test
replaces one part by a process that never ends (GPU_CHECK_SELFTEST_HANG): it must be cut at its cap, killed with
its children, reported as cut, and the part after it must still run.

Both self-tests start together (a module fixture) and each test waits for its own: the hung one mostly sleeps.
No assertion reads a timing; the cut is decided by the script's `timeout`, observed through its exit code.
Everything is written under pytest's tmp_path ($OUT and GPU_CHECK_WORK point there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.runs import ROOT, env

PARTS = ["env", "kernels", "train", "kernels_bench", "ckpt120", "peer", "modern", "report"]
TRAIN_CHECKS = {"ready", "usr1_checkpoint", "usr1_keeps_training", "sigterm_exit_0", "checkpoint_at_last_step",
                "verify", "resume_exit_0", "resume_bit_exact"}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def script(extra: dict, out: Path | None = None, **kw) -> subprocess.Popen:
    e = {**env(), "GPU_CHECK_PYTHON": sys.executable, **extra}
    if out is not None:
        e.update(OUT=str(out), GPU_CHECK_WORK=str(out.parent / "work"))
    return subprocess.Popen(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


def results(out: Path) -> tuple[dict, dict[str, dict], tarfile.TarFile]:
    res = out / "gpu_check"
    summary = json.loads((res / "summary.json").read_text())
    return summary, {p["part"]: p for p in summary["parts"]}, tarfile.open(res / "logs.tar.gz")


@pytest.fixture(scope="module")
def selftests(tmp_path_factory):
    """Both self-tests, started at once: the full one and the one with a hung part."""
    full, hung = (tmp_path_factory.mktemp(name) / "out" for name in ("full", "hung"))
    procs = {"full": (script({"GPU_CHECK_SELFTEST": "1"}, full), full),
             "hung": (script({"GPU_CHECK_SELFTEST": "1", "GPU_CHECK_PARTS": "kernels_bench,ckpt120",
                              "GPU_CHECK_SELFTEST_HANG": "kernels_bench", "GPU_CHECK_CAP_kernels_bench": "2"},
                             hung), hung)}
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def dry_plan(extra: dict | None = None) -> tuple[list[tuple[str, int]], str]:
    proc = script({"GPU_CHECK_DRY": "1", **(extra or {})})
    rc, stdout, stderr = finish(proc)
    assert rc == 0, stderr
    rows = [line.split() for line in stdout.splitlines()[1:]]
    return [(r[0], int(r[1])) for r in rows if r[0] != "sum"], stdout


def test_the_plan_orders_the_parts_and_their_caps_sum_to_the_budget():
    plan, stdout = dry_plan()
    assert [name for name, _ in plan] == PARTS
    assert sum(cap for _, cap in plan) == 570
    assert "sum               570  == budget 570 s" in stdout
    overridden, stdout = dry_plan({"GPU_CHECK_CAP_peer": "200"})
    assert dict(overridden)["peer"] == 200 and "!= budget 570 s" in stdout  # an override is never silent


@pytest.mark.gpu_offline
def test_the_selftest_runs_every_part_into_one_results_directory(selftests):
    """Each part's program (pytest tests/unit/kernels, bench/gpu_train.py, bench/kernels.py, bench/checkpoint.py,
    bench/peer.py, bench/gpu_report.py) ran on the CPU and its results are in the one results directory."""
    proc, out = selftests["full"]
    rc, stdout, stderr = finish(proc)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert os.listdir(out) == ["gpu_check"]  # one results directory, three files (the device returns 8 at most)
    assert sorted(os.listdir(out / "gpu_check")) == ["logs.tar.gz", "summary.json", "summary.md"]
    assert list((out.parent / "work").iterdir()) == []  # the scratch runs are removed
    summary, parts, tar = results(out)
    assert summary["selftest"] and summary["budget_s"] == summary["caps_sum_s"] == 570
    assert [p["part"] for p in summary["plan"]] == PARTS and dict(dry_plan()[0]) == {
        p["part"]: p["cap_s"] for p in summary["plan"]}  # the run follows the plan DRY prints
    assert list(parts) == PARTS[:-1] and all(p["status"] == "ok" and p["rc"] == 0 for p in parts.values()), parts

    assert parts["env"]["result"]["python"] and not parts["env"]["result"]["cuda"]
    kernels = parts["kernels"]["result"]  # pytest's JUnit XML: the command line ran the kernel tests
    assert kernels["passed"] >= 1 and kernels["failures"] == kernels["errors"] == 0
    [train] = parts["train"]["result"]["results"]
    assert set(train["checks"]) == TRAIN_CHECKS and all(train["checks"].values()), train
    assert train["resume_to"] == train["stop_step"] + 10 and train["window"]["to_step"] > train["window"]["from_step"]
    assert train["tokens_per_s"] > 0 and train["peak_bytes"] > 0 and train["estimate_bytes"] > 0
    bench = parts["kernels_bench"]["result"]
    assert {r["impl"] for r in bench["attention"]} == {"andrea", "sdpa-flash"} and len(bench["adamw"]) == 3
    assert [r["impl"] for r in bench["rms_norm"]] == ["andrea fused", "torch F.rms_norm", "torch eager reference"]
    assert len(bench["rotary"]) == 2 and len(bench["muon"]) == 2  # the modern recipe's kernels and their baselines
    assert "cross_entropy" not in bench and "layer_norm" not in bench  # --only leaves them out
    methods = parts["ckpt120"]["result"]["methods"]
    assert {m for m, r in methods.items() if r["status"] == "ok"} == {"andrea", "memcpy", "O_DIRECT write"}
    [peer] = parts["peer"]["result"]["results"]
    assert peer["andrea_train_tokens_per_s"] == train["tokens_per_s"]  # part 2's real-loop figure, side by side
    for side in ("andrea", "peer"):
        assert peer["sides"][side]["tokens_per_s"] > 0 and peer["sides"][side]["profile"]["categories"]
    assert (peer["peer_over_andrea"] > 1) == bool(peer["gap"])  # the gap is named exactly when the peer is faster
    [modern] = parts["modern"]["result"]["results"]  # the same checks through NorMuon, value embeddings and smear
    assert set(modern["checks"]) == TRAIN_CHECKS and all(modern["checks"].values()), modern
    assert modern["resume_to"] == modern["stop_step"] + 10 and modern["tokens_per_s"] > 0
    assert modern["n_params"] > train["n_params"]  # the value embeddings' tables: the overrides reached the runs
    from andrea.config.load import load
    from andrea.control.observe.mfu import model_flops_per_token
    overridden = load(preset="andrea-tiny", overrides=[
        'model.arch="modern"', "model.value_embeds=true", "model.smear=true", 'train.optimizer="normuon"']).model
    assert modern["flops_per_token"] == model_flops_per_token(overridden, modern["n_params"]) != \
        model_flops_per_token(load(preset="andrea-tiny").model, modern["n_params"])  # MFU counts the model that ran

    names = set(tar.getnames())
    assert {f"logs/{p}.log" for p in PARTS[:-1]} <= names and {f"parts/{p}.status" for p in PARTS[:-1]} <= names
    assert {f"logs/{part}/andrea-tiny_{run}.log" for run in ("prepare", "live", "resume", "straight")
            for part in ("train", "modern")} <= names
    md = (out / "gpu_check" / "summary.md").read_text()
    assert all(f"| {p} |" in md for p in PARTS[:-1]) and "| andrea-tiny |" in md


@pytest.mark.gpu_offline
def test_a_part_over_its_cap_is_cut_reported_and_the_next_part_still_runs(selftests):
    proc, out = selftests["hung"]
    rc, stdout, stderr = finish(proc)
    assert rc == 1, stdout[-3000:] + stderr[-3000:]
    summary, parts, tar = results(out)
    assert list(parts) == ["env", "kernels_bench", "ckpt120"]  # GPU_CHECK_PARTS; env and report always run
    cut = parts["kernels_bench"]
    assert cut["status"] == "timeout" and cut["rc"] in (124, 137) and cut["cap_s"] == 2
    assert "cut at its cap" in cut["note"] and cut["result"] is None
    assert parts["ckpt120"]["status"] == "ok" and parts["ckpt120"]["result"]["methods"]["andrea"]["status"] == "ok"
    assert summary["caps_sum_s"] != summary["budget_s"] and not summary["ok"]
    assert "| kernels_bench |" in stdout and "cut at its cap" in stdout  # the report printed at the end says so
    assert "kernels_bench: CUT at its cap of 2 s" in stderr
    pid = int(tar.extractfile("logs/hang.pid").read())  # the hung part's child: killed with its process group
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        cmdline = b""
    assert b"sleep\x003600" not in cmdline, f"the hung part's child {pid} outlived its cap"
