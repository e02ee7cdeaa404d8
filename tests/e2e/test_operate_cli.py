"""`andrea status`: a short human view by default, the whole report behind --json, and a reader that closes the
pipe early (`status | head -1`) ends it quietly; `andrea compare` writes its picture without --out, to
compare.png in the working directory (commands/operate.py, cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.runs import ROOT, andrea_here, env


def small_run(root):
    (root / "tokenizer.json").write_text("{}")
    (root / "run.toml").write_text("[train]\nsteps = 100\n")
    lines = [{"event": "start", "step": 0, "time": 0.0}]
    lines += [{"step": s, "loss": 5.0 - s / 100, "tokens": s * 512, "time": 10.0 + 2 * s} for s in range(1, 11)]
    (root / ".loss.json").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return root


def test_status_is_a_human_view_and_json_the_whole_report(tmp_path):
    run = small_run(tmp_path)
    human = andrea_here("status", str(run))
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines()[0] == f"{run}: stopped (not running)"
    assert "step      10 of 100 (10.0 %)" in human.stdout and "2 s/step" in human.stdout
    assert "00:03:00 to the target at this pace" in human.stdout and "{" not in human.stdout
    report = json.loads(andrea_here("status", str(run), "--json").stdout)
    assert report["pace"]["seconds_per_step"] == 2.0 and report["pace"]["eta_s"] == 180.0
    assert report["pace"]["loss"] == 4.9 and report["pace"]["tokens"] == 5120


def test_a_closed_pipe_ends_status_quietly(tmp_path):
    run = small_run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "andrea", "status", str(run), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env(), cwd=ROOT)
    proc.stdout.close()  # the reader is gone before the first byte is written (as `head -1` is after one line)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_compare_without_out_writes_compare_png_in_the_working_directory(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        run.mkdir()
        small_run(run)
    monkeypatch.chdir(tmp_path)
    result = andrea_here("compare", str(a), str(b))
    assert result.returncode == 0, result.stderr
    assert "wrote compare.png" in result.stdout
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
