"""Where a run starts again (control/run/resume.py): the data proxy's state as of the checkpoint resumed from, when the
sidecars holding it are another step's, another run's or garbage. Pure CPU: fake token arrays, no trainer."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from andrea.config.load import load
from andrea.data.store import ArmTokens
from andrea.control.mixture.proxy import DataProxy
from andrea.rundir import checkpoint as ckpt, names, sidecars
from andrea.control.run.resume import restore_proxy

STEP = 20


def setup(update_every: int = 10):
    cfg = load(overrides=["train.batch_size=8", "model.block_size=16", f"policy.update_every={update_every}"])
    rng = np.random.default_rng(0)
    arms = [ArmTokens(n, rng.integers(0, 300, 4000).astype(np.uint16), rng.integers(0, 300, 400).astype(np.uint16))
            for n in cfg.data.arm_names()]
    return cfg, arms


def state_at(step: int, update_every: int = 10) -> dict:
    cfg, arms = setup(update_every)
    proxy = DataProxy(cfg, arms)
    for s in range(step):
        batch = proxy.batch(s)
        proxy.observe(s + 1, 3.0 - 0.01 * s + 0.1 * batch.arm_ids.astype(np.float64))
    return json.loads(json.dumps(proxy.state(step)))


def sealed(state: dict) -> str:
    """The state file as the boundary writes it."""
    return sidecars.json_bytes(sidecars.seal(state)).decode()


@pytest.fixture
def run(tmp_path):
    """A run directory at STEP whose own step_N.state.json and .state.json are the true state."""
    state = state_at(STEP)
    for path in (tmp_path / names.checkpoint_name(STEP).replace(".bin", ".state.json"),
                 tmp_path / names.STATE_NAME):
        path.write_text(sealed(state))
    return tmp_path, state


def restored(run_dir, caplog) -> tuple[dict, list[str]]:
    cfg, arms = setup()
    info = ckpt.CheckpointInfo(run_dir / names.checkpoint_name(STEP), STEP, 0)
    with caplog.at_level(logging.WARNING, logger="andrea.control.run"):
        proxy = restore_proxy(cfg, run_dir, arms, info)
    return proxy.state(STEP), [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_checkpoint_state_swapped_for_another_steps_falls_back_to_the_live_state(run, caplog):
    run_dir, state = run
    own = run_dir / names.checkpoint_name(STEP).replace(".bin", ".state.json")
    own.write_text(sealed(state_at(10)))  # another step's, copied over it
    got, said = restored(run_dir, caplog)
    assert got == state
    assert said == [f"{own}: field 'step' is 10, expected {STEP}; the data proxy's state is restored from "
                    ".state.json instead"]


@pytest.mark.parametrize("swap", ["another step's", "another run's (its windows elsewhere)", "garbage"])
def test_both_states_unusable_is_a_fresh_bandit_and_one_line_never_a_refused_start(swap, run, caplog):
    run_dir, _ = run
    own = run_dir / names.checkpoint_name(STEP).replace(".bin", ".state.json")
    live = run_dir / names.STATE_NAME
    if swap == "garbage":
        own.write_text("{not json")
        live.write_text(sealed(state_at(10)))  # another step's: passed over, as before
    else:
        foreign = state_at(10) if swap == "another step's" else state_at(STEP) | {"applied_upto": 10}
        own.write_text(sealed(foreign))
        live.write_text(sealed(foreign))
    got, said = restored(run_dir, caplog)
    cfg, arms = setup()
    assert got == DataProxy(cfg, arms, phase_start=STEP).state(STEP)
    assert len(said) == 1 and said[0].startswith(str(own)), said  # the first problem named, the rest in the line
    assert said[0].endswith(f"the bandit starts fresh at step {STEP} (data order after this point differs from "
                            "the original run's)")


def test_a_run_directory_holding_only_another_models_checkpoints_is_a_configuration_refusal(tmp_path):
    """README's exit codes: 2 for configuration, 1 otherwise. Only sound checkpoints of another model (a forgotten
    `--preset`) is the configuration's error: exit 2; a damaged one among them is the run directory's: exit 1."""
    from andrea.control.run.resume import resume_point
    n = 16
    for step in (10, 20):  # sound checkpoints of a model of n + 4 parameters
        (tmp_path / names.checkpoint_name(step)).write_bytes(
            ckpt.header(step, n + 4) + np.zeros(3 * (n + 4), "<f4").tobytes())
    with pytest.raises(ckpt.CheckpointError, match="refusing to start over") as e:
        resume_point(tmp_path, None, n)
    assert e.value.exit_code == 2 and "checkpoint of another model" in str(e.value)
    (tmp_path / names.checkpoint_name(20)).write_bytes(ckpt.header(20, n + 4))  # truncated: damaged
    with pytest.raises(ckpt.CheckpointError, match="refusing to start over") as e:
        resume_point(tmp_path, None, n)
    assert e.value.exit_code == 1



def test_a_header_edited_to_another_models_size_is_damage_not_a_configuration_refusal(tmp_path):
    """A checkpoint cut down to a consistent file of a smaller model (header n_params and size agree) no longer
    verifies against its recorded checksum: damage (exit 1), where the same bytes with their own checksum record are
    a sound checkpoint of another model (exit 2: the configuration's)."""
    from andrea.control.run.resume import resume_point
    from andrea.rundir import checksum
    n = 16
    cut = ckpt.header(10, n - 4) + np.arange(3 * (n - 4), dtype="<f4").tobytes()  # a 12-parameter model's
    for name, recorded_n in (("edited", n), ("sound", n - 4)):
        run = tmp_path / name
        run.mkdir()
        path = run / names.checkpoint_name(10)
        path.write_bytes(ckpt.header(10, recorded_n) + np.arange(3 * recorded_n, dtype="<f4").tobytes())
        checksum.write(path, 10, recorded_n, checksum.file_digests(path, recorded_n))
        path.write_bytes(cut)
    with pytest.raises(ckpt.CheckpointError, match="refusing to start over") as e:
        resume_point(tmp_path / "edited", None, n)
    assert e.value.exit_code == 1 and "does not verify" in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="refusing to start over") as e:
        resume_point(tmp_path / "sound", None, n)
    assert e.value.exit_code == 2 and "checkpoint of another model" in str(e.value)


