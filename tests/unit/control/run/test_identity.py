"""andrea/control/run/identity.py: a resume that would change the model's arch (or, for a modern model, its rotary base) is
refused in one line naming the field and both values; a record written before `model.arch` existed is a gpt2 run's.
The same for `train.optimizer`: a resume that would change it is refused, and an older record is an adamw run's."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.control.run import identity
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
    ({"arch": "modern"}, {"arch": "modern", "logit_softcap": 15.0}, "model.logit_softcap from 0.0 to 15.0"),
    ({"arch": "modern", "mlp": "relu2"}, {"arch": "modern"}, "model.mlp from 'relu2' to 'swiglu'"),
    ({"arch": "modern"}, {"arch": "modern", "embed_norm": True}, "model.embed_norm from False to True"),
    ({"arch": "modern", "qk_scale": 1.2}, {"arch": "modern"}, "model.qk_scale from 1.2 to 1.0"),
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


def test_a_modern_record_from_before_the_extras_is_a_plain_modern_runs(tmp_path):
    """A modern run recorded before logit_softcap, embed_norm, qk_scale and mlp existed had none of them: a resume
    that would turn one on is refused, one without them resumes."""
    run = run_with_a_checkpoint(tmp_path)
    extras = ("model.logit_softcap", "model.embed_norm", "model.qk_scale", "model.mlp")
    old = {k: v for k, v in identity.identity(cfg(arch="modern"), None).items() if k not in extras}
    (run / names.LEDGER_NAME).write_text(json.dumps({"event": "start", "step": 0, "time": 0.0, "identity": old}) + "\n")
    identity.check_resume(run, cfg(arch="modern"), cfg(arch="modern"))
    with pytest.raises(ConfigError, match="model.mlp from 'swiglu' to 'relu2'"):
        identity.check_resume(run, cfg(arch="modern", mlp="relu2"), cfg(arch="modern"))


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


def recorded_run(tmp_path, c) -> Path:
    """A run directory whose ledger's start marker records `c`'s identity, with one checkpoint."""
    tmp_path.mkdir(exist_ok=True)
    run = run_with_a_checkpoint(tmp_path)
    start = {"event": "start", "step": 0, "time": 0.0, "identity": identity.identity(c, None)}
    (run / names.LEDGER_NAME).write_text(json.dumps(start) + "\n")
    return run


def test_a_branch_that_would_change_the_identity_is_refused_before_its_first_start_would_be(tmp_path):
    """Issue: `andrea branch --set train.optimizer=adamw` of a Muon run wrote a branch whose every start refused."""
    muon = configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon"}})
    parent = recorded_run(tmp_path, muon)
    identity.check_branch(parent, configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon", "lr": 1e-4}}))
    for changed, phrase in [(cfg(), "train.optimizer from 'muon' to 'adamw'"),
                            (configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon", "seed": 7}}),
                             "train.seed from 1337 to 7")]:
        with pytest.raises(ConfigError) as e:
            identity.check_branch(parent, changed)
        assert phrase in str(e.value) and "andrea export" in str(e.value) and "\n" not in str(e.value)


def test_init_from_a_checkpoint_of_a_run_that_meant_other_bytes_is_refused(tmp_path):
    """A Muon checkpoint's m is Muon's momentum: an AdamW run that read it as AdamW's m (v = 0) trained on garbage.
    The checkpoint's run says what its bytes mean; a seed of its own is the new run's; a file outside any run is
    taken on its parameter count alone."""
    muon = configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon"}})
    source = recorded_run(tmp_path / "muon", muon)
    checkpoint = source / names.checkpoint_name(1)
    identity.check_init_from(checkpoint, configload.from_dict({"model": SHAPE, "train": {"optimizer": "muon",
                                                                                        "seed": 7}}))
    for other, phrase in [(cfg(), "train.optimizer from 'muon' to 'adamw'"),
                          (configload.from_dict({"model": {**SHAPE, "arch": "modern"}, "train": {"optimizer": "muon"}}),
                           "model.arch from 'gpt2' to 'modern'")]:
        with pytest.raises(ConfigError) as e:
            identity.check_init_from(checkpoint, other)
        assert str(checkpoint) in str(e.value) and phrase in str(e.value) and "\n" not in str(e.value)
    alone = tmp_path / "kept"
    alone.mkdir()
    (alone / checkpoint.name).write_bytes(checkpoint.read_bytes())
    identity.check_init_from(alone / checkpoint.name, cfg())


def test_init_from_a_checkpoint_of_a_run_with_another_tokenizer_is_refused(tmp_path):
    """Issue 55, hole 1: a checkpoint's embedding rows are its tokenizer's ids; `--init-from` it under another
    tokenizer trained on garbage without a word. Refused in one line that names the file to train with instead,
    whether this run's tokenizer is known before the start (data.tokenizer, a prepared run) or trained by it."""
    source = tmp_path / "source"
    source.mkdir()
    run_with_a_checkpoint(source)
    theirs, ours = "a" * 64, "b" * 64
    start = {"event": "start", "step": 0, "time": 0.0, "identity": identity.identity(cfg(), theirs)}
    (source / names.LEDGER_NAME).write_text(json.dumps(start) + "\n")
    checkpoint = source / names.checkpoint_name(1)
    identity.check_init_from(checkpoint, cfg(), theirs)  # the same tokenizer
    identity.check_init_from(checkpoint, cfg(), None)  # not known yet: checked at the start
    identity.check_init_from_tokenizer(checkpoint, theirs)
    for check in (lambda: identity.check_init_from(checkpoint, cfg(), ours),
                  lambda: identity.check_init_from_tokenizer(checkpoint, ours)):
        with pytest.raises(ConfigError) as e:
            check()
        line = str(e.value)
        assert f"tokenizer.sha256 from '{theirs}' to '{ours}'" in line and "\n" not in line
        assert f"data.tokenizer={source / names.TOKENIZER_NAME}" in line
    # this run's tokenizer: the file data.tokenizer names, else its own tokenizer.json
    run = tmp_path / "run"
    run.mkdir()
    assert identity.run_tokenizer_sha256(run, cfg()) is None
    (run / names.TOKENIZER_NAME).write_bytes(b"ours")
    given = tmp_path / "given.json"
    given.write_bytes(b"given")
    import hashlib
    assert identity.run_tokenizer_sha256(run, cfg()) == hashlib.sha256(b"ours").hexdigest()
    named = configload.from_dict({"model": SHAPE, "data": {"tokenizer": str(given)}})
    assert identity.run_tokenizer_sha256(run, named) == hashlib.sha256(b"given").hexdigest()


