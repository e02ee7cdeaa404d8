"""The run's outputs, configured: when checkpoints are written and kept, the sample and task audits, and the logs
besides the ledger.

Four sections of the schema (`[checkpoint]`, `[sample]`, `[eval]`, `[log]`; andrea/config/schema.py holds RunConfig
and the training's section), each a dataclass with a docstring per field, checked on construction;
andrea/config/doc.py reads this file for docs/configuration.md. Reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from andrea.config.check import ConfigError


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
