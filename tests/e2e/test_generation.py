"""Batched KV-cached generation (andrea/model/generate.py) against the uncached loop it replaced, and the sample audits
built on it.

Tolerance: the cached and uncached forwards are the same math in different summation orders, so neither is
"the" answer; both are compared with an fp64 forward of the same weights on the same tokens (teacher-forced),
and the cached path must be as accurate as the uncached one it replaces: its worst error at most 4x the uncached
path's worst error. Both are fp32 rounding amplified by the same network (measured, one thread: 2.6e-5 vs 2.2e-5
over 9 tokens, 1.35e-4 vs 1.6e-4 over 70, on logits up to ~16: ratios 0.8-1.2), while a wrong position, mask or
cache slot is off by O(1) (positions not shifted by the padding: 20; the padding mask dropped: the test below).
The weights are the tiny preset's initialisation x5 so that attention is far from uniform and positions matter
(at init, std 0.02, every logit is ~0 and a broken cache would hardly show).
"""

import json

import pytest
import torch

from andrea.evals import audit
from andrea.config import load as configload
from andrea.model import generate as generation
from andrea.data.store import TextCodec
from andrea.model.gpt import GPT
from andrea.control.run.trainer import Trainer
from tests.runs import seed_data, train

PROMPTS = [[11, 2, 3], [7], [5, 6, 7, 8, 9, 10, 11]]  # odd, unequal lengths, the longest neither first nor last


def sharp_trainer(kernels: str = "torch") -> Trainer:
    trainer = Trainer(configload.load(preset="andrea-tiny"), torch.device("cpu"), kernels)
    with torch.no_grad():
        trainer.state.w.mul_(5.0)
    trainer.model.eval()
    return trainer


def fp64_copy(trainer: Trainer) -> GPT:
    model = GPT(trainer.cfg.model).double().eval()
    model.load_state_dict({k: v.double() for k, v in trainer.model.state_dict().items()})
    return model


def forced(n_new: int, seed: int = 0) -> list[list[int]]:
    return torch.randint(0, 512, (len(PROMPTS), n_new), generator=torch.Generator().manual_seed(seed)).tolist()


def teacher(tokens: list[list[int]], seen: list[torch.Tensor]) -> generation.Pick:
    """A pick that records every step's logits and feeds the given continuation, so all paths see the same text."""
    def pick(logits: torch.Tensor) -> list[int]:
        seen.append(logits.double().clone())
        return [row[len(seen) - 1] for row in tokens]
    return pick


def logits_of(decode, model, n_new: int, tokens: list[list[int]]) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    out = decode(model, PROMPTS, n_new, teacher(tokens, seen))
    assert out == tokens
    return torch.stack(seen)  # (n_new, B, V)


@pytest.mark.parametrize("n_new", [9, 70])  # 70: rows of 7 + 70 and 3 + 70 tokens cross block_size 64
def test_cached_logits_match_the_uncached_loop_within_its_own_rounding(n_new):
    trainer = sharp_trainer()
    tokens = forced(n_new)
    cached = logits_of(generation.decode, trainer.model, n_new, tokens)
    uncached = logits_of(generation.decode_uncached, trainer.model, n_new, tokens)
    exact = logits_of(generation.decode_uncached, fp64_copy(trainer), n_new, tokens)
    err_cached, err_uncached = (cached - exact).abs().max(), (uncached - exact).abs().max()
    assert exact.abs().max() > 5  # sharp enough for positions and masks to matter
    assert err_uncached < 1e-3 and err_cached <= 4 * err_uncached, (err_cached, err_uncached)


def test_a_broken_cache_is_caught_by_that_tolerance(monkeypatch):
    """The tolerance above is meaningful: dropping the padding mask (padding keys attended) fails it."""
    trainer = sharp_trainer()
    tokens = forced(9)
    exact = logits_of(generation.decode_uncached, fp64_copy(trainer), 9, tokens)
    real_init = generation.KVCache.__init__

    def no_padding_mask(self, *args):
        real_init(self, *args)
        self.valid.fill_(True)

    monkeypatch.setattr(generation.KVCache, "__init__", no_padding_mask)
    broken = logits_of(generation.decode, trainer.model, 9, tokens)
    assert (broken - exact).abs().max() > 1e-2


def test_cached_logits_match_under_the_triton_kernels():
    """--kernels triton: the cache path runs the Triton LayerNorm and torch attention; the reference the Triton
    attention kernel. Short sequences: the kernels run in the interpreter on CPU."""
    trainer = sharp_trainer("triton")
    tokens = forced(4)
    cached = logits_of(generation.decode, trainer.model, 4, tokens)
    uncached = logits_of(generation.decode_uncached, trainer.model, 4, tokens)
    exact = logits_of(generation.decode_uncached, fp64_copy(trainer), 4, tokens)
    err_cached, err_uncached = (cached - exact).abs().max(), (uncached - exact).abs().max()
    assert err_uncached < 1e-3 and err_cached <= 4 * err_uncached, (err_cached, err_uncached)


