"""`andrea eval RUN_DIR --tasks FILE.jsonl [--step S] [--json]`: a checkpoint's multiple-choice accuracy.

Reads the run's `run.toml`, one checkpoint (step_S.bin, or the newest that passes deep validation: the choice
`andrea export` makes, export.pick_checkpoint), the run's tokenizer (export.tokenizer_source: `tokenizer.json`, or
the file `data.tokenizer` names) and the tasks file; writes nothing, so it is safe beside a running trainer. The
file's format and the scores are andrea/evals/tasks.py's. The model runs with torch's math (no Triton) on the
device the run trains on (`train.device`, or --device), under the trainer's bf16 autocast on CUDA.

stdout, one line:
    step 300  examples 40  acc 0.9750  acc_norm 0.9750  acc_norm_chars 0.9500  (tasks FILE)
or, with --json, one object: step, checkpoint (its file name), examples, acc, acc_norm, acc_norm_chars, tasks (the
path as given), sha256 (of the tasks file's bytes), device. Progress goes to stderr (progress.CountProgress).
Refusals are one `andrea: error:` line, exit 1, in this order: no such run directory or not a run; a missing or
unreadable tasks file, a line that is not an example (its number named), an empty file; --step without that
checkpoint, no valid checkpoint; a run without a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from andrea.config import load as configload
from andrea.control.run import devices
from andrea.config.outputs import EvalConfig
from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.data.codec import TextCodec
from andrea.evals.tasks import TaskFile, TaskScore, read_tasks, score_tasks, trainer_forward
from andrea.model.export import pick_checkpoint, tokenizer_source
from andrea.model.arch import layout_for
from andrea.model.gpt import n_params
from andrea.control.observe.progress import CountProgress
from andrea.rundir import checkpoint as ckpt
from andrea.control.run.trainer import Trainer

log = logging.getLogger("andrea.eval")
DEFAULT_BATCH_ROWS = EvalConfig.batch_rows  # 32 rows (8 HellaSwag examples); logits (32, ~100, V): 0.64 GB fp32


@dataclass(frozen=True)
class Evaluation:
    """What `andrea eval` measured: which checkpoint, which file, on which device, and the scores."""

    step: int
    checkpoint: Path
    tasks: TaskFile
    device: str
    score: TaskScore

    def as_dict(self) -> dict:
        return {"step": self.step, "checkpoint": self.checkpoint.name, **self.score.summary(),
                "tasks": str(self.tasks.path), "sha256": self.tasks.sha256, "device": self.device}

    def line(self) -> str:
        s = self.score
        return (f"step {self.step}  examples {len(s.examples)}  acc {s.acc:.4f}  acc_norm {s.acc_norm:.4f}  "
                f"acc_norm_chars {s.acc_norm_chars:.4f}  (tasks {self.tasks.path})")


def evaluate_run(run_dir: Path, tasks_path: Path, step: int | None = None, *, device: str | None = None,
                 batch_size: int = DEFAULT_BATCH_ROWS, show_progress: bool = True) -> Evaluation:
    """Score a run's checkpoint on a tasks file (module docstring); `device` None: the run's train.device."""
    cfg = configload.run_config(run_dir)  # no such directory / not a run: one line naming it
    tasks = read_tasks(tasks_path)
    path = pick_checkpoint(run_dir, _n_params(cfg), step, purpose="evaluate")
    source = tokenizer_source(cfg, run_dir)
    if source is None:
        raise FileNotFoundError(f"{run_dir}: every arm is pre-tokenized, so the run has no tokenizer to encode "
                                f"{tasks_path}'s text")
    if not source.exists():
        raise FileNotFoundError(f"{source}: the run's tokenizer is missing")
    codec = TextCodec.load(source)
    device_type, _ = devices.resolve(device or cfg.train.device, "torch")
    trainer = Trainer(cfg, torch.device(device_type), kernels="torch")
    header_step, payload = ckpt.read_payload(path, trainer.n)
    trainer.load(torch.from_numpy(payload))
    progress = CountProgress(len(tasks.tasks), "eval", "examples") if show_progress else None
    t0 = time.monotonic()
    try:
        score = score_tasks(trainer_forward(trainer), codec, tasks.tasks, cfg.model.block_size, batch_size,
                            progress, where=str(tasks_path))
    finally:
        if progress is not None:
            progress.close()
    elapsed = time.monotonic() - t0
    log.info("eval: %s (step %d) on %d examples of %s in %.1f s (%.1f examples/s, %s)", path.name, header_step,
             len(tasks.tasks), tasks_path, elapsed, len(tasks.tasks) / max(elapsed, 1e-9), device_type)
    return Evaluation(header_step, path, tasks, device_type, score)


def _n_params(cfg: RunConfig) -> int:
    return n_params(layout_for(cfg.model))


def cmd_eval(args: argparse.Namespace) -> int:
    rows = DEFAULT_BATCH_ROWS if args.batch_size is None else args.batch_size
    if rows < 1:
        raise ConfigError(f"--batch-size {rows}: must be >= 1")
    result = evaluate_run(Path(args.run_dir), Path(args.tasks), args.step, device=args.device, batch_size=rows)
    print(json.dumps(result.as_dict()) if args.json else result.line())
    return 0
