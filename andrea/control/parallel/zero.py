"""ZeRO-1 data parallelism on the flat layout: the Trainer with its optimizer state sharded across ranks.

Owns device memory only, like andrea/control/run/trainer.py; reads and writes no files. Per rank r of P (bounds:
andrea/control/parallel/distributed.py, [lo, hi) of the flat n, padded to P·s internally):

    micro      with train.micro_batch_size, step 1 runs this rank's rows as micro-batches that accumulate into
               the flat gradient (Trainer._accumulate): no collective runs per micro-batch, so the gradient is
               still reduced ONCE per step, by step 2's reduce-scatter (no no_sync needed: there are no hooks).
    memory     w: the full weights (P·s, the model's parameters are views into its first n), the full
               gradient (P·s), and m, v of the slice only (2·(hi - lo)): the optimizer state is 1/P per rank.
    muon       train.optimizer = "muon" (any optimizer whose registration names whole matrices): the bounds keep
               every Muon matrix whole on one rank (distributed.whole_cuts); the rank orthogonalises the matrices it owns, and step 5 gathers them
               with the rest. Those slices are not all s long at r·s: the collectives then go through one
               exchange buffer (P·s), each rank's slice copied to r·s before the reduce-scatter and back after
               the all-gather (2·n floats copied per step; the equal split needs no copy).
    one step   1. forward and backward on rows [r·B/P, (r+1)·B/P) of the global batch B (every rank drew the
                  same global batch);
               2. ONE reduce-scatter (mean) of the flat gradient → this rank's slice g_r;
               3. ONE all-reduce of Σ g_r² → the global pre-clip norm, the same quantity as one process's
                  (only the summation order differs), so the clip factor min(1, c / (norm + 1e-6)) is global;
               4. the optimizer's update (andrea/optim/registry.py; AdamW: the fused Triton kernel on GPU, the
                  reference on CPU, with the decay mask sliced identically) on w[lo:hi], g_r·clip, m, v;
               5. ONE all-gather rebuilds w on every rank; the per-sequence losses are all-gathered (B,) so
                  every rank's data proxy sees the whole batch.
    snapshot   this rank's slices w[lo:hi], m, v (three views of a ShardImage) for the sharded checkpoint writer
               (andrea/control/commit/shards.py); `load` takes a full checkpoint payload of any world size.

Communication and the backward: one collective after the backward, not bucketed hooks. The gradient is one flat
buffer that autograd fills in place, so one reduce-scatter over it runs at full link bandwidth with no per-bucket
launches, and ZeRO-1 needs the slices of the WHOLE gradient before any AdamW slice can run (the clip factor needs
the global norm), so overlapping buckets with the backward could only hide the reduce-scatter itself. Measured by
`python bench/zero_dist.py` (the share of a step spent in the collectives); bucketing is the next step if a
multi-GPU measurement shows the reduce-scatter above a few percent of the step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from andrea.control.parallel import distributed as dist_
from andrea.config.schema import RunConfig
from andrea.control.parallel.distributed import World
from andrea.model.gpt import bind_flat
from andrea.optim import registry
from andrea.optim.registry import Hyper
from andrea.control.run.trainer import Fence, StepOutput, Trainer, update_fn


class ShardState:
    """Full weights and gradient (padded to P·s), this rank's m and v; `w`/`grad` are the first n elements.

    With the optimizer's bounds (`world.cuts`) that are not the equal split, `w` and `grad` are plain (n,) buffers
    and `w_padded` is `grad_padded`: one exchange buffer (P·s) that rank r's slice passes through at r·s."""

    def __init__(self, n: int, world: World, device: torch.device):
        self.n = n
        self.bounds = [world.shard_bounds(n, r) for r in range(world.size)]
        self.s = max(max(hi - lo for lo, hi in self.bounds), 1)
        self.lo, self.hi = self.bounds[world.rank]
        self.aligned = all(lo == r * self.s or lo == hi == n for r, (lo, hi) in enumerate(self.bounds))
        k = self.hi - self.lo
        self.w_padded = torch.zeros(world.size * self.s, dtype=torch.float32, device=device)
        self.grad_padded = torch.zeros(world.size * self.s, dtype=torch.float32, device=device) if self.aligned \
            else self.w_padded
        if self.aligned:
            self.w, self.grad = self.w_padded[:n], self.grad_padded[:n]
        else:
            self.w, self.grad = (torch.zeros(n, dtype=torch.float32, device=device) for _ in range(2))
        self.mv = torch.zeros(2 * k, dtype=torch.float32, device=device)
        self.m, self.v = self.mv.split(k)
        self.g_shard = torch.zeros(self.s, dtype=torch.float32, device=device)
        self.w_send = torch.zeros(self.s, dtype=torch.float32, device=device)


