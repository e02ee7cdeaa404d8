"""The training engine: the model bound to the flat `[w | m | v]` state, one step at a time.

Owns device memory only; reads and writes no files (checkpoints, ledger and sidecars belong to the control
plane). Everything a step does is a pure function of (config, seed, step, batch, state), which is what makes
a resumed run bit-identical to one that never stopped:
- the learning rate comes from the step (`lr_at`), never from a counter that could drift;
- the AdamW bias correction uses step + 1, the header step of the checkpoint the update produces;
- the optimizer (`train.optimizer`, andrea/optim/registry.py: AdamW over the whole flat buffer, Muon on the hidden
  matrices and AdamW on the rest, ...; `update_fn`), each a pure function of the state and the step;
- dropout (off by default) draws from a generator seeded by (seed, step).

Memory layout: `state.buffer` is ONE fp32 tensor of 3·n = [weights | m | v]; model parameters are views into
its first third and their .grad views into `state.grad`. A checkpoint is a copy of `state.buffer` behind an
8-byte header, taken while the next step's forward and backward run (`snapshot`): on a CUDA copy stream, or on
CPU on the trainer's one helper thread (`andrea-snapshot`); the next optimizer update waits for it. On CUDA the
forward runs under bf16 autocast while the masters stay fp32.

Micro-batches (`train.micro_batch_size`): a step runs its B rows (B/P per rank) as consecutive slices of b rows,
each slice's backward adding d(Σ slice losses / B)/dw into the same flat gradient, then ONE optimizer update: the
gradient is the plain run's up to summation order (the per-row math is the same; only the weight gradients' sums
over rows are split in B/b parts). The step is atomic for the control plane: it runs every slice or, when a
slice raises, none of the update. `"auto"` starts from the whole batch and, on the first step only, answers an
out-of-memory error by halving b and running the step again from a zeroed gradient (memory.next_micro_batch);
the choice is left in `micro_batch_choice` for the control plane to record (run.toml, the ledger).
Test hook (andrea/testhooks.py): `ANDREA_TEST_OOM_ROWS=<rows>` makes a pass over more rows than that raise torch.OutOfMemoryError after
its forward (an injected CUDA out-of-memory, on any device); never in production.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from andrea import testhooks
from andrea.control.run import allocator
from andrea.model import generate as generation
from andrea.model import memory
from andrea.config.schema import RunConfig, TrainConfig
from andrea.config.check import ConfigError
from andrea.data.store import DROPOUT_STREAM, rng_for
from andrea.model import arch
from andrea.model.gpt import ModelMath, ParamSpec, bind_flat, decay_mask, n_params, param_layout
from andrea.model.modern import split_heads
from andrea.optim import registry
from andrea.optim.registry import Hyper
from andrea.optim.schedule import decay_progress, lr_at  # noqa: F401 (lr_at: the trainer's schedule, imported from here)

log = logging.getLogger("andrea.control.run.trainer")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available")
    return torch.device(name)


def resolve_kernels(name: str, device: torch.device) -> str:
    return ("triton" if device.type == "cuda" else "torch") if name == "auto" else name


class FlatState:
    """The fp32 masters: `buffer` = [w | m | v] (3·n), and the gradient `grad` (n)."""

    def __init__(self, n: int, device: torch.device):
        self.n = n
        self.buffer = torch.zeros(3 * n, dtype=torch.float32, device=device)
        self.w, self.m, self.v = self.buffer.split(n)
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)


class HostCopy:
    """The CPU counterpart of a CUDA event on the copy stream: a snapshot running on the trainer's copy thread."""

    def __init__(self, future: Future):
        self.future = future

    def synchronize(self) -> None:
        self.future.result()

    def query(self) -> bool:
        return self.future.done()


def _copy_into(dests: tuple[torch.Tensor, ...], srcs: tuple[torch.Tensor, ...]) -> None:
    for dst, src in zip(dests, srcs):
        dst.copy_(src)


Fence = torch.cuda.Event | HostCopy


@dataclass
class StepOutput:
    """What one step leaves on the device; the control plane copies it to the host without a sync."""

    step: int  # header step after this update
    lr: float
    loss: torch.Tensor  # () mean loss of the batch
    grad_norm: torch.Tensor  # () pre-clip global gradient norm
    seq_losses: torch.Tensor  # (B,) per-sequence mean loss, for the data bandit