def test_a_modern_run_is_not_held_to_a_bias_it_does_not_have(tmp_path):
    """model.bias means nothing to the modern model: a modern run recorded with the default (true), as every run
    before this rule was, resumes with bias = false; a gpt2 run does not."""
    modern = recorded_run(tmp_path / "modern", cfg(arch="modern"))
    assert "model.bias" not in identity.identity(cfg(arch="modern"), None)
    old = {**identity.identity(cfg(arch="modern"), None), "model.bias": True}  # what such runs recorded
    (modern / names.LEDGER_NAME).write_text(json.dumps({"event": "start", "step": 0, "time": 0.0, "identity": old})
                                            + "\n")
    identity.check_resume(modern, cfg(arch="modern", bias=False), cfg(arch="modern"))
    gpt2 = recorded_run(tmp_path / "gpt2", cfg())
    with pytest.raises(ConfigError, match="model.bias from True to False"):
        identity.check_resume(gpt2, cfg(bias=False), cfg())


def test_a_resume_may_not_switch_the_schedule_and_an_older_record_is_a_cosine_runs(tmp_path):
    """train.schedule is part of the identity: cosine ↔ wsd at a resume would jump the learning rate."""
    wsd = configload.from_dict({"model": SHAPE, "train": {"schedule": "wsd", "warmdown_steps": 100}})
    assert identity.identity(cfg(), None)["train.schedule"] == "cosine"
    assert identity.changes(identity.identity(wsd, None), identity.identity(cfg(), None)) == \
        ["train.schedule from 'wsd' to 'cosine'"]
    older = {k: v for k, v in identity.identity(cfg(), None).items() if k != "train.schedule"}
    assert identity.changes({**identity.BEFORE_RECORDED, **older}, identity.identity(wsd, None)) == \
        ["train.schedule from 'cosine' to 'wsd'"]
