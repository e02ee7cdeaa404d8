"""Every subcommand refuses a missing path, or a directory that is not a run, in one `andrea: error:` line that
names the path, with a non-zero exit, and writes nothing (the directory and its file unchanged, no output made).

The subcommands come from the real parser (cli.build_parser()). CALLS says how to call each one with a bad path
in each argument that must name an existing run, file or directory; a subcommand without a row fails
test_every_subcommand_has_a_row_of_bad_path_calls until its row is added, so a new command cannot slip past.
Calls run in-process through cli.main() (milliseconds); those that would start training on a regression run in a
subprocess. Also here: the pure rules behind it (inspect.run_dir_problem, inspect.run_state) and `status` of a run that
has not reached its first step, which answers with its state instead of refusing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from andrea import cli
from andrea.config import load as configload
from andrea.rundir import inspect
from andrea.rundir.runlock import RunLock
from tests.runs import TINY, andrea

BAD = "{bad}"  # the bad path: "missing" (nothing there) or "nonrun" (a directory holding one unrelated file)
READ = "cannot read config"  # a directory given as a TOML file


@dataclass(frozen=True)
class Call:
    """One way to call a subcommand with the bad path in one argument.

    argv's placeholders: {bad}; {run} a run directory holding only run.toml (prepared, never trained);
    {out} a scratch directory for outputs that must not appear; {policy} a valid policy file."""

    argv: tuple[str, ...]
    kinds: tuple[str, ...] = ("missing", "nonrun")  # which bad paths the argument must refuse
    subprocess: bool = False  # True for commands that would train (or prepare data) if the check regressed
    nonrun: str = "not a run directory"  # what the line must say of the non-run directory (any case)
    missing: str = "no such"  # ... and of the missing path


CALLS: dict[str, list[Call]] = {
    # --run-dir itself is no case: absent, or any directory, is where a new run starts.
    "train": [Call(("train", *TINY, "--run-dir", "{out}/run", "--init-from", BAD), subprocess=True,
                   nonrun="no model.safetensors"),
              Call(("train", *TINY, "--run-dir", "{out}/run", "--config", BAD), subprocess=True, nonrun=READ)],
    "info": [Call(("info", "--config", BAD), nonrun=READ)],
    "verify": [Call(("verify", BAD), nonrun="no step_NNNNNN.bin checkpoints")],
    "sample": [Call(("sample", BAD, "--prompt", "x"))],
    "export": [Call(("export", BAD, "--out", "{out}/export"))],
    # The run is checked before the tasks file is read: here the tasks path is never opened.
    "eval": [Call(("eval", BAD, "--tasks", "{out}/tasks.jsonl")),
             Call(("eval", "{run}", "--tasks", BAD), nonrun="is a directory")],
    "ctl": [Call(("ctl", BAD, action)) for action in ("status", "checkpoint", "stop")],
    "status": [Call(("status", BAD))],
    "pivot": [Call(("pivot", BAD, "--policy", "{policy}")), Call(("pivot", "{run}", "--policy", BAD), nonrun=READ)],
    "branch": [Call(("branch", BAD, "--step", "0", "--to", "{out}/branch")),
               Call(("branch", "{run}", "--step", "0", "--to", "{out}/branch", "--config", BAD), nonrun=READ),
               Call(("branch", "{run}", "--step", "0", "--to", BAD), kinds=("nonrun",),  # absent --to: made
                    nonrun="not an empty directory")],
    "compare": [Call(("compare", BAD, "{run}")), Call(("compare", "{run}", BAD)),
                Call(("compare", BAD, "{run}", "--out", "{out}/compare.png"))],
    "plot": [Call(("plot", BAD, "--out", "{out}/loss.png"))],
    # --run-dir as for train: where the data is prepared (absent, or any directory).
    # REPLICA: a plain path that is not there / not a replica; --run-dir: a directory that is not empty.
    "restore": [Call(("restore", BAD, "--run-dir", "{out}/restored"), nonrun="not an andrea replica"),
                Call(("restore", "{run}", "--run-dir", BAD), kinds=("nonrun",), nonrun="not empty")],
    "prepare": [Call(("prepare", *TINY, "--run-dir", "{out}/run", "--config", BAD), subprocess=True, nonrun=READ)],
}


def subcommands() -> list[str]:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


def cases() -> list[tuple[str, int, str]]:
    return [(command, i, kind) for command in subcommands() if command in CALLS
            for i, call in enumerate(CALLS[command]) for kind in call.kinds]


def test_every_subcommand_has_a_row_of_bad_path_calls():
    missing = sorted(set(subcommands()) - set(CALLS))
    assert not missing, (f"subcommand(s) {missing} have no row in tests/e2e/test_cli_errors.py CALLS: add how to call "
                         "each with a missing path / a non-run directory in every argument that must exist")


def test_every_row_names_a_subcommand_of_the_parser():
    stale = sorted(set(CALLS) - set(subcommands()))
    assert not stale, f"CALLS rows for subcommands the parser does not have: {stale}"


def tree(root: Path) -> dict[str, str]:
    """Every file (sha256) and directory under root: what "nothing written" compares."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def scratch(tmp_path) -> dict[str, Path]:
    nonrun = tmp_path / "nonrun"
    nonrun.mkdir()
    (nonrun / "notes.txt").write_text("not a run\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.toml").write_text(configload.load(preset="andrea-tiny").to_toml())
    (tmp_path / "out").mkdir()
    policy = tmp_path / "policy.toml"
    policy.write_text('[policy]\ncaps = {}\nfloors = {}\n')
    return {"missing": tmp_path / "missing", "nonrun": nonrun, "run": run, "out": tmp_path / "out",
            "policy": policy}