def test_a_bit_changed_in_a_sealed_state_is_never_used_and_one_from_before_seals_is(run, caplog):
    """A digit flipped in a sealed step_N.state.json (an observed loss: valid JSON, a value every field check
    accepts, and every later batch's rows would follow it) is passed over in one line naming the broken seal, and the
    intact live .state.json restores the same state; a state from before seals (no version, no checksum) is read."""
    run_dir, state = run
    own = sidecars.checkpoint_state_path(run_dir, STEP)
    intact = own.read_text()
    body = intact[intact.index('"losses"'):]
    at = intact.index('"losses"') + next(i for i, c in enumerate(body) if c in "12345678")  # a digit of a loss
    flipped = intact[:at] + str(int(intact[at]) + 1) + intact[at + 1:]
    own.write_text(flipped)
    assert json.loads(flipped) != json.loads(intact)  # still JSON, a loss in range: only the seal tells
    got, said = restored(run_dir, caplog)
    assert got == state
    assert len(said) == 1 and said[0].startswith(f"{own}: its content does not match its checksum"), said
    assert said[0].endswith("the data proxy's state is restored from .state.json instead")
    caplog.clear()
    old = {k: v for k, v in state.items() if k != "version"}
    own.write_text(json.dumps(old))  # written before seals
    (run_dir / names.STATE_NAME).unlink()
    got, said = restored(run_dir, caplog)
    assert said == [] and got == state
