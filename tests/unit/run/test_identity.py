"""andrea/run/identity.py: a resume that would change the model's arch (or, for a modern model, its rotary base) is
refused in one line naming the field and both values; a record written before `model.arch` existed is a gpt2 run's.
The same for `train.optimizer`: a resume that would change it is refused, and an older record is an adamw run's."""

import json

import numpy as np
import pytest

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.run import identity
from andrea.rundir import names
from andrea.rundir.checkpoint_write import commit_checkpoint

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 300}


def cfg(**model):
    return configload.from_dict({"model": {**SHAPE, **model}})


def run_with_a_checkpoint(tmp_path):
    commit_checkpoint(tmp_path, 1, np.zeros(3, dtype=np.float32))  # named like a checkpoint: enough here
    return tmp_path


@pytest.mark.parametrize("saved, resumed, phrase", [
    ({}, {"arch": "modern"}, "model.arch from 'gpt2' to 'modern'"),
    ({"arch": "modern"}, {}, "model.arch from 'modern' to 'gpt2'"),
    ({"arch": "modern"}, {"arch": "modern", "rope_base": 500000.0}, "model.rope_base from 10000.0 to 500000.0"),
])
def test_a_resume_that_changes_the_arch_is_refused_in_one_line(tmp_path, saved, resumed, phrase):
    run = run_with_a_checkpoint(tmp_path)
    identity.check_resume(run, cfg(**saved), cfg(**saved))  # the same configuration resumes
    with pytest.raises(ConfigError) as e:
        identity.check_resume(run, cfg(**resumed), cfg(**saved))
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_a_gpt2_run_ignores_the_rotary_base_and_an_old_record_is_a_gpt2_runs(tmp_path):
    assert "model.rope_base" not in identity.identity(cfg(), None)
    assert identity.identity(cfg(arch="modern"), None)["model.rope_base"] == 10000.0
    run = run_with_a_checkpoint(tmp_path)
    old = {k: v for k, v in identity.identity(cfg(), None).items() if k != "model.arch"}  # recorded before arch
    (run / names.LEDGER_NAME).write_text(json.dumps({"event": "start", "step": 0, "time": 0.0, "identity": old}) + "\n")
    identity.check_resume(run, cfg(rope_base=99.0), cfg())  # rope_base means nothing to a gpt2 model
    with pytest.raises(ConfigError, match="model.arch from 'gpt2' to 'modern'"):
        identity.check_resume(run, cfg(arch="modern"), cfg())


def test_the_optimizer_is_part_of_the_identity_and_an_old_record_is_an_adamw_runs(tmp_path):
    assert identity.identity(cfg(), None)["train.optimizer"] == "adamw"
    muon = configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon"}})
    run = run_with_a_checkpoint(tmp_path)
    identity.check_resume(run, muon, muon)
    with pytest.raises(ConfigError) as e:
        identity.check_resume(run, cfg(), muon)
    assert "train.optimizer from 'muon' to 'adamw'" in str(e.value) and "\n" not in str(e.value)
    old = {k: v for k, v in identity.identity(cfg(), None).items() if k != "train.optimizer"}  # recorded before
    (run / names.LEDGER_NAME).write_text(json.dumps({"event": "start", "step": 0, "time": 0.0, "identity": old}) + "\n")
    identity.check_resume(run, cfg(), cfg())
    with pytest.raises(ConfigError, match="train.optimizer from 'adamw' to 'muon'"):
        identity.check_resume(run, muon, cfg())
