"""Typed configuration: presets, overrides and one-line errors."""

import pytest

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.model.gpt import layout_for, n_params


def test_presets_have_the_promised_sizes():
    assert n_params(layout_for(configload.load(preset="andrea-tiny").model)) < 1_000_000
    n12 = n_params(layout_for(configload.load(preset="andrea-12m").model))
    n120 = n_params(layout_for(configload.load(preset="andrea-120m").model))
    assert abs(n12 - 12.8e6) <= 0.02 * 12.8e6
    assert abs(n120 - 120e6) <= 0.03 * 120e6


def test_set_overrides_parse_toml_values():
    cfg = configload.load(preset="andrea-tiny", overrides=["train.lr=0.01", "data.arms=['pydoc-topics']",
                                                        "checkpoint.usr1=cadence"])
    assert cfg.train.lr == 0.01 and cfg.data.arms == ["pydoc-topics"] and cfg.checkpoint.usr1 == "cadence"


def test_mistyped_key_is_named_with_a_suggestion(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 0.1\nlr_decay_step = 5\n")
    with pytest.raises(ConfigError) as err:
        configload.load(config_file=bad)
    assert str(bad) in str(err.value) and "train.learning_rate" in str(err.value)
    with pytest.raises(ConfigError, match=r"did you mean 'train.lr_decay_steps'"):
        configload.load(overrides=["train.lr_decay_step=5"])


@pytest.mark.parametrize("item, message", [
    ("train.lr='fast'", "train.lr must be float"),
    ("model.n_head=3", "not a multiple of model.n_head"),
    ("checkpoint.usr1=sometimes", "must be 'step' or 'cadence'"),
    ("data.arms=['nope']", "unknown built-in arm 'nope'"),
    ("modle.n_layer=2", "unknown key 'modle'"),
])
def test_bad_values_are_one_line(item, message):
    with pytest.raises(ConfigError) as err:
        configload.load(preset="andrea-tiny", overrides=[item])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_broken_toml_names_the_file(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[train\nlr = ")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        configload.load(config_file=bad)


def test_resolved_config_round_trips_through_toml():
    cfg = configload.load(preset="andrea-12m", overrides=["policy.floors={stdlib-code=0.2}"])
    again = configload.from_dict(configload.parse_toml(cfg.to_toml(), "run.toml"))
    assert again == cfg