def call_cli(argv: list[str], in_subprocess: bool, capsys) -> tuple[int, str]:
    if in_subprocess:
        result = andrea(*argv, timeout=120)
        return result.returncode, result.stderr
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse refusing the call itself: the row is wrong, and says so below
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("command,index,kind", cases())
def test_a_bad_path_is_one_error_line_naming_it_and_nothing_is_written(command, index, kind, scratch, tmp_path,
                                                                       capsys):
    call = CALLS[command][index]
    bad = scratch[kind]
    argv = [a.format(bad=bad, **{k: v for k, v in scratch.items() if k not in ("missing", "nonrun")})
            for a in call.argv]
    before = tree(tmp_path)
    rc, err = call_cli(argv, call.subprocess, capsys)
    errors = [line for line in err.splitlines() if line.startswith("andrea: error: ")]
    assert rc not in (0, None), f"{argv}: exit {rc}\n{err[-2000:]}"
    assert "Traceback" not in err and "usage:" not in err, f"{argv}:\n{err[-3000:]}"
    assert len(errors) == 1, f"{argv}: {len(errors)} error lines:\n{err[-2000:]}"
    assert str(bad) in errors[0], f"{argv}: the line does not name {bad.name}: {errors[0]}"
    words = getattr(call, kind)
    assert words.lower() in errors[0].lower(), f"{argv}: {words!r} not in the line: {errors[0]}"
    assert tree(tmp_path) == before, f"{argv}: wrote or changed something"


# --- the rules, as plain functions ----------------------------------------------------------------------------
def test_run_dir_problem_tells_missing_file_and_foreign_directory_from_a_run(tmp_path):
    assert inspect.run_dir_problem(tmp_path / "nope") == "no such directory"
    (tmp_path / "f").write_text("x")
    assert inspect.run_dir_problem(tmp_path / "f") == "not a directory"
    assert inspect.run_dir_problem(tmp_path).startswith("not a run directory")
    for marker in ("run.toml", ".loss.json", "tokenizer.json", "step_000010.bin"):
        d = tmp_path / marker.replace(".", "_")
        d.mkdir()
        (d / marker).write_text("")
        assert inspect.run_dir_problem(d) is None, marker


