"""The target step is the operator's to move: a start whose run is already at its target (train.steps, kept in
run.toml from an earlier --steps) trains nothing and says so in one line with how to go further, exit 0; a
command without --preset says which preset it uses (andrea/control/run/target.py, commands/run_config.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from andrea.control.run import target
from tests.runs import andrea, andrea_here, ledger, seed_data, train


def test_a_start_at_the_target_says_so_in_one_line_and_a_new_steps_trains_further(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    assert train(run, "--steps", "3", "--checkpoint-every", "1000").returncode == 0
    before = (run / ".loss.json").read_bytes()
    again = andrea("train", "--run-dir", str(run))  # run.toml's preset and its kept train.steps = 3
    assert again.returncode == 0, again.stderr
    [line] = again.stdout.splitlines()  # no `ready` line: nothing was started
    assert line.startswith(f"{run}: nothing to train: already at its target step 3 (train.steps, kept in run.toml"), line
    assert "`--steps N` with N > 3 trains further" in line
    assert (run / ".loss.json").read_bytes() == before  # no resume marker: the run was not opened
    further = train(run, "--steps", "5")
    assert further.returncode == 0, further.stderr
    assert [e["step"] for e in ledger(run) if "event" not in e][-1] == 5


def test_the_note_names_where_the_target_came_from_and_is_silent_below_it():
    run = Path("runs/x")
    assert target.note(run, 599, 600, from_flag=False) is None
    assert "already at its target step 600 (--steps)" in target.note(run, 600, 600, from_flag=True)
    past = target.note(run, 800, 600, from_flag=False)
    assert "at step 800, past its target step 600 (train.steps, kept in run.toml" in past and "N > 800" in past


def test_info_and_train_without_a_preset_say_which_preset_they_use(caplog):
    with caplog.at_level(logging.INFO, logger="andrea"):
        assert andrea_here("info").returncode == 0
    said = [r.getMessage() for r in caplog.records if "no --preset" in r.getMessage()]
    assert said and "andrea-12m" in said[0], [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="andrea"):
        assert andrea_here("info", "--preset", "andrea-tiny").returncode == 0
    assert not [r for r in caplog.records if "no --preset" in r.getMessage()]
