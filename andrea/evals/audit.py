"""Read-only looks at the model between steps: validation loss, sample audits and the task audit (`eval.tasks`).

All run on the training thread at a step boundary and leave training's state and randomness untouched:
evaluation uses a fixed set of held-out windows per arm (drawn from the EVAL stream keyed by the seed only,
so every eval of a run scores the same text), and sampling draws from its own generators keyed by
(seed, step, prompt). Cost is bounded: `train.eval_batches` forward passes per arm; per sample audit, one batched
prefill of all prompts and `sample.max_new_tokens - 1` one-token forwards through a KV cache (andrea/model/generate.py);
per task audit, one forward per `eval.batch_rows` endings of the first `eval.limit` examples (no gradient, eval
mode: the next step sets train mode again).

Sample randomness: prompt p at step S samples from its own torch generator seeded from (seed, S, SAMPLE_STREAM,
a 64-bit hash of p's text), so a prompt's draws do not depend on which other prompts are configured or their
order (its text can differ from a batch of one only by float rounding; see andrea/model/generate.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from andrea.evals import tasks as evaltasks
from andrea.config.check import ConfigError
from andrea.config.schema import RunConfig
from andrea.data.store import EVAL_STREAM, SAMPLE_STREAM, ArmTokens, TextCodec, rng_for, rows
from andrea.model.generate import DivergedModel
from andrea.control.run.trainer import Trainer

log = logging.getLogger("andrea.audit")


def evaluate(trainer: Trainer, arms: list[ArmTokens], cfg: RunConfig,
             beat: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Mean held-out loss per arm; `beat()` after each batch (the watchdog's heartbeat: progress inside one job)."""
    losses = {}
    B = cfg.train.batch_size
    for a, arm in enumerate(arms):
        rng = rng_for(cfg.train.seed, 0, EVAL_STREAM, a)
        total = 0.0
        for _ in range(cfg.train.eval_batches):
            x, y = rows(arms, np.full(B, a), cfg.model.block_size, rng, split="val")
            total += float(trainer.loss_of(x, y))
            beat()
        losses[arm.name] = total / cfg.train.eval_batches
    return losses


def target_loss(losses: dict[str, float], target: dict[str, float]) -> float:
    """The objective the data mixture serves (`policy.target`): Σ target[a]·losses[a] over the weighted arms."""
    return sum(target[a] * losses[a] for a in losses) / sum(target[a] for a in losses)


def prompt_generator(seed: int, step: int, prompt: str) -> torch.Generator:
    """The generator prompt `prompt` samples from at `step`: keyed by the prompt's text, not its index."""
    key = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(int(rng_for(seed, step, SAMPLE_STREAM, key).integers(2**62)))


def sample_audits(trainer: Trainer, codec: TextCodec, cfg: RunConfig, step: int) -> list[dict]:
    """One `.samples.json` entry per prompt: {"step", "prompt", "text"} (the continuation, prompt excluded); none,
    with a warning, for a model whose logits are not finite (the guard meets the divergence in the next step's
    loss and rolls back; an audit never ends the run)."""
    sc = cfg.sample
    prompts = [codec.encode(p) or [codec.eot] for p in sc.prompts]
    generators = [prompt_generator(cfg.train.seed, step, p) for p in sc.prompts]
    try:
        new = trainer.generate(prompts, sc.max_new_tokens, temperature=sc.temperature, top_k=sc.top_k,
                               generators=generators)
    except DivergedModel as e:
        log.warning("sample audit of step %d skipped: %s", step, e)
        return []
    return [{"step": step, "prompt": p, "text": codec.decode(ids)} for p, ids in zip(sc.prompts, new)]


class TaskAudit:
    """`eval.tasks` during training: the file read and tokenized once at the start (a missing or bad file refuses
    the start as a configuration error: ConfigError, exit 2), then scored on the live model at a step boundary
    (andrea/evals/tasks.py; its `tasks` marker fields)."""

    def __init__(self, path: Path, codec: TextCodec, cfg: RunConfig):
        try:  # the file is the configuration's: missing or bad, a restart cannot mend it (exit 2, not 1)
            taskfile = evaltasks.read_tasks(path)
            self.tasks = taskfile.tasks[:cfg.eval.limit] if cfg.eval.limit else taskfile.tasks
            self.codec = _Memo(codec)  # every audit scores the same text: its tokens once
            for task in self.tasks:  # an encoding problem (a context of no tokens) is said now, not at step 5,000
                evaltasks.encode_task(task, self.codec, str(path))
        except (OSError, evaltasks.TaskFileError) as e:
            raise ConfigError(f"eval.tasks: {e}") from None
        self.path, self.sha256 = path, taskfile.sha256
        self.block_size, self.batch_rows = cfg.model.block_size, cfg.eval.batch_rows

    @classmethod
    def configured(cls, cfg: RunConfig, codec: TextCodec) -> TaskAudit | None:
        """The run's audit when `eval.tasks` is set, made absolute (run.toml keeps it so, whatever the next start's
        working directory), read and tokenized now: a missing or bad file refuses the start before a step trains."""
        if not cfg.eval.tasks:
            return None
        path = Path(cfg.eval.tasks).expanduser().absolute()
        cfg.eval.tasks = str(path)
        return cls(path, codec, cfg)

    def __call__(self, trainer: Trainer, beat: Callable[[], None] = lambda: None) -> dict:
        """The scores of the live model; `beat()` after each forward (the watchdog's heartbeat)."""
        score = evaltasks.score_tasks(evaltasks.trainer_forward(trainer), self.codec, self.tasks, self.block_size,
                                      self.batch_rows, progress=lambda n: beat(), where=str(self.path))
        return {"acc": score.acc, "acc_norm": score.acc_norm, "acc_norm_chars": score.acc_norm_chars,
                "examples": len(self.tasks), "tasks": self.path.name, "sha256": self.sha256}


class _Memo:
    """An encoder that remembers: the task audit encodes the same contexts and endings at every step."""

    def __init__(self, codec):
        self.codec, self.seen = codec, {}

    def encode(self, text: str) -> list[int]:
        if text not in self.seen:
            self.seen[text] = self.codec.encode(text)
        return self.seen[text]
