"""Typed run configuration: one dataclass per TOML section, each field with its docstring, checked on construction.

The dataclasses are the schema: andrea/config/load.py reads presets, `run.toml`, user files and `--set` overrides
into them, and andrea/config/doc.py generates the configuration reference (docs/configuration.md) from this file's
field docstrings (and those of andrea/config/model.py: the model; andrea/config/corpus.py: the data and the
mixture's policy; andrea/config/keepers.py: the guard, the watchdog, notices). An out-of-range value raises
`ConfigError` (andrea/config/check.py, with the type checks that build a section from a table) with one line naming
the key. Reads and writes nothing.
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
                    "muon_momentum_end"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ("embed_lr", "head_lr", "group_eps", "embed_weight_decay", "head_weight_decay", "lr_width",
                    "muon_momentum_warmup"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")
        if not 1 <= self.muon_ns_steps <= 5:
            raise ConfigError(f"train.muon_ns_steps={self.muon_ns_steps} must be 1 to 5 (Polar Express has five "
                              f"steps' coefficients)")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and which are kept (docs/formats.md and operating.md)."""

    every: int = 100
    """Cadence in steps (docs/formats.md: ~17 minutes of work at risk on ANDREA-120M); equal to sample.every by default."""
    keep_last: int = 5
    """Newest checkpoints kept; older ones are deleted unless they are multiples of keep_every, or the guard's
    known-good checkpoint or a tentative one (guard.confirm_steps records not yet seen): with every below
    guard.confirm_steps, a few more stay on disk (at most confirm_steps / max(every, confirm_steps / 8) + 2:
    10 at every = 1, andrea/control/guard/decisions.py)."""
    keep_every: int = 10_000
    """Checkpoints at multiples of this are "major" and never deleted; 0 disables."""
    keep_best: int = 0
    """The checkpoints with the K lowest held-out losses are never deleted, locally and in the replica (0: none).
    A candidate is a checkpoint whose step had an eval (a multiple of train.eval_every; at a rollback the
    abandoned timeline's evals no longer count); rundir/retention.py."""
    usr1: str = "step"
    """step: SIGUSR1 checkpoints the step in flight; cadence: the next multiple of `every` (the pivot sequence)."""
    on_write_error: str = "retry"
    """retry: warn loudly and try again at the next cadence; stop: exit non-zero at the next step boundary that
    knows of the failure (every rank, at the same step), naming the first checkpoint whose write failed."""
    replica: str = ""
    """Where each committed checkpoint, the ledger, the sidecars, run.toml, the tokenizer and the data are copied, off
    the training thread: an object-store URI (`s3://bucket/prefix`; gs://, az:// too) or a plain path (a second
    disk); empty: no replica. S3 endpoint and credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION (never written here). `andrea restore` brings a run back from it
    (docs/operating.md#a-replica-off-the-machine); needs `andrea[replica]`."""
    replica_wait: float = 30.0
    """Seconds a stop (SIGTERM, the step target) waits for the replica to take the last checkpoint before exiting 0,
    at most half of `stop_grace_s` (the rest is for the step in flight and its checkpoint). The checkpoint is
    already durable on the local disk during this wait; what the replica lacks then is uploaded by the next start."""
    stop_grace_s: float = 120.0
    """The grace period the supervisor gives a stop between SIGTERM and SIGKILL: systemd's TimeoutStopSec,
    Kubernetes' terminationGracePeriodSeconds, SLURM's --signal=TERM@N (120 in docs/operating.md's templates). Set
    it to yours; it bounds `replica_wait`."""

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep_last < 1 or self.keep_every < 0 or self.keep_best < 0:
            raise ConfigError("checkpoint.every and keep_last must be >= 1, keep_every and keep_best >= 0")
        if self.usr1 not in ("step", "cadence"):
            raise ConfigError(f"checkpoint.usr1={self.usr1!r} must be 'step' or 'cadence'")
        if self.on_write_error not in ("retry", "stop"):
            raise ConfigError(f"checkpoint.on_write_error={self.on_write_error!r} must be 'retry' or 'stop'")
        if self.replica_wait < 0 or not self.stop_grace_s > 0:
            raise ConfigError(f"checkpoint.replica_wait={self.replica_wait} must be >= 0 seconds and "
                              f"checkpoint.stop_grace_s={self.stop_grace_s} > 0")
        if self.replica and self.replica_wait > self.stop_grace_s / 2:
            raise ConfigError(f"checkpoint.replica_wait={self.replica_wait:g} s does not fit the stop's grace period "
                              f"(checkpoint.stop_grace_s={self.stop_grace_s:g} s; at most half of it, the rest is the "
                              f"step in flight and its checkpoint): lower it, or set stop_grace_s to your "
                              f"supervisor's longer grace period (docs/operating.md)")