class Trainer:
    def __init__(self, cfg: RunConfig, device: torch.device, kernels: str = "torch"):
        self.cfg = cfg
        self.device = device
        self.kernels = kernels
        if device.type == "cpu":
            allocator.keep_freed_memory()  # each step reuses the last one's memory (andrea/control/run/allocator.py)
        with torch.device("meta"):
            self.model = arch.build(cfg.model, _model_math(kernels))  # GPT or Modern (model.arch)
        self.layout: list[ParamSpec] = param_layout(self.model)
        self.n = n_params(self.layout)
        self.state = FlatState(self.n, device)
        self.state.w.copy_(arch.init_weights(self.layout, cfg.model, cfg.train.seed))
        bind_flat(self.model, self.state.w, self.state.grad)
        self.model.to(device)  # buffers only: parameters already live in the flat state
        self.decay = decay_mask(self.layout, device)
        self.update = update_fn(cfg.train, self.layout, kernels, device)  # update(w, g, m, v, hp), any optimizer
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext())
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CPU: snapshots copy on their own thread while the next forward and backward run (see snapshot).
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="andrea-snapshot") if device.type != "cuda" else None
        self._snapshot_done: Fence | None = None
        # The guard's remedy (control/guard/decisions.py): lr = lr_at(step) · lr_scale; saved beside every checkpoint.
        self.lr_scale = 1.0
        self.model.checkpoint_blocks = cfg.train.activation_checkpointing == "blocks"
        self.micro_batch: int | None = None  # rows per pass, fixed at the first step (per rank)
        self._auto = cfg.train.micro_batch_size == "auto"  # until the first step has run
        self.micro_batch_choice: dict | None = None  # what "auto" chose, for the control plane to record
        self._oom_rows = testhooks.oom_rows()  # test hook ANDREA_TEST_OOM_ROWS (andrea/testhooks.py)

    # --- state -------------------------------------------------------------------------------------------
    def weights(self) -> torch.Tensor:
        """The weights this process holds, (n,) fp32 (under ZeRO-1 every rank's full copy)."""
        return self.state.w[:self.n]

    def load(self, payload: torch.Tensor) -> None:
        """Replace [w | m | v] from a host fp32 tensor of length 3·n (a checkpoint's payload)."""
        self._wait_snapshot()  # never overwrite the state under a snapshot still copying it
        self.state.buffer.copy_(payload.to(self.device))

    def snapshot(self, staging: torch.Tensor) -> Fence:
        """Start copying [w | m | v] into `staging` (host, pinned on CUDA); return the fence the writer waits on.

        The copy overlaps the next forward and backward, which only read w; only the next optimizer update,
        which writes w, m and v, waits for it (`_wait_snapshot`). On CUDA it runs on a side stream (an event);
        on CPU on the trainer's copy thread (a HostCopy), so the training loop's stall is the hand-off, not
        the memcpy. `staging` is the writer's fp32 view at byte 8 of an aligned file image (control/commit/writer.py):
        the copy lands where the checkpoint's payload sits in the file, and the image goes to disk as is.
        """
        return self._start_copy((staging,), (self.state.buffer,))

    def _start_copy(self, dests: tuple[torch.Tensor, ...], srcs: tuple[torch.Tensor, ...]) -> Fence:
        self._wait_snapshot()  # one snapshot in flight: a second waits for the first (same state, same order)
        if self._copy_stream is None:
            fence: Fence = HostCopy(self._copier.submit(_copy_into, dests, srcs))
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                for dst, src in zip(dests, srcs):
                    dst.copy_(src, non_blocking=True)
                fence = torch.cuda.Event(blocking=True)  # the writer's synchronize() sleeps, never spins a core
                fence.record(self._copy_stream)
        self._snapshot_done = fence
        return fence

    def _wait_snapshot(self) -> None:
        """Before anything writes the state: the snapshot in flight has read it."""
        fence, self._snapshot_done = self._snapshot_done, None
        if isinstance(fence, HostCopy):
            fence.synchronize()
        elif fence is not None:
            torch.cuda.current_stream(self.device).wait_event(fence)  # device-side, no host sync

    # --- one step ----------------------------------------------------------------------------------------
    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """Forward and backward of every micro-batch of `step`'s rows, then one optimizer update; leaves the state
        at header step + 1."""
        tc = self.cfg.train
        self.model.train()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        rows = x.shape[0]
        if self.micro_batch is None:
            self.micro_batch = memory.micro_batch_rows(tc.micro_batch_size, rows)
            problem = memory.check_micro_batch(self.micro_batch, rows)
            if problem:
                raise ConfigError(problem)
        seq_losses = self._accumulate_or_halve(step, x, y) if self._auto else self._accumulate(step, x, y)
        loss = seq_losses.mean()  # (B,) -> (): the whole batch's mean, as one pass computes it
        self._wait_snapshot()
        lr = lr_at(step, tc) * self.lr_scale
        hp = Hyper(step + 1, lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, tc.grad_clip or None,
                   decay_progress(step, tc))
        grad_norm = self.update(self.state.w, self.state.grad, self.state.m, self.state.v, hp)
        return StepOutput(step + 1, lr, loss.detach(), grad_norm, seq_losses)

    def _accumulate(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's gradient into the flat `state.grad`, one micro-batch at a time; the per-row losses (B,)."""
        self.state.grad.zero_()
        if self.cfg.model.dropout > 0:  # the only use of torch's global RNG, keyed by (seed, step)
            torch.manual_seed(int(rng_for(self.cfg.train.seed, step, DROPOUT_STREAM).integers(2**62)))
        rows, mb = x.shape[0], self.micro_batch
        parts = []
        for lo in range(0, rows, mb):
            with self.autocast:
                seq = self.model(x[lo:lo + mb], y[lo:lo + mb])[1]  # (mb,); the logits are not kept
            if self._oom_rows and mb > self._oom_rows and lo + mb == rows:
                raise torch.OutOfMemoryError(f"CUDA out of memory ({testhooks.OOM_ROWS}={self._oom_rows}, injected)")
            # d(Σ slice / B): autograd adds each slice's part into the flat gradient in place (model.bind_flat)
            (seq.mean() if mb == rows else seq.sum() / rows).backward()
            parts.append(seq.detach())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _accumulate_or_halve(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`micro_batch_size = "auto"`, first step: `_accumulate`, halving the micro-batch while it runs out of
        memory (on any rank: the ranks agree before the update's collectives, `_all_ranks_ok`)."""
        rows, tried = x.shape[0], []
        while True:
            seq = None
            try:
                seq = self._accumulate(step, x, y)
            except torch.OutOfMemoryError as e:
                error = str(e).splitlines()[0] if str(e) else "out of memory"
            if self._all_ranks_ok(seq is not None):
                break
            # Out of the except block: the failed pass's graph and activations went with its traceback.
            tried.append(self.micro_batch)
            smaller = memory.next_micro_batch(rows, self.micro_batch)
            if smaller is None:
                raise torch.OutOfMemoryError(f"train.micro_batch_size=auto: out of memory even at one row per pass "
                                             f"({error if seq is None else 'on another rank'})")
            log.warning("train.micro_batch_size=auto: out of memory at %d rows per pass (%s); running step %d "
                        "again at %d", self.micro_batch, error if seq is None else "on another rank", step + 1,
                        smaller)
            self.micro_batch = smaller
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._auto = False
        self.micro_batch_choice = {"micro_batch_size": self.micro_batch, "rows": rows, "out_of_memory_at": tried}
        return seq

    def _all_ranks_ok(self, ok: bool) -> bool:
        """One process: its own outcome (ZeroTrainer: every rank's)."""
        return ok

    @torch.no_grad()
    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch, in passes of the training micro-batch (no more memory than a training pass)."""
        self.model.eval()
        x, y = x.to(self.device), y.to(self.device)
        mb = min(self.micro_batch or memory.micro_batch_rows(self.cfg.train.micro_batch_size, x.shape[0]),
                 x.shape[0])
        parts = []
        for lo in range(0, x.shape[0], mb):
            with self.autocast:
                parts.append(self.model(x[lo:lo + mb], y[lo:lo + mb])[1])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).mean()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float, top_k: int,
                 generators: list[torch.Generator]) -> list[list[int]]:
        """Sample a continuation of every prompt in one KV-cached batch (andrea/model/generate.py); row r draws only
        from generators[r], so training's randomness is untouched."""
        self.model.eval()
        with self.autocast:
            return generation.decode(self.model, prompts, max_new_tokens,
                                     generation.sampler(temperature, top_k, generators))


def _model_math(kernels: str) -> ModelMath:
    """The Triton kernels for attention, LayerNorm, RMSNorm, rotary and the loss, or torch's math (ModelMath's
    defaults: SDPA, torch's LayerNorm, andrea/model/torch_math.py's RMSNorm and QK-norm with rotary)."""
    if kernels == "triton":
        from andrea.kernels import attention, cross_entropy, layer_norm, rms_norm, rotary
        return ModelMath(attention, layer_norm, partial(cross_entropy, reduction="none"), rms_norm,
                         partial(split_heads, rms_norm=rms_norm, rotary=rotary))
    return ModelMath()


def _adamw_fn(kernels: str):
    if kernels == "triton":
        from andrea.kernels import adamw_step
        return adamw_step
    from andrea.kernels import adamw_reference
    return adamw_reference


def update_fn(tc: TrainConfig, layout: list[ParamSpec], kernels: str, device: torch.device, lo: int = 0,
              hi: int | None = None):
    """The optimizer update of the flat range [lo, hi) (all of it by default), `update(w, g, m, v, hp)`: the one
    train.optimizer names in andrea/optim/registry.py, over AdamW's kernel or its torch reference."""
    return registry.build(tc.optimizer, layout, tc, _adamw_fn(kernels), kernels, device, lo, hi)
