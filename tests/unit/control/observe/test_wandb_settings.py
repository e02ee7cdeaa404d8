"""W&B's own environment wins where run.toml names nothing (issue 46): control/observe/wandb_log.py `init_settings`."""

import pytest

from andrea.config.check import ConfigError
from andrea.config.load import load
from andrea.config.outputs import LogConfig
from andrea.control.observe.wandb_log import init_settings

ENV = {"WANDB_MODE": "offline", "WANDB_PROJECT": "cluster-proj", "WANDB_ENTITY": "team"}


def test_keys_left_empty_take_wandb_s_environment_then_andreas_defaults():
    cfg = load(preset="andrea-tiny", overrides=["log.wandb=true"]).log  # a run.toml that names nothing
    assert init_settings(cfg, ENV) == {"project": "cluster-proj", "entity": "team", "mode": "offline"}
    assert init_settings(cfg, {}) == {"project": "andrea", "entity": None, "mode": "online"}


def test_a_key_run_toml_names_wins_over_the_environment():
    cfg = LogConfig(wandb=True, wandb_project="mine", wandb_entity="me", wandb_mode="online")
    assert init_settings(cfg, ENV) == {"project": "mine", "entity": "me", "mode": "online"}


def test_the_mode_accepts_empty_and_refuses_anything_else_in_one_line():
    assert LogConfig(wandb_mode="").wandb_mode == ""
    with pytest.raises(ConfigError, match=r"^log.wandb_mode='dry' must be online, offline or empty"):
        LogConfig(wandb_mode="dry")