@dataclass
class SampleConfig:
    """Sample audits written to .samples.json."""

    every: int = 0
    """Sample-audit cadence; 0 means equal to checkpoint.every (docs/formats.md#why-a-checkpoint-every-100-steps)."""
    prompts: list[str] = field(default_factory=lambda: ["def ", "The "])
    """Prompts sampled at each sample audit."""
    max_new_tokens: int = 48
    """Tokens generated per prompt."""
    keep: int = 20
    """Number of audits kept in .samples.json."""
    temperature: float = 0.8
    """Sampling temperature; 0 is taken as 1e-5 (the most likely token, all but certainly)."""
    top_k: int = 40
    """Sample from the k most likely tokens only; 0: from every token."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.max_new_tokens < 1 or self.keep < 1:
            raise ConfigError("sample.every must be >= 0 (0: checkpoint.every), sample.max_new_tokens and sample.keep "
                              ">= 1")
        if self.temperature < 0 or self.top_k < 0:
            raise ConfigError(f"sample.temperature={self.temperature} and sample.top_k={self.top_k} must be >= 0")


@dataclass
class EvalConfig:
    """A multiple-choice task audit during training (andrea/evals/tasks.py; `andrea eval` scores one checkpoint)."""

    tasks: str = ""
    """A tasks file in HellaSwag's JSON Lines format (ctx, endings, label), scored on the live model at every
    `every` steps, its accuracies a `tasks` marker in .loss.json; empty: off. Resolved to an absolute path when the
    run starts (run.toml keeps that), and read then: a missing or bad file refuses the start in one line, as a
    configuration error (exit 2: a restart cannot mend it). UTF-8 (a byte-order mark allowed), one example per
    line of at most 1 MiB."""
    every: int = 0
    """Task-audit cadence in steps; 0 means equal to checkpoint.every."""
    limit: int = 0
    """Score the file's first `limit` examples only (0: all): a bound on the audit's cost (HellaSwag's 10,042
    examples are ~40,000 rows, minutes of a 120M model's forwards)."""
    batch_rows: int = 32
    """Rows (one per ending) per forward: the audit's logits are batch_rows x block_size x vocab floats."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.limit < 0 or self.batch_rows < 1:
            raise ConfigError("eval.every and eval.limit must be >= 0, eval.batch_rows >= 1")


@dataclass
class LogConfig:
    """Where a run's records go besides the ledger (which is always written)."""

    tensorboard: bool = False
    """Also write the ledger's records as TensorBoard scalars under RUN_DIR/tb/ (andrea/control/observe/tensorboard.py)."""
    flush_secs: float = 30.0
    """Longest time a TensorBoard scalar waits in memory before it is written to RUN_DIR/tb/."""
    wandb: bool = False
    """Also stream the ledger's settled history to Weights & Biases, one W&B run per andrea run across restarts
    (andrea/control/observe/wandb_log.py; needs the wandb extra, `pip install -e '.[wandb]'` from andrea's clone,
    and, online, WANDB_API_KEY in the environment)."""
    wandb_project: str = ""
    """The W&B project; empty: W&B's own WANDB_PROJECT from the environment, else "andrea"."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty: WANDB_ENTITY from the environment, else the API key's default."""
    wandb_name: str = ""
    """The W&B run's display name; empty: the run directory's name."""
    wandb_mode: str = ""
    """online | offline (offline: files under RUN_DIR/wandb/ only, uploaded later with `wandb sync`); empty:
    W&B's own WANDB_MODE from the environment (a cluster without internet sets offline there), else online."""
    wandb_timeout_s: float = 30.0
    """Longest wait for W&B when it starts and when the process ends (what it has not sent is sent next time)."""

    def __post_init__(self) -> None:
        if not self.flush_secs > 0:
            raise ConfigError(f"log.flush_secs={self.flush_secs} must be > 0")
        if self.wandb_mode not in ("", "online", "offline"):
            raise ConfigError(f"log.wandb_mode={self.wandb_mode!r} must be online, offline or empty (WANDB_MODE)")
        if not self.wandb_timeout_s > 0:
            raise ConfigError(f"log.wandb_timeout_s={self.wandb_timeout_s} must be > 0")


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
