"""Typed run configuration: one dataclass per TOML section, each field with its docstring, checked on construction.

The dataclasses are the schema: andrea/config/load.py reads presets, `run.toml`, user files and `--set` overrides
into them, and andrea/config/doc.py generates the configuration reference (docs/configuration.md) from this file's
field docstrings (and those of andrea/config/model.py: the model; andrea/config/corpus.py: the data and the
mixture's policy; andrea/config/keepers.py: the guard, the watchdog, notices; andrea/config/outputs.py: checkpoints,
audits and logs). An out-of-range value raises `ConfigError` (andrea/config/check.py, with the type checks that build
a section from a table) with one line naming the key. Reads and writes nothing.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from andrea.config.check import ConfigError
from andrea.config.corpus import DataConfig, PolicyConfig
from andrea.config.keepers import GuardConfig, NotifyConfig, WatchdogConfig
from andrea.config.model import ARCHS, MLPS, ModelConfig, mlp_hidden, swiglu_hidden  # noqa: F401 - the schema's names
from andrea.config.outputs import CheckpointConfig, EvalConfig, LogConfig, SampleConfig
from andrea.control.mixture.policy import PolicyError, validate_policy
import andrea.optim.registry as optimizers
from andrea.optim.schedule import SCHEDULES, WARMDOWN_SHAPES


@dataclass
class TrainConfig:
    """The optimizer, its schedule and the step loop's cadences."""

    seed: int = 1337
    """Seeds initialisation, data order, dropout and the bandit; a run is a pure function of seed and config."""
    batch_size: int = 16
    """Sequences of block_size tokens per optimizer step (tokens per step = batch_size · block_size)."""
    steps: int = 200_000
    """The step to stop at (counted from 0); `--steps` overrides it. The LR schedule does not depend on it."""
    lr: float = 6e-4
    """Peak learning rate, reached at the end of the linear warmup."""
    min_lr: float = 6e-5
    """Learning rate at the end of the cosine decay, and after it."""
    warmup_steps: int = 2000
    """Steps of linear warmup from lr/warmup_steps to lr."""
    lr_decay_steps: int = 200_000
    """Horizon of the cosine decay; fixed per run so that stopping early never changes the schedule. With
    schedule = "wsd", the step its warmdown ends at (min_lr from there on)."""
    schedule: str = "cosine"
    """cosine | wsd (andrea/optim/schedule.py). cosine: from lr after the warmup to min_lr at lr_decay_steps.
    wsd: warmup, lr held constant, then a warmdown of warmdown_steps ending at lr_decay_steps: a run without a fixed
    end keeps lr_decay_steps far ahead and anneals when it is asked for a finished model (a branch setting
    lr_decay_steps to the step + N and warmdown_steps to N, or a pivot's anneal: anneal_at, anneal_steps)."""
    warmdown_steps: int = 0
    """schedule = "wsd": the warmdown's length in steps, from lr to min_lr (at least 1 with wsd)."""
    warmdown_shape: str = "linear"
    """schedule = "wsd": linear | 1-sqrt (the lr falls as 1 − √progress: faster at first, Hägele et al. 2024)."""
    anneal_at: int = 0
    """A pivot's anneal (`andrea pivot --anneal N` records it): the step it starts at, the pivot's."""
    anneal_steps: int = 0
    """A pivot's anneal: from anneal_at the lr goes from its value there to min_lr over this many steps (wsd: in
    warmdown_shape; cosine: linearly), min_lr after (andrea/optim/schedule.py); 0: no anneal."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not biases or LayerNorm gains)."""
    beta1: float = 0.9
    """AdamW first-moment decay (m in the checkpoint)."""
    beta2: float = 0.999
    """AdamW second-moment decay (v in the checkpoint)."""
    eps: float = 1e-8
    """AdamW epsilon, added to the square root of the bias-corrected v."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    optimizer: str = "adamw"
    """A name in andrea/optim/registry.py's table (its error lists them): adamw | muon | normuon. normuon
    (andrea/optim/normuon.py): muon with NorMuon's per-row variance reduction, a scheduled momentum, cautious
    scheduled weight decay (muon_weight_decay) and AdamW groups for the embeddings and the head. muon: Muon (momentum orthogonalised by Polar Express) on the 2-D matrices inside the transformer
    blocks, AdamW (lr, beta1, beta2, eps, weight_decay above) on the embeddings, the head, biases and norm gains
    (andrea/optim/muon.py). Fixed at a run's first start (its identity); the checkpoint format is the same."""
    muon_lr: float = 0.02
    """Muon's peak learning rate; it follows lr's schedule and the guard's remedy: Muon's lr at a step is
    muon_lr · (AdamW's lr at that step) / lr. The update is scaled by max(1, rows/cols)^0.5 (rows = out)."""
    muon_momentum: float = 0.95
    """Muon's momentum decay β (the momentum is `m` in the checkpoint for Muon's matrices; their `v` stays 0)."""
    muon_nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead g.lerp(momentum, β) instead of the momentum itself."""
    muon_weight_decay: float = 0.0
    """Muon's decoupled weight decay: w ← w · (1 − lr_muon · muon_weight_decay) each step."""
    muon_ns_steps: int = 5
    """Polar Express (Newton–Schulz) steps per update, 1 to 5 (each its own coefficients; 5 reaches singular values
    within ~[0.9, 1])."""
    embed_lr: float = 0.3
    """normuon: the embeddings' AdamW peak lr (wte, and a gpt2's wpe) at width lr_width; it follows lr's schedule
    and the guard's remedy as muon_lr does."""
    head_lr: float = 0.008
    """normuon: the output head's AdamW peak lr at width lr_width."""
    lr_width: int = 768
    """normuon: embed_lr and head_lr are multiplied by sqrt(lr_width / n_embd) (nanochat's width scaling, tuned at
    768); 0 leaves them as set."""
    embed_beta1: float = 0.8
    """normuon: the embeddings' AdamW beta1."""
    embed_beta2: float = 0.995
    """normuon: the embeddings' AdamW beta2."""
    head_beta1: float = 0.8
    """normuon: the head's AdamW beta1."""
    head_beta2: float = 0.96
    """normuon: the head's AdamW beta2."""
    group_eps: float = 1e-10
    """normuon: the embeddings' and the head's AdamW epsilon (biases and norm gains keep eps)."""
    embed_weight_decay: float = 0.001
    """normuon: the embeddings' AdamW weight decay."""
    head_weight_decay: float = 0.01
    """normuon: the head's AdamW weight decay."""
    value_embed_lr: float = 0.15
    """normuon: the value embeddings' (model.value_embeds) AdamW peak lr at width lr_width (nanochat: half
    embed_lr), with embed_beta1, embed_beta2 and group_eps."""
    value_embed_weight_decay: float = 0.01
    """normuon: the value embeddings' AdamW weight decay."""
    resid_lr: float = 0.005
    """normuon: the residual lambdas' (model.resid_lambdas) AdamW peak lr; this and the other scalars' lrs are not
    width-scaled; every part's group has group_eps."""
    resid_beta1: float = 0.8
    """normuon: the residual lambdas' AdamW beta1."""
    resid_beta2: float = 0.95
    """normuon: the residual lambdas' AdamW beta2."""
    resid_weight_decay: float = 0.05
    """normuon: the residual lambdas' AdamW weight decay (toward 0, as nanochat: it reaches these vectors, as each
    part's decay reaches all of its parameters)."""
    x0_lr: float = 0.5
    """normuon: the x0 lambdas' (model.resid_lambdas) AdamW peak lr."""
    x0_beta1: float = 0.96
    """normuon: the x0 lambdas' AdamW beta1."""
    x0_beta2: float = 0.95
    """normuon: the x0 lambdas' AdamW beta2."""
    x0_weight_decay: float = 0.0
    """normuon: the x0 lambdas' AdamW weight decay."""
    smear_lr: float = 0.2
    """normuon: smear's gate and lambda and backout's lambda (model.smear, model.backout): their AdamW peak lr."""
    smear_beta1: float = 0.8
    """normuon: smear's and backout's AdamW beta1."""
    smear_beta2: float = 0.95
    """normuon: smear's and backout's AdamW beta2."""
    smear_weight_decay: float = 0.0
    """normuon: smear's and backout's AdamW weight decay."""
    normuon_beta2: float = 0.9
    """normuon: decay of the per-row second moment of the orthogonalised update (kept in the matrix's v)."""
    muon_momentum_start: float = 0.85
    """normuon: Muon's momentum at step 0, raised linearly to muon_momentum over muon_momentum_warmup steps."""
    muon_momentum_warmup: int = 400
    """normuon: steps of the momentum's warmup (0: none)."""
    muon_momentum_end: float = 0.9
    """normuon: the momentum after the warmup eases from muon_momentum to this as the lr's decay progresses."""
    eval_every: int = 500
    """Validation cadence in steps: an `eval` marker with per-arm held-out losses in .loss.json."""
    eval_batches: int = 8
    """Held-out batches per arm in each validation."""
    log_every: int = 10
    """Progress log-line cadence in steps when stderr is not a terminal (a terminal gets a live bar)."""
    device: str = "auto"
    """auto | cpu | cuda"""
    kernels: str = "auto"
    """auto | torch | triton (auto = Triton on a CUDA GPU it runs on, sm_80 or newer; else the plain-torch reference)"""
    micro_batch_size: int | str = 0
    """Rows per forward and backward pass: a step runs batch_size / micro_batch_size of them over consecutive
    slices of its batch, accumulating one gradient, then one AdamW update (same data, same math, less memory).
    0 = the whole batch (per rank under torchrun); it must divide the batch (per rank). "auto": start from the
    whole batch and halve it while the first step runs out of memory; the value chosen is written to run.toml."""
    activation_checkpointing: str = "none"
    """none | blocks (blocks: keep only each transformer block's input and recompute the block in the backward:
    the same bytes, less activation memory, ~1/3 more compute)"""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device, for MFU (andrea/control/observe/mfu.py); 0 = the table's for a GPU it lists (A100, H100,
    H200, L4, L40S, RTX 3090/4090, bf16). On a CPU or an unlisted GPU MFU is reported as unknown unless set."""

    def __post_init__(self) -> None:
        mb = self.micro_batch_size
        if mb != "auto" and (type(mb) is not int or mb < 0):
            raise ConfigError(f"train.micro_batch_size={mb!r} must be a positive integer, 0 (the whole batch) "
                              f"or \"auto\"")
        if type(mb) is int and mb and self.batch_size >= 1 and self.batch_size % mb:
            raise ConfigError(f"train.micro_batch_size={mb} does not divide train.batch_size={self.batch_size}")
        if self.activation_checkpointing not in ("none", "blocks"):
            raise ConfigError(f"train.activation_checkpointing={self.activation_checkpointing!r} must be none or "
                              f"blocks")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device={self.device!r} must be auto, cpu or cuda")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"train.kernels={self.kernels!r} must be auto, torch or triton")
        if self.batch_size < 1 or self.steps < 0 or self.warmup_steps < 0 or self.lr_decay_steps < 1:
            raise ConfigError("train.batch_size, steps, warmup_steps and lr_decay_steps must be positive")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1)")
        if self.eval_every < 1 or self.log_every < 1 or self.eval_batches < 1:
            raise ConfigError("train.eval_every, eval_batches and log_every must be >= 1")
        if not self.peak_tflops >= 0:
            raise ConfigError(f"train.peak_tflops={self.peak_tflops} must be >= 0 (0: the device table's)")
        if self.schedule not in SCHEDULES or self.warmdown_shape not in WARMDOWN_SHAPES:
            raise ConfigError(f"train.schedule={self.schedule!r} must be {' or '.join(SCHEDULES)} and "
                              f"train.warmdown_shape={self.warmdown_shape!r} {' or '.join(WARMDOWN_SHAPES)}")
        if self.schedule == "wsd" and not 1 <= self.warmdown_steps <= self.lr_decay_steps:
            raise ConfigError(f"train.warmdown_steps={self.warmdown_steps} must be 1 to train.lr_decay_steps="
                              f"{self.lr_decay_steps} with train.schedule=wsd (its warmdown ends at lr_decay_steps)")
        if self.anneal_at < 0 or self.anneal_steps < 0:
            raise ConfigError(f"train.anneal_at={self.anneal_at} and train.anneal_steps={self.anneal_steps} must be "
                              f">= 0 (a pivot's anneal; 0 steps: none)")
        if optimizers.problem(self.optimizer):
            raise ConfigError(optimizers.problem(self.optimizer))
        if "muon_lr" in optimizers.get(self.optimizer).keys and not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0 with train.optimizer={self.optimizer} (Muon's lr "
                              f"follows lr's schedule as muon_lr · lr_at(step) / lr)")
        if not self.muon_lr > 0:
            raise ConfigError(f"train.muon_lr={self.muon_lr} must be > 0")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"train.muon_momentum={self.muon_momentum} must be in [0, 1)")
        if not self.muon_weight_decay >= 0:
            raise ConfigError(f"train.muon_weight_decay={self.muon_weight_decay} must be >= 0")
        for key in ("embed_beta1", "embed_beta2", "head_beta1", "head_beta2", "normuon_beta2", "muon_momentum_start",
                    "muon_momentum_end", "resid_beta1", "resid_beta2", "x0_beta1", "x0_beta2", "smear_beta1",
                    "smear_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ("embed_lr", "head_lr", "group_eps", "embed_weight_decay", "head_weight_decay", "lr_width",
                    "muon_momentum_warmup", "value_embed_lr", "value_embed_weight_decay", "resid_lr",
                    "resid_weight_decay", "x0_lr", "x0_weight_decay", "smear_lr", "smear_weight_decay"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")
        if not 1 <= self.muon_ns_steps <= 5:
            raise ConfigError(f"train.muon_ns_steps={self.muon_ns_steps} must be 1 to 5 (Polar Express has five "
                              f"steps' coefficients)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)

    def __post_init__(self) -> None:
        try:
            validate_policy(self.data.arm_names(), self.policy.caps, self.policy.floors, self.policy.target)
        except PolicyError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        import tomli_w  # only writers of run.toml need it
        return tomli_w.dumps(self.to_dict())


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in SECTIONS}
