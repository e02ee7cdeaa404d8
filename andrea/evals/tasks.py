"""Multiple-choice accuracy in HellaSwag's format: read a tasks file, score each ending by its log-likelihood.

Reads a JSON Lines file (`read_tasks`); writes nothing. `score_tasks` is the entry point for any caller holding a
model: `andrea eval` (commands/evaluate.py) with a checkpoint loaded into a Trainer, and the trainer itself at a
step boundary, with its live model (`trainer_forward`). No dataset is downloaded: the user supplies the file, e.g.
llm.c's `hellaswag_val.jsonl` (10,042 examples) or one of their own.

The file, UTF-8 (a byte-order mark at its start is allowed), one JSON object per line of at most 1 MiB
(MAX_LINE_BYTES; blank lines are skipped; other keys, such as HellaSwag's `ind`,
`activity_label`, `ctx_a`, `ctx_b`, `split`, `source_id`, are ignored):
    ctx       str, non-empty         the context
    endings   list of >= 2 str       the candidate continuations, each non-empty
    label     int, or a str of digits (as in the Hugging Face copies)   the index of the correct ending
A bad line is one error naming the file, the line number and the problem (`TaskFileError`).

Scoring (as llm.c's hellaswag.py and lm-evaluation-harness do): ending i is tokenized as " " + endings[i] (a leading
space) and appended to the context's tokens, with no separator token before the context. Its score is the sum of
log p(token | all tokens before it) over the ending's tokens, in fp32 from the model's logits (summed in fp64).
Three predictions per example, each the highest-scoring ending (a tie goes to the lower index):
    acc             the sum of log-probs (lm-evaluation-harness's `acc`, llm.c's `acc`)
    acc_norm        the sum divided by the ending's number of tokens, i.e. the lowest mean per-token loss:
                    llm.c's `acc_norm`, the number its GPT-2 reproductions report against training steps
    acc_norm_chars  the sum divided by the ending's length in characters (Python str length of endings[i], without
                    the leading space): lm-evaluation-harness's `acc_norm`, which runs the text through its own
                    preprocessing first (dropping " [title]" and bracketed tags): equal on text it leaves unchanged
Longer than the model's window: a row is the rightmost block_size tokens of context + ending, so the context
is truncated on the left. Every ending token with a predecessor in the row is scored; should an ending alone exceed
block_size - 1 tokens (never in HellaSwag at GPT-2's 1024), its first tokens fall out of the row and are not scored,
and acc_norm divides by the tokens that were.

Batches: an example's endings are rows of one forward, and several whole examples share a forward of at most
`batch_size` rows (an example with more endings than that has a forward of its own). Rows are right-padded with
token 0 to the batch's longest row. The model is causal, so a real token never attends to padding after it, and
only scored positions' logits enter a score: padding changes no score beyond float rounding of a wider matmul.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

import torch

from andrea.data.sources import DataError

if TYPE_CHECKING:
    from andrea.control.run.trainer import Trainer

ModelForward = Callable[[torch.Tensor], torch.Tensor]  # idx (B, T) int64 → logits (B, T, V), on any device
FIELDS = ("ctx", "endings", "label")
MAX_LINE_BYTES = 1 << 20  # one example's line: HellaSwag's longest is ~1.5 kB


class TaskFileError(DataError):
    """A tasks file that cannot be read as multiple-choice examples: one line naming the file (and line)."""


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Task:
    """One multiple-choice example as the file gives it."""

    line: int  # 1-based line number in the file
    context: str
    endings: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Row:
    """One (example, ending) sequence: its tokens (<= block_size) and where its scored tokens start."""

    tokens: tuple[int, ...]
    first: int  # index of the first scored token (>= 1: position 0 has no prediction)


@dataclass(frozen=True)
class ExampleScore:
    """An example's per-ending scores, and its three predictions."""

    line: int
    label: int
    logprob: tuple[float, ...]  # summed log-probability of each ending's scored tokens
    n_tokens: tuple[int, ...]  # tokens scored per ending
    n_chars: tuple[int, ...]  # characters per ending (without the leading space)

    @property
    def pred(self) -> int:
        return argmax(self.logprob)

    @property
    def pred_norm(self) -> int:
        return argmax([lp / n for lp, n in zip(self.logprob, self.n_tokens)])

    @property
    def pred_norm_chars(self) -> int:
        return argmax([lp / n for lp, n in zip(self.logprob, self.n_chars)])


