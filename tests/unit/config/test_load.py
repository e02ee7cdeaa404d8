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
    ("train.muon_lr=inf", "train.muon_lr must be a finite number, got inf"),  # inf > 0 passes a range check
    ("guard.loss_sigmas=inf", "guard.loss_sigmas must be a finite number"),
    ("policy.caps={stdlib-code=nan}", "policy.caps.stdlib-code must be a finite number"),
    ("sample.temperature=-1", "sample.temperature=-1.0 and sample.top_k=40 must be >= 0"),
    ("data.sources=[{name='../../precious', path='x'}]", "name must be non-empty, hold no '/'"),  # it names files
    ("data.sources=[{name='', path='x'}]", "name must be non-empty"),
    ("data.sources=[{name='.hidden', path='x'}]", "not start with '.'"),
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


def test_a_restart_with_the_same_command_is_told_nothing_a_preset_over_another_run_is(tmp_path, caplog):
    """Issue 46: every supervisor restart of `train --preset andrea-tiny --steps 30 --checkpoint-every 10` warned
    `run.toml keeps its own train.steps, checkpoint.every` although the command gives both again."""
    import argparse
    import logging

    from andrea.commands.run_config import resolve_config
    from andrea.rundir import names

    def args(preset: str) -> argparse.Namespace:
        return argparse.Namespace(preset=preset, config=None, steps=30, checkpoint_every=10, seed=7, device="cpu",
                                  kernels=None, set=["train.lr=0.002"])

    (tmp_path / names.CONFIG_NAME).write_text(resolve_config(args("andrea-tiny"), tmp_path).to_toml())
    with caplog.at_level(logging.WARNING, logger="andrea"):
        again = resolve_config(args("andrea-tiny"), tmp_path)
    assert again.train.steps == 30 and again.checkpoint.every == 10
    assert not [r for r in caplog.records if "keeps its own" in r.getMessage()]
    resolve_config(args("andrea-12m"), tmp_path)  # another preset over this run: its differences are said
    [said] = [r.getMessage() for r in caplog.records if "keeps its own" in r.getMessage()]
    assert "model.n_layer" in said and "train.steps" not in said and "train.lr" not in said
    assert configload.kept_by_run({"train": {"steps": 300}}, {"train": {"steps": 30}}, []) == ["train.steps"]


@pytest.mark.parametrize("preset", ["andrea-12m-modern", "andrea-120m-modern"])
def test_a_run_started_under_a_modern_presets_muon_keeps_it_when_the_preset_moved_to_normuon(preset):
    """The modern presets run NorMuon (docs/benchmarks.md); a run started when they ran Muon recorded it in its
    run.toml, and a restart naming the preset again keeps Muon and its lrs (the optimizer is the run's identity: what
    its checkpoints' m and v hold), told which of the preset's values its run keeps."""
    now = configload.load(preset=preset)
    assert now.train.optimizer == "normuon"
    older = configload.load(preset=preset, overrides=['train.optimizer="muon"', "train.muon_lr=0.02",
                                                      "train.muon_momentum=0.95", "train.muon_weight_decay=0.0"])
    recorded = configload.parse_toml(older.to_toml(), "run.toml")
    again = configload.load(preset=preset, base=recorded)
    assert (again.train.optimizer, again.train.muon_lr, again.train.muon_weight_decay) == ("muon", 0.02, 0.0)
    kept = configload.kept_by_run(configload.parse_toml(configload.preset_text(preset), preset), recorded, [])
    assert "train.optimizer" in kept and "train.muon_weight_decay" in kept


@pytest.mark.parametrize("raw, words", [
    ("[train]\nlr = 0.001\n".encode("utf-16"), "not UTF-8 text (byte 0)"),  # as an editor saves UTF-16
    (b"\xef\xbb\xbf[train]\nlr = 0.001\n", "starts with a byte-order mark"),
])
def test_a_toml_file_that_is_not_plain_utf8_is_one_line_naming_it(tmp_path, raw, words):
    bad = tmp_path / "policy.toml"
    bad.write_bytes(raw)
    with pytest.raises(ConfigError) as err:
        configload.load(config_file=bad)
    assert str(bad) in str(err.value) and words in str(err.value) and "\n" not in str(err.value)