def test_cached_generation_under_bf16_autocast():
    """The cache takes c_attn's dtype (bf16 under autocast, as on CUDA); its error is the uncached path's."""
    trainer = sharp_trainer()
    tokens = forced(12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = logits_of(generation.decode, trainer.model, 12, tokens)
        uncached = logits_of(generation.decode_uncached, trainer.model, 12, tokens)
    exact = logits_of(generation.decode_uncached, fp64_copy(trainer), 12, tokens)
    err_cached, err_uncached = (cached - exact).abs().max(), (uncached - exact).abs().max()
    assert err_cached <= 4 * err_uncached and err_cached < 0.1 * exact.abs().max(), (err_cached, err_uncached)


def test_generation_leaves_training_bit_identical_and_its_thread_count_alone():
    threads = torch.get_num_threads()
    a, b = (Trainer(configload.load(preset="andrea-tiny"), torch.device("cpu")) for _ in range(2))
    x = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    try:
        torch.set_num_threads(2)
        for t in (a, b):
            t.train_step(0, x, x)
        a.generate(PROMPTS, 70, temperature=0.8, top_k=40, generators=generators(0))  # decodes on one thread
        assert torch.get_num_threads() == 2
        for t in (a, b):
            t.train_step(1, x.flip(0), x.flip(0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a.state.buffer, b.state.buffer)


def generators(seed: int, n: int = len(PROMPTS)) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(n)]


def test_greedy_cached_generation_equals_the_uncached_loop_token_for_token():
    trainer = sharp_trainer()
    greedy = generation.sampler(0.8, 1, generators(0))
    reference = generation.decode_uncached(trainer.model, PROMPTS, 70, greedy)
    assert trainer.generate(PROMPTS, 70, temperature=0.8, top_k=1, generators=generators(0)) == reference
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # not a degenerate constant continuation


def test_sampling_is_deterministic_per_seed_and_independent_of_batch_mates():
    trainer = sharp_trainer()
    kw = dict(temperature=1.0, top_k=40)
    first = trainer.generate(PROMPTS, 30, generators=generators(5), **kw)
    assert trainer.generate(PROMPTS, 30, generators=generators(5), **kw) == first
    assert trainer.generate(PROMPTS, 30, generators=generators(6), **kw) != first
    # The middle prompt alone, with the generator it had in the batch: the same text.
    alone = trainer.generate([PROMPTS[1]], 30, generators=generators(5)[1:2], **kw)
    assert alone == first[1:2]


def test_sampled_cached_generation_equals_the_uncached_loop():
    trainer = sharp_trainer()
    reference = generation.decode_uncached(trainer.model, PROMPTS, 40, generation.sampler(1.0, 40, generators(3)))
    assert trainer.generate(PROMPTS, 40, temperature=1.0, top_k=40, generators=generators(3)) == reference


def test_sample_audits_keep_their_format_and_key_each_prompt_by_its_text(prepared):
    codec = TextCodec.load(prepared / "tokenizer.json")
    cfg = configload.load(preset="andrea-tiny", overrides=['sample.prompts=["def ", "The ", ""]'])
    trainer = sharp_trainer()
    audits = audit.sample_audits(trainer, codec, cfg, 7)
    assert [sorted(a) for a in audits] == [["prompt", "step", "text"]] * 3
    assert [a["prompt"] for a in audits] == ["def ", "The ", ""] and all(a["step"] == 7 for a in audits)
    assert all(isinstance(a["text"], str) and a["text"] for a in audits)
    assert audit.sample_audits(trainer, codec, cfg, 7) == audits
    assert audit.sample_audits(trainer, codec, cfg, 8) != [{**a, "step": 8} for a in audits]
    alone = configload.load(preset="andrea-tiny", overrides=['sample.prompts=["The "]'])
    assert audit.sample_audits(trainer, codec, alone, 7) == audits[1:2]


def test_a_diverged_model_is_no_sample_audit_and_no_traceback(prepared, caplog):
    """Weights grown past float range (a finite learning rate far too large) give inf logits: the audit at that
    checkpoint is skipped with a warning, where the sampler's multinomial used to end the run with a traceback.
    The guard meets the divergence in the next step's loss."""
    codec = TextCodec.load(prepared / "tokenizer.json")
    cfg = configload.load(preset="andrea-tiny")
    trainer = sharp_trainer()
    with torch.no_grad():
        trainer.state.w.mul_(1e30)  # finite weights, infinite logits
    with pytest.raises(generation.DivergedModel, match="logits are not finite"):
        trainer.generate(PROMPTS, 3, temperature=1.0, top_k=0, generators=generators(0))
    with caplog.at_level("WARNING", logger="andrea.audit"):
        assert audit.sample_audits(trainer, codec, cfg, 7) == []
    assert "sample audit of step 7 skipped: the model's next-token logits are not finite" in caplog.text


def test_samples_sidecar_written_by_a_run_has_the_documented_format(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    result = train(run, "--steps", "2", "--set", "sample.every=1")
    assert result.returncode == 0, result.stderr
    doc = json.loads((run / ".samples.json").read_text())
    assert list(doc) == ["audits"]
    assert [(a["step"], a["prompt"]) for a in doc["audits"]] == [(1, "def "), (1, "The "), (2, "def "), (2, "The ")]
    assert all(sorted(a) == ["prompt", "step", "text"] and isinstance(a["text"], str) for a in doc["audits"])