@dataclass(frozen=True)
class TaskScore:
    """The scores of every example, in file order, and the accuracies over them."""

    examples: tuple[ExampleScore, ...]

    def _share(self, attr: str) -> float:
        return sum(getattr(e, attr) == e.label for e in self.examples) / len(self.examples)

    @property
    def acc(self) -> float:
        return self._share("pred")

    @property
    def acc_norm(self) -> float:
        return self._share("pred_norm")

    @property
    def acc_norm_chars(self) -> float:
        return self._share("pred_norm_chars")

    def summary(self) -> dict:
        return {"examples": len(self.examples), "acc": self.acc, "acc_norm": self.acc_norm,
                "acc_norm_chars": self.acc_norm_chars}


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value; the lowest such index on a tie."""
    return max(range(len(values)), key=values.__getitem__)


# --- the file ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskFile:
    """A tasks file as read: where, what it holds, and the sha256 of its bytes (which file a score is of)."""

    path: Path
    tasks: tuple[Task, ...]
    sha256: str


def read_tasks(path: Path) -> TaskFile:
    """Every example of a tasks file; refused in one line naming the file (and the line) when bad."""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a tasks file (JSON Lines)")
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (the tasks file, JSON Lines)") from None
    except OSError as e:
        raise OSError(f"{path}: cannot read the tasks file: {e.strerror}") from None
    digest = hashlib.sha256()
    with f:
        try:
            tasks = parse_tasks(text_lines(f, digest, str(path)), str(path))
        except OSError as e:
            raise OSError(f"{path}: cannot read the tasks file: {e.strerror}") from None
    return TaskFile(path, tuple(tasks), digest.hexdigest())


def text_lines(f: BinaryIO, digest, where: str) -> Iterator[str]:
    """The file's lines as text, each read no further than MAX_LINE_BYTES (a longer one is refused: it is no
    example, and would cost memory many times its size), fed to `digest` as read. UTF-8, a byte-order mark at
    the start allowed (as editors on Windows save it); a line that is not UTF-8 is named."""
    for n in itertools.count(1):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        digest.update(raw)
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise TaskFileError(f"{where}:{n}: longer than {MAX_LINE_BYTES >> 20} MiB (an example is a context and "
                                "a few endings: a few kB)")
        if n == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TaskFileError(f"{where}:{n}: not UTF-8 text (byte {e.start} of the line)") from None


def parse_tasks(lines: Iterable[str], where: str) -> list[Task]:
    """The examples of the file's lines, blank ones skipped; `where` names the file in errors."""
    tasks = [parse_line(line, n, where) for n, line in enumerate(lines, 1) if line.strip()]
    if not tasks:
        raise TaskFileError(f"{where}: no examples (the file is empty; one JSON object per line expected)")
    return tasks


def parse_line(line: str, n: int, where: str) -> Task:
    at = f"{where}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{at}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TaskFileError(f"{at}: a JSON {type(obj).__name__}, where an object with ctx, endings and label is "
                            "expected")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise TaskFileError(f"{at}: no {', '.join(repr(f) for f in missing)} field (each example needs ctx, "
                            "endings and label)")
    ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
    if not isinstance(ctx, str) or not ctx:
        raise TaskFileError(f"{at}: 'ctx' must be a non-empty string, got {_shown(ctx)}")
    if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
        raise TaskFileError(f"{at}: 'endings' must be a list of strings, got {_shown(endings)}")
    if len(endings) < 2:
        raise TaskFileError(f"{at}: {len(endings)} ending(s): a multiple-choice example needs at least 2")
    empty = [i for i, e in enumerate(endings) if not e]
    if empty:
        raise TaskFileError(f"{at}: ending {empty[0]} is empty")
    if isinstance(label, str) and label.isascii() and label.isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        raise TaskFileError(f"{at}: 'label' must be an integer (or a string of digits), got {_shown(label)}")
    if not 0 <= label < len(endings):
        raise TaskFileError(f"{at}: label {label} out of range for {len(endings)} endings (0..{len(endings) - 1})")
    return Task(n, ctx, tuple(endings), label)


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


# --- rows and batches ------------------------------------------------------------------------------------------
def encode_task(task: Task, codec: Encoder, where: str = "tasks") -> tuple[list[int], list[list[int]]]:
    """(context tokens, each ending's tokens), the ending encoded with its leading space; TaskFileError naming
    `where` and the line when the context encodes to no tokens (the first ending token would have nothing to be
    predicted from)."""
    context = codec.encode(task.context)
    if not context:
        raise TaskFileError(f"{where}:{task.line}: 'ctx' {_shown(task.context)} encodes to no tokens with this "
                            "tokenizer")
    return context, [codec.encode(" " + e) for e in task.endings]