def test_a_directory_whose_trainer_holds_the_lock_is_a_run_before_it_wrote_anything_else(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()  # what a first start holds while it prepares the data
    try:
        assert inspect.run_dir_problem(tmp_path) is None
        assert inspect.status(tmp_path)["state"] == "starting"
    finally:
        lock.release()
    assert inspect.run_dir_problem(tmp_path) is not None  # a stale train.lock alone is no run


@pytest.mark.parametrize("running,step,n_checkpoints,prepared,state", [
    (True, None, 0, False, "starting"), (True, None, 2, True, "starting"), (True, 5, 1, True, "training"),
    (False, None, 0, True, "prepared"), (False, None, 0, False, "empty"), (False, 5, 0, True, "stopped"),
    (False, None, 1, True, "stopped")])
def test_run_state(running, step, n_checkpoints, prepared, state):
    assert inspect.run_state(running, step, n_checkpoints, prepared) == state


# --- status before the first step answers ---------------------------------------------------------------------
@pytest.mark.parametrize("how", [["status"], ["ctl", "status"]])
def test_status_of_a_run_that_has_not_reached_its_first_step_answers_with_its_state(how, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    argv = [how[0], str(run), *how[1:], "--json"]
    assert cli.main(argv) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "prepared" and st["step"] is None and st["loss_ema"] is None and not st["running"]
    (run / "run.toml").write_text(configload.load(preset="andrea-tiny").to_toml())
    (run / ".loss.json").write_text('{"event": "start", "step": 0, "time": 0}\n')
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "prepared"
    shutil.rmtree(run / "data")
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "empty"


def test_ctl_status_and_status_print_one_report(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / ".loss.json").write_text('{"step": 1, "loss": 4.0, "time": 0}\n')
    assert cli.main(["status", str(tmp_path), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(["ctl", str(tmp_path), "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plain
    assert plain["state"] == "stopped" and plain["step"] == 1 and plain["loss_ema"] == 4.0


@pytest.mark.parametrize("out,words,rc", [("loss.pgn", ".pgn is not a figure format", 2),
                                          ("loss", "no file suffix", 2),
                                          ("nodir/loss.png", "no such directory", 1)])
def test_plot_refuses_an_out_it_cannot_write_before_reading_the_run(out, words, rc, tmp_path, capsys):
    (tmp_path / ".loss.json").write_text('{"step": 1, "loss": 4.0, "time": 0}\n')
    before = tree(tmp_path)
    capsys.readouterr()
    assert cli.main(["plot", str(tmp_path), "--out", str(tmp_path / out)]) == rc
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"andrea: error: {tmp_path / out}: ") and words in line, line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_plot_and_compare_of_a_run_without_a_step_say_so(command, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.toml").write_text("")
    argv = [command, str(run), *(["--out", str(tmp_path / "x.png")] if command == "plot" else [str(run)])]
    capsys.readouterr()
    assert cli.main(argv) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"andrea: error: {run}: no training step in .loss.json yet: nothing to {command}", line
    assert not (tmp_path / "x.png").exists()


def no_cuda() -> bool:
    import torch
    return not torch.cuda.is_available()


@pytest.mark.parametrize("flags, words", [
    (("--device", "cpu", "--kernels", "triton"), "train.kernels=triton on a CPU"),
    pytest.param(("--device", "cuda"), "train.device=cuda but",
                 marks=pytest.mark.skipif(not no_cuda(), reason="this machine has a CUDA GPU: cuda runs here")),
])
def test_a_device_or_kernels_this_machine_cannot_run_is_refused_before_the_run_directory_exists(flags, words,
                                                                                                tmp_path):
    run = tmp_path / "run"
    result = andrea("train", *TINY, "--run-dir", str(run), "--steps", "1", *flags,
                    extra_env={"TRITON_INTERPRET": "0"})  # Triton's CPU interpreter is asked for by this variable only
    assert result.returncode == 2, result.stderr  # configuration (README: exit 2)
    [line] = result.stderr.splitlines()
    assert line.startswith("andrea: error: ") and words in line, line
    assert not run.exists() and result.stdout == ""  # refused before anything was written
