"""Bad inputs: every corrupt or impossible input gives a one-line error naming the file and the field with a
non-zero exit and leaves the run directory byte-for-byte unchanged — or takes the documented fallback to the
previous valid checkpoint, asserted exactly (which checkpoint, and that the redone one equals the original).

All cases start from a copy of one trained run (checkpoints 10..70 with their state files, run.toml, sidecars).
The trainers run two at a time in a module fixture; each test below asserts one case. Every case's exit code and
message goes into the fault table.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from andrea.rundir import checkpoint as ckpt, names, sidecars
from andrea.rundir.ledger import read_ledger
from tests.faults.harness import REPORT, digest_diff, first_line_with, last_error_line
from tests.runs import ROOT, andrea_here, seed_data, train, tree_digest

STEP20, STEP70 = names.checkpoint_name(20), names.checkpoint_name(70)


# --- corruptions of one checkpoint file ------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_step(path: Path) -> None:
    data = bytearray(path.read_bytes())
    step, n = ckpt.HEADER.unpack(data[:8])
    data[:8] = ckpt.header(step + 1, n)
    path.write_bytes(bytes(data))


def _other_model(path: Path) -> None:
    step, n = ckpt.HEADER.unpack(path.read_bytes()[:8])
    other = n - 64  # a consistent file (size 8 + 12·n') of a smaller model
    payload = np.fromfile(path, dtype="<f4", offset=8, count=3 * other)
    path.write_bytes(ckpt.header(step, other) + payload.tobytes())


def _poke_weight(value: float) -> Callable[[Path], None]:
    def poke(path: Path) -> None:
        data = np.fromfile(path, dtype="<f4", offset=8)
        data[123] = value
        path.write_bytes(path.read_bytes()[:8] + data.tobytes())
    return poke


def _zeros(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


CORRUPTIONS = {  # kind -> (corrupt, words the message must contain)
    "truncated": (_truncate, ["truncated"]),
    "header-step-disagrees-with-name": (_header_step, ["header step", "file name"]),
    "n_params-of-another-model": (_other_model, ["n_params"]),
    "nan-in-weights": (_poke_weight(float("nan")), ["weights[123]", "not finite"]),
    "inf-in-weights": (_poke_weight(float("inf")), ["weights[123]", "not finite"]),
    "all-zeros": (_zeros, ["n_params=0"]),
}


@dataclass
class Case:
    name: str
    prepare: Callable[[Path, Path], list[str]]  # (run_dir, scratch) -> extra train args
    rc: int  # expected exit code (0: a documented fallback)
    words: list[str]  # the message must contain each
    steps: int = 70  # the run copied holds checkpoints 10..70: --steps 70 resumes at 70 and stops there
    fallback: str = ""  # for rc 0: what the fallback is, in words
    not_words: tuple[str, ...] = ()  # the message must not contain any (e.g. blame the wrong file)
    result: dict = field(default_factory=dict)


# One run holds checkpoints 10..70; the six newest are corrupted one kind each, so one start must skip all six
# with a warning apiece, resume from step 10 and redo step 70 byte-identically.
FALLBACK_STEPS = {kind: 70 - 10 * i for i, kind in enumerate(CORRUPTIONS)}


def _corrupt_newest_six(run: Path, scratch: Path) -> list[str]:
    for kind, step in FALLBACK_STEPS.items():
        CORRUPTIONS[kind][0](run / names.checkpoint_name(step))
    return []


def _checkpoint_refused(kind: str) -> Case:
    corrupt, words = CORRUPTIONS[kind]

    def prepare(run: Path, scratch: Path) -> list[str]:
        for _, path in ckpt.list_checkpoints(run):
            corrupt(path)
        return []
    return Case(f"every .bin {kind}", prepare, 1, [STEP70, *words, "refusing to start over"])


def _init_from_bad(run: Path, scratch: Path) -> list[str]:
    bad = scratch / "elsewhere" / STEP20
    bad.parent.mkdir()
    shutil.copy(run / STEP20, bad)
    _truncate(bad)
    return ["--init-from", str(bad)]


def _write(name: str, data: bytes, remove: tuple[str, ...] = ()) -> Callable[[Path, Path], list[str]]:
    def prepare(run: Path, scratch: Path) -> list[str]:
        for r in remove:
            (run / r).unlink()
        (run / name).write_bytes(data)
        return []
    return prepare


def _edit_state(name: str, edit: Callable[[dict], object]) -> Callable[[Path, Path], list[str]]:
    """A state as andrea would have sealed it with the edit made (an older run's, or another version's): what its
    reader then makes of the content, not the seal (a broken seal: tests/unit/control/run/test_resume.py)."""
    def prepare(run: Path, scratch: Path) -> list[str]:
        d = sidecars.opened(json.loads((run / name).read_text()), name)
        out = edit(d)
        (run / name).write_bytes(sidecars.json_bytes(sidecars.seal(d if out is None else out)))
        return []
    return prepare


def _set_key(d: dict, keys: list[str], value) -> None:
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


def _zombie_arm(d: dict) -> None:
    d["arms"].append("repo-docstrings")
    d["bandit"]["arms"]["repo-docstrings"] = dict(d["bandit"]["arms"]["stdlib-code"], weight=1.546)


def _source(kind: str, content: bytes | None) -> Callable[[Path, Path], list[str]]:
    def prepare(run: Path, scratch: Path) -> list[str]:
        path = scratch / "src" / ("extra.u16" if kind == "tokens" else "extra.txt")
        path.parent.mkdir()
        if content is not None:
            path.write_bytes(content)
        return ["--set", f'data.sources=[{{name="extra", path="{path}", kind="{kind}"}}]']
    return prepare


def _args(*args: str) -> Callable[[Path, Path], list[str]]:
    return lambda run, scratch: list(args)


def _run_toml(old: str, new: str) -> Callable[[Path, Path], list[str]]:
    def prepare(run: Path, scratch: Path) -> list[str]:
        text = (run / "run.toml").read_text()
        assert old in text
        (run / "run.toml").write_text(text.replace(old, new))
        return []
    return prepare


def _torn_ledger(run: Path, scratch: Path) -> list[str]:
    with open(run / ".loss.json", "ab") as f:
        f.write(b'{"step":71,"loss":4.12')
    return []


S70 = "step_000070.state.json"
REFUSED_KINDS = ["truncated", "n_params-of-another-model"]  # the fallback tests cover every kind's message
CASES = [
    Case("six newest .bin corrupt, one kind each", _corrupt_newest_six, 0, ["skipping invalid checkpoint"], steps=70,
         fallback="skips each with a warning, resumes from step 10, redoes step 70 byte-identically"),
    *[_checkpoint_refused(k) for k in REFUSED_KINDS],
    Case("--init-from a truncated file", _init_from_bad, 1, [STEP20, "truncated"], steps=70),
    # The bandit's state may be reset by contract (docs/formats.md): a bad one is passed over in one warning line
    # naming the file and the field, never a refused start.
    Case("step_N.state.json garbage", _write(S70, b"\x00{garbage"), 0, [S70, "JSON"], steps=75,
         fallback="passed over in one line naming the file; the bandit restarts"),
    Case("step_N.state.json bandit.updates wrong type",
         _edit_state(S70, lambda d: _set_key(d, ["bandit", "updates"], "many")), 0, [S70, "updates"], steps=75,
         fallback="passed over in one line naming the file and field; the bandit restarts"),
    Case(".state.json wrong type (no step_N.state.json)", _write(".state.json", b"[1, 2, 3]", (S70,)), 0,
         [".state.json", "object"], steps=75, fallback="passed over in one line naming the file; a fresh bandit"),
    Case(".state.json garbage beside a good step_N.state.json", _write(".state.json", b"\xff\xfe garbage"), 0,
         [], steps=75, fallback="ignored: step_N.state.json is the state of the checkpoint; rewritten at step 75"),
    Case("zombie arm in step_N.state.json (docs/formats.md)", _edit_state(S70, _zombie_arm), 0,
         ["zombie arm 'repo-docstrings'"], steps=75, fallback="drops the zombie arm with a warning, trains on"),
    # these three are met by a start that trains (a start at its target trains nothing and reads neither)
    Case("torn .loss.json tail", _torn_ledger, 0, [".loss.json", "torn"], steps=71,
         fallback="cuts the torn last line, appends a torn_tail marker, resumes from step 70"),
    Case("missing data source", _source("text", None), 1, ["data.sources['extra'].path", "extra.txt"], steps=71),
    Case("empty data source (text)", _source("text", b""), 1, ["data.sources['extra']", "empty"], steps=71),
    Case("unknown config key", _args("--set", "checkpoint.evry=5"), 2, ["checkpoint.evry", "evry"]),
    Case("unknown config section", _args("--set", "chekpoint.every=5"), 2, ["chekpoint"]),
    Case("mistyped config value", _args("--set", "checkpoint.every=often"), 2, ["checkpoint.every", "often"]),
    Case("unknown key in run.toml", _run_toml("keep_last =", "keep_lst ="), 2, ["run.toml", "keep_lst"]),
    Case("run.toml not TOML", _write("run.toml", b"[model\nn_layer = = 2\n"), 2, ["run.toml", "TOML"]),
    # The operator's --set is at fault, not the checkpoint's bandit state: a configuration error (exit 2) that
    # names the --set and must not blame that file.
    Case("floors that sum above 1",
         _args("--set", 'policy.floors={"stdlib-code"=0.7,"pydoc-topics"=0.6}'), 2,
         ["--set policy.floors", "policy.floors sum to 1.3 > 1", "cannot all be met"], not_words=("state.json",)),
    Case("a cap for an arm that does not exist", _args("--set", 'policy.caps={"repo-docstrings"=0.5}'), 2,
         ["--set policy.caps", "unknown arm 'repo-docstrings'"], not_words=("state.json",)),
]
BY_NAME = {c.name: c for c in CASES}


def _run_case(case: Case, trained: Path, scratch: Path) -> None:
    run = scratch / "run"
    shutil.copytree(trained, run)
    redo = names.checkpoint_name(case.steps)
    original = (trained / redo).read_bytes() if (trained / redo).exists() else None
    ledger_before = (run / ".loss.json").read_bytes()
    args = case.prepare(run, scratch)
    before = tree_digest(run)
    result = train(run, "--steps", str(case.steps), *args, timeout=300)
    case.result = {"rc": result.returncode, "stderr": result.stderr, "stdout": result.stdout,
                   "changes": digest_diff(before, tree_digest(run)), "run": run,
                   "ledger_before": ledger_before,
                   "redone": original is not None and (run / redo).exists() and (run / redo).read_bytes() == original}
    if case.prepare is _corrupt_newest_six:
        for kind, step in FALLBACK_STEPS.items():
            line = first_line_with(result.stderr, f"{names.checkpoint_name(step)}:")
            REPORT.bad_input(f"{names.checkpoint_name(step)} {kind}", f"fallback ({case.fallback})",
                             result.returncode, line.split("older one: ", 1)[-1])
        return
    if case.rc == 0:
        words = case.words or ["WARNING"]
        message = first_line_with(result.stderr, words[0]) or first_line_with(result.stderr, "WARNING")
        message = message.split(": ", 1)[-1] if " andrea." in message else message
        outcome = f"fallback ({case.fallback})"
    else:
        message, outcome = last_error_line(result.stderr), "refused"
    REPORT.bad_input(case.name, outcome, result.returncode, message)


@pytest.fixture(scope="module")
def outcomes(trained, tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("bad-inputs")
    longer = root / "trained-to-70"  # checkpoints 10..70, all kept
    shutil.copytree(trained, longer)
    result = train(longer, "--steps", "70", "--checkpoint-every", "10", "--set", "checkpoint.keep_last=10")
    assert result.returncode == 0, result.stderr[-2000:]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ic: _run_case(ic[1], longer, root / f"case{ic[0]}"), enumerate(CASES)))
    return BY_NAME


def _assert_refused(case: Case) -> None:
    r = case.result
    assert r["rc"] == case.rc, f"{case.name}: exit {r['rc']}, expected {case.rc}\n{r['stderr'][-2000:]}"
    last = last_error_line(r["stderr"])
    assert last.startswith("andrea: error: "), f"{case.name}: last stderr line is not the error:\n{r['stderr'][-2000:]}"
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert sum(l.startswith("andrea: error") for l in r["stderr"].splitlines()) == 1
    for word in case.words:
        assert word in last, f"{case.name}: {word!r} not in the message: {last}"
    for word in case.not_words:
        assert word not in last, f"{case.name}: the message blames {word!r}, which is not at fault: {last}"
    assert not r["changes"], f"{case.name}: the failed start changed the run directory: {r['changes']}"
    assert "ready " not in r["stdout"]


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_skipped_with_a_warning_naming_file_and_field(outcomes, kind):
    r = outcomes["six newest .bin corrupt, one kind each"].result
    name = names.checkpoint_name(FALLBACK_STEPS[kind])
    warning = first_line_with(r["stderr"], f"{name}:")
    assert "skipping invalid checkpoint" in warning, f"no warning about {name}:\n{r['stderr'][-3000:]}"
    for word in CORRUPTIONS[kind][1]:
        assert word in warning, f"{word!r} not in: {warning}"


def test_past_six_corrupt_checkpoints_the_run_resumes_from_the_newest_valid_and_redoes_them_identically(outcomes):
    r = outcomes["six newest .bin corrupt, one kind each"].result
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert "ready " in r["stdout"] and " step=10 " in r["stdout"], r["stdout"]
    assert r["redone"], "step_000070.bin redone from step 10 differs from the original step 70"


@pytest.mark.parametrize("kind", REFUSED_KINDS)
def test_when_every_checkpoint_is_corrupt_the_trainer_refuses_in_one_line_and_touches_nothing(outcomes, kind):
    _assert_refused(outcomes[f"every .bin {kind}"])


def test_a_bad_init_from_file_is_refused_in_one_line_naming_it(outcomes):
    _assert_refused(outcomes["--init-from a truncated file"])


BAD_STATES = ["step_N.state.json garbage", "step_N.state.json bandit.updates wrong type",
              ".state.json wrong type (no step_N.state.json)"]


@pytest.mark.parametrize("name", BAD_STATES)
def test_garbage_or_wrong_type_bandit_state_is_passed_over_in_one_line_naming_file_and_field(outcomes, name):
    case = outcomes[name]
    r = case.result
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    warning = first_line_with(r["stderr"], case.words[0])
    for word in case.words:
        assert word in warning, f"{name}: {word!r} not in the warning: {warning!r}\n{r['stderr'][-2000:]}"
    state = json.loads((r["run"] / ".state.json").read_text())
    assert state["step"] == 75  # trained on and wrote a valid state at its checkpoint


def test_garbage_live_state_beside_a_good_checkpoint_state_is_ignored_and_rewritten(outcomes):
    r = outcomes[".state.json garbage beside a good step_N.state.json"].result
    assert r["rc"] == 0, r["stderr"][-2000:]
    state = json.loads((r["run"] / ".state.json").read_text())
    assert state["step"] == 75


def test_a_zombie_arm_in_bandit_state_is_dropped_with_a_warning_naming_it(outcomes):
    case = outcomes["zombie arm in step_N.state.json (docs/formats.md)"]
    r = case.result
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert first_line_with(r["stderr"], "zombie arm 'repo-docstrings'"), r["stderr"][-2000:]
    assert "repo-docstrings" not in json.loads((r["run"] / "step_000075.state.json").read_text())["arms"]


def test_a_torn_ledger_tail_is_cut_marked_and_everything_before_it_kept(outcomes):
    r = outcomes["torn .loss.json tail"].result
    assert r["rc"] == 0, r["stderr"][-2000:]
    torn = len(b'{"step":71,"loss":4.12')
    assert first_line_with(r["stderr"], f"torn last line of {torn} bytes"), r["stderr"][-2000:]
    original = r["ledger_before"]
    now = (r["run"] / ".loss.json").read_bytes()
    assert now.startswith(original), "bytes before the torn line changed"
    contents = read_ledger(r["run"] / ".loss.json")
    assert not contents.torn_tail
    assert any(e.get("event") == "torn_tail" and e.get("bytes") == torn for e in contents.entries)


@pytest.mark.parametrize("name", ["missing data source", "empty data source (text)"])
def test_a_missing_or_empty_data_source_is_refused_in_one_line_naming_it(outcomes, name):
    _assert_refused(outcomes[name])


@pytest.mark.parametrize("name", ["unknown config key", "unknown config section", "mistyped config value",
                                  "unknown key in run.toml", "run.toml not TOML"])
def test_a_bad_configuration_exits_2_in_one_line_naming_source_and_key(outcomes, name):
    _assert_refused(outcomes[name])


@pytest.mark.parametrize("name", ["floors that sum above 1", "a cap for an arm that does not exist"])
def test_caps_and_floors_that_cannot_be_satisfied_are_refused_in_one_line(outcomes, name):
    _assert_refused(outcomes[name])


def test_a_read_only_run_directory_is_refused_in_one_line(trained_copy, readonly_view):
    ro = readonly_view(trained_copy)
    before = tree_digest(ro)
    result = train(ro, "--steps", "30")
    message = last_error_line(result.stderr)
    REPORT.bad_input("run dir not writable (read-only bind mount)", "refused", result.returncode, message)
    assert result.returncode == 1, result.stderr[-2000:]
    assert message.startswith("andrea: error: ") and str(ro) in message and "writable" in message, message
    assert "Traceback" not in result.stderr
    assert tree_digest(ro) == before


# --- device options this machine cannot run; run-life commands on a directory that is not a run (issue 26) -------
def _hide_cuda(tmp_path: Path) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ""}  # torch then sees no CUDA device, on any machine


def _hide_triton(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "no-triton" / "triton"  # shadows the installed package: `import triton` fails
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("triton hidden by the test")\n')
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}


DEVICE_CASES = {  # name -> (train args, the machine as the test makes it, words the message must contain)
    "--device cuda without a CUDA device": (["--device", "cuda"], _hide_cuda, ["train.device=cuda", "--device cpu"]),
    "--kernels triton without Triton": (["--kernels", "triton"], _hide_triton,
                                        ["train.kernels=triton", "Triton cannot be imported", "--kernels torch"]),
    # on a CPU Triton runs only in its interpreter (~1000x slower), never unless TRITON_INTERPRET asks for it
    "--kernels triton on a CPU": (["--kernels", "triton", "--device", "cpu"], lambda tmp_path: {"TRITON_INTERPRET": "0"},
                                  ["train.kernels=triton on a CPU", "--kernels torch"]),
}


@pytest.mark.parametrize("where", ["a trained run", "an absent run directory"])
@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_a_device_option_this_machine_cannot_run_is_refused_in_one_line_before_anything_is_written(
        name, where, trained_copy, tmp_path):
    args, machine, words = DEVICE_CASES[name]
    run = trained_copy if where == "a trained run" else tmp_path / "fresh"
    before = tree_digest(run) if run.exists() else None
    result = train(run, "--steps", "30", *args, extra_env=machine(tmp_path))
    message = last_error_line(result.stderr)
    if where == "a trained run":
        REPORT.bad_input(name, "refused", result.returncode, message)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and message.startswith("andrea: error: "), result.stderr[-2000:]
    assert sum(l.startswith("andrea: error") for l in result.stderr.splitlines()) == 1
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert (tree_digest(run) == before) if before is not None else not run.exists()


def _nonrun(tmp_path: Path) -> Path:
    d = tmp_path / "not-a-run"
    d.mkdir()
    (d / "notes.txt").write_text("a directory that is not a run\n")
    return d


RUN_LIFE_CASES = {  # name -> argv after `andrea` ({d}: the directory that is not a run, {out}: an output path)
    "status of a directory that is not a run": ["status", "{d}"],
    "ctl status of a directory that is not a run": ["ctl", "{d}", "status"],
    "plot of a directory that is not a run": ["plot", "{d}", "--out", "{out}"],
    "compare of two directories that are not runs": ["compare", "{d}", "{d}"],
}


@pytest.mark.parametrize("name", list(RUN_LIFE_CASES))
def test_a_run_life_command_on_a_directory_that_is_not_a_run_is_refused_in_one_line(name, tmp_path):
    d, out = _nonrun(tmp_path), tmp_path / "loss.png"
    before = tree_digest(tmp_path)
    result = andrea_here(*[a.format(d=d, out=out) for a in RUN_LIFE_CASES[name]])  # in process: none trains
    message = last_error_line(result.stderr)
    REPORT.bad_input(name, "refused", result.returncode, message)
    assert result.returncode == 1, (result.stdout, result.stderr[-2000:])
    assert message == f"andrea: error: {d}: not a run directory (no run.toml, .loss.json, tokenizer.json, " \
                      "step_NNNNNN.bin or running trainer)", result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not result.stdout
    assert tree_digest(tmp_path) == before and not out.exists()


def test_status_answers_for_a_prepared_run_and_for_a_stopped_one(prepared, trained_copy, tmp_path):
    fresh = seed_data(prepared, tmp_path / "prepared")  # tokenizer.json and data/, as a first start leaves them
    for run, state, step in ((fresh, "prepared", None), (trained_copy, "stopped", 20)):
        result = andrea_here("status", str(run), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        st = json.loads(result.stdout)
        assert (st["state"], st["step"], st["running"]) == (state, step, False), st