def task_rows(context: list[int], endings: list[list[int]], block_size: int) -> list[Row]:
    """One row per ending: the rightmost block_size tokens of context + ending (the context cut on the left)."""
    rows = []
    for ending in endings:
        tokens = context + ending
        cut = max(0, len(tokens) - block_size)
        rows.append(Row(tuple(tokens[cut:]), max(len(context) - cut, 1)))
    return rows


def plan_batches(rows_per_example: Sequence[int], batch_size: int) -> list[range]:
    """Consecutive examples packed greedily into forwards of at most batch_size rows (at least one example each)."""
    batches, start, rows = [], 0, 0
    for i, n in enumerate(rows_per_example):
        if i > start and rows + n > batch_size:
            batches.append(range(start, i))
            start, rows = i, 0
        rows += n
    if start < len(rows_per_example):
        batches.append(range(start, len(rows_per_example)))
    return batches


def pad_rows(rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """idx (B, W) right-padded with token 0, and scored (B, W - 1): True where position t + 1 is a scored token
    (so logits[:, t] predict it)."""
    width = max(len(r.tokens) for r in rows)
    idx = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), max(width - 1, 0), dtype=torch.bool)
    for i, r in enumerate(rows):
        idx[i, :len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        scored[i, r.first - 1:len(r.tokens) - 1] = True
    return idx, scored


def row_logprobs(logits: torch.Tensor, idx: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its scored tokens (B,) fp64 and how many there are (B,).

    Only the scored positions' logits are read, so padding and context positions never enter a score."""
    B = idx.shape[0]
    scored = scored.to(logits.device)
    picked = logits[:, :-1][scored].float()  # (N, V): the logits that predict a scored token
    targets = idx.to(logits.device)[:, 1:][scored]  # (N,)
    logp = torch.log_softmax(picked, dim=-1).gather(1, targets[:, None]).squeeze(1)  # (N,) fp32
    rows = scored.nonzero()[:, 0]  # (N,) the row of each scored token
    sums = torch.zeros(B, dtype=torch.float64, device=logits.device).index_add_(0, rows, logp.double())
    return sums.cpu(), scored.sum(dim=1).cpu()


# --- scoring ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def score_tasks(model_forward: ModelForward, codec: Encoder, tasks: Sequence[Task], block_size: int,
                batch_size: int = 32, progress: Callable[[int], None] | None = None,
                where: str = "tasks") -> TaskScore:
    """Score every example (module docstring) with `model_forward` (idx (B, T) int64 on CPU → logits (B, T, V);
    it moves idx to its device) and `codec` (the run's tokenizer: anything with encode(str) -> list[int]).

    `batch_size` bounds the rows per forward (logits of batch_size x block_size x V floats); `progress`, if given,
    is called with the number of examples done after each forward; `where` names the file in errors. Runs under
    torch.no_grad(); the caller puts the model in eval mode (`trainer_forward` does)."""
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: scoring needs room for a context token and an ending token")
    per_task = []
    for t in tasks:
        per_task.append(task_rows(*encode_task(t, codec, where), block_size))
    out: list[ExampleScore] = []
    for batch in plan_batches([len(r) for r in per_task], max(1, batch_size)):
        rows = [row for i in batch for row in per_task[i]]
        idx, scored = pad_rows(rows)
        sums, counts = row_logprobs(model_forward(idx), idx, scored)
        at = 0
        for i in batch:
            k, task = len(per_task[i]), tasks[i]
            out.append(ExampleScore(task.line, task.label, tuple(sums[at:at + k].tolist()),
                                    tuple(counts[at:at + k].tolist()), tuple(len(e) for e in task.endings)))
            at += k
        if progress is not None:
            progress(len(batch))
    return TaskScore(tuple(out))


def model_forward(model: torch.nn.Module, device: torch.device,
                  autocast: AbstractContextManager | None = None) -> ModelForward:
    """A GPT (andrea/model/gpt.py) as a ModelForward: eval mode (dropout off), idx moved to `device`, under `autocast`
    (the trainer's bf16 autocast on CUDA) if given."""

    def forward(idx: torch.Tensor) -> torch.Tensor:
        model.eval()
        with autocast if autocast is not None else nullcontext():
            return model(idx.to(device))[0]  # (B, T, V)

    return forward


def trainer_forward(trainer: Trainer) -> ModelForward:
    """The live model of a Trainer (andrea/control/run/trainer.py) as a ModelForward, for a score at a step boundary: its
    device and autocast, eval mode (the next train_step sets train mode again), no gradient, no state written."""
    return model_forward(trainer.model, trainer.device, trainer.autocast)
