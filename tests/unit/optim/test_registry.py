"""The optimizer registry (andrea/optim/registry.py): the schema checks train.optimizer against it and words its
error from it, docs/formats.md's m/v table is its output, and a new optimizer is one module and one registration:
a toy SGD registered here trains through the real Trainer with nothing else touched. In process, on the CPU."""

from __future__ import annotations

import pytest
import torch

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.schema import TrainConfig
from andrea.control.run.trainer import Trainer
from andrea.optim import registry
from andrea.optim.registry import Holds, Hyper, Optimizer


class Sgd:
    """A registered update in a dozen lines: w ← w − lr · g (the registry's calling convention)."""

    def __init__(self, layout, tc, adamw, kernels, device, lo=0, hi=None):
        pass

    def __call__(self, w, g, m, v, hp: Hyper):
        norm = torch.linalg.vector_norm(g)
        w.sub_(g, alpha=hp.lr)
        return norm


SGD = Optimizer("sgd", f"{__name__}:Sgd", (Holds("every one", "0", "0"),), ())


@pytest.fixture
def with_sgd(monkeypatch):
    monkeypatch.setitem(registry.OPTIMIZERS, "sgd", SGD)


def test_docs_formats_md_holds_the_registrys_table():
    assert registry.FORMATS.read_text() == registry.with_table(registry.FORMATS.read_text()), \
        "docs/formats.md's m/v table is stale: python -m andrea.optim.registry --write"
    assert "| `muon` |" in registry.mv_table() and "| `adamw` (default) |" in registry.mv_table()


def test_an_unknown_optimizer_is_refused_in_one_line_naming_every_registered_one(with_sgd):
    with pytest.raises(ConfigError) as e:
        TrainConfig(optimizer="lion")
    message = str(e.value)
    assert message.startswith("train.optimizer='lion' must be ") and "\n" not in message
    for name in ("adamw", "muon", "sgd"):
        assert name in message


def test_a_new_optimizer_is_one_registration_its_table_row_and_a_trainer_that_runs_it(with_sgd):
    assert "| `sgd` | every one | 0 | 0 |" in registry.mv_table()
    cfg = configload.load(preset="andrea-tiny", overrides=["train.optimizer=sgd", "train.grad_clip=0"])
    trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
    w0 = trainer.state.w.clone()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = trainer.train_step(0, x, torch.roll(x, -1, dims=1))
    assert torch.equal(trainer.state.w, w0.sub(trainer.state.grad, alpha=out.lr))  # SGD's step, bit for bit
    assert not trainer.state.m.any() and not trainer.state.v.any()


def test_the_hyper_parameters_are_adamws_keyword_arguments():
    hp = Hyper(3, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, progress=0.5)
    assert hp.adamw() == dict(step=3, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    assert hp.adamw(max_grad_norm=None)["max_grad_norm"] is None