class ZeroTrainer(Trainer):
    def __init__(self, cfg: RunConfig, device: torch.device, kernels: str, world: World):
        super().__init__(cfg, device, kernels)
        dist_.check_batch(cfg.train.batch_size, world.size, cfg.train.micro_batch_size)
        self.world = world
        spans = registry.spans(cfg.train.optimizer, self.layout)
        if spans is not None:  # whole matrices per rank; the commits and the sharing read world.cuts
            world.cuts = dist_.whole_cuts(self.n, world.size, spans)
        full = self.state
        self.state = ShardState(self.n, world, device)
        self.state.w.copy_(full.w)
        del full  # the one-process [w | m | v] is not kept: m and v live as this rank's slices only
        bind_flat(self.model, self.state.w, self.state.grad)
        self.lo, self.hi = self.state.lo, self.state.hi
        self.rows = dist_.row_bounds(cfg.train.batch_size, world.size, world.rank)
        self._shard_update = update_fn(cfg.train, self.layout, kernels, device, self.lo, self.hi)
        self.update = self._zero_update

    @property
    def shard_len(self) -> int:
        return self.hi - self.lo

    # --- state -------------------------------------------------------------------------------------------
    def load(self, payload: torch.Tensor) -> None:
        """Take a full payload [w | m | v] (3·n, written by any world size): all of w, this rank's m and v."""
        n, lo, hi = self.n, self.lo, self.hi
        self._wait_snapshot()
        self.state.w.copy_(payload[:n].to(self.device))
        self.state.m.copy_(payload[n + lo:n + hi].to(self.device))
        self.state.v.copy_(payload[2 * n + lo:2 * n + hi].to(self.device))

    def snapshot(self, staging: tuple[torch.Tensor, ...]) -> Fence:
        """Start copying this rank's w[lo:hi], m, v into the three (hi - lo) host views `staging` (a ShardImage's);
        fenced as Trainer.snapshot."""
        return self._start_copy(staging, (self.state.w[self.lo:self.hi], self.state.m, self.state.v))

    # --- one step ----------------------------------------------------------------------------------------
    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """Trainer.train_step on this rank's rows of the global batch; the losses come back global."""
        lo, hi = self.rows
        out = super().train_step(step, x[lo:hi], y[lo:hi])
        seq = torch.empty(self.cfg.train.batch_size, dtype=torch.float32, device=self.device)
        dist_.all_gather(seq, out.seq_losses.float().contiguous())
        # The batch mean over all B rows, as one process computes it (same rows, same order).
        return StepOutput(out.step, out.lr, seq.mean(), out.grad_norm, seq)

    def _all_ranks_ok(self, ok: bool) -> bool:
        """"auto"'s first step: did every rank's pass fit? (one tiny MIN all-reduce; every rank halves together)"""
        flag = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist_.all_reduce_min(flag)
        return bool(flag.item())

    @torch.no_grad()
    def _zero_update(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: Hyper) -> torch.Tensor:
        """The optimizer call Trainer.train_step makes, ZeRO-1: reduce-scatter, global norm, slice update, gather.

        Called as every registered update (w, g, m, v are this trainer's state); returns the global pre-clip
        gradient norm as a 0-d device tensor (no host sync on CUDA).
        """
        st, k = self.state, self.shard_len
        if not st.aligned:
            for r, (lo, hi) in enumerate(st.bounds):
                st.grad_padded[r * st.s:r * st.s + hi - lo].copy_(st.grad[lo:hi])
        dist_.reduce_scatter_mean(st.g_shard, st.grad_padded)
        g_r = st.g_shard[:k]
        sumsq = torch.linalg.vector_norm(g_r, 2.0, dtype=torch.float32).double().square().view(1)
        dist_.all_reduce_sum(sumsq)
        norm = sumsq.sqrt().float().view(())
        if hp.max_grad_norm:
            # clip_coefficient's formula on the global norm; g·c with the same c is what the update would do.
            g_r.mul_(torch.clamp(hp.max_grad_norm / (norm + 1e-6), max=1.0))
        self._shard_update(st.w[self.lo:self.hi], g_r, st.m, st.v, replace(hp, max_grad_norm=None))
        st.w_send[:k].copy_(st.w[self.lo:self.hi])
        dist_.all_gather(st.w_padded, st.w_send)
        if not st.aligned:
            for r, (lo, hi) in enumerate(st.bounds):
                st.w[lo:hi].copy_(st.w_padded[r * st.s:r * st.s + hi - lo])
        return norm


def trainer_for(world: World, cfg: RunConfig, device: torch.device, kernels: str) -> Trainer:
    """The one-process Trainer, or the ZeRO-1 one when torchrun started several ranks."""
    return ZeroTrainer(cfg, device, kernels, world) if world.distributed else Trainer(cfg, device, kernels)
