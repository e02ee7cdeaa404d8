"""The run's keepers, configured: the divergence guard, the watchdog and the operator's notices.

Three sections of the schema (andrea/config/schema.py holds RunConfig and most of the rest, andrea/config/corpus.py
the data's), each a dataclass with a docstring per field, checked on construction; andrea/config/doc.py reads all
three files for docs/configuration.md. Reads and
writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from andrea import notices
from andrea.config.check import ConfigError


@dataclass
class GuardConfig:
    """The divergence guard (andrea/control/guard/decisions.py): detect, never checkpoint over the last good state, roll back.

    Defaults are chosen so that healthy runs never trigger it (bench/guard.py checks the tiny preset's whole
    schedule and ANDREA-12M's first steps): a healthy batch loss moves 10-15 % and a healthy gradient norm
    spikes 4x on single batches, and neither happens on 3 of 5 consecutive steps.
    """

    enabled: bool = True
    """false: no detection, no gating, no rollback (a non-finite loss then stops the run, as before)."""
    window: int = 50
    """Healthy steps in the robust baseline (median and MAD of the loss and of the gradient norm)."""
    loss_sigmas: float = 6.0
    """A loss more than this many robust sigmas (1.4826 · MAD) above the baseline median is anomalous..."""
    loss_margin: float = 0.2
    """...and more than this fraction above the median (the band's floor: a young window has MAD 0)."""
    grad_sigmas: float = 8.0
    """The same for the pre-clip gradient norm (in robust sigmas)."""
    grad_margin: float = 4.0
    """The gradient norm's floor: anomalous only above (1 + grad_margin) x its median."""
    persist: int = 3
    """An incident is this many anomalous steps among the last `persist_window` (a non-finite one at once)."""
    persist_window: int = 5
    """Steps the persistence rule looks back over; no checkpoint is committed while persist - 1 of them were anomalous."""
    confirm_steps: int = 50
    """A committed checkpoint becomes the known-good point after this many later steps without an incident."""
    max_attempts: int = 6
    """Rollbacks per incident series; the next incident stops the run non-zero, naming the checkpoint to resume."""
    lr_factor: float = 0.5
    """From the second rollback of a series on, the learning-rate scale is multiplied by this (it stays lowered)."""

    def __post_init__(self) -> None:
        for name in ("window", "persist", "persist_window", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"guard.{name}={getattr(self, name)} must be >= 1")
        if self.persist > self.persist_window:
            raise ConfigError(f"guard.persist={self.persist} must be <= guard.persist_window={self.persist_window}")
        if self.confirm_steps < self.persist_window:
            raise ConfigError(f"guard.confirm_steps={self.confirm_steps} must be >= guard.persist_window="
                              f"{self.persist_window} (a checkpoint is confirmed only once a divergence would show)")
        for name in ("loss_sigmas", "loss_margin", "grad_sigmas", "grad_margin"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"guard.{name}={getattr(self, name)} must be > 0")
        if not 0.0 < self.lr_factor < 1.0:
            raise ConfigError(f"guard.lr_factor={self.lr_factor} must be in (0, 1)")


NOTIFY_EVENTS = tuple(notices.NOTICE_KINDS)
"""The events a notice is sent for: the kinds of the registry andrea/notices.py (a new kind is a row there)."""
STALL_EXIT_CODE = 75
"""The trainer's exit status when the watchdog ends a hung run (EX_TEMPFAIL: try again; docs/operating.md)."""


@dataclass
class WatchdogConfig:
    """The watchdog (andrea/control/observe/watchdog.py): a run that stops making progress exits with code 75 and its
    stacks in the log, so that systemd, Kubernetes or SLURM restart it from its newest checkpoint.

    A component (the training thread, the step boundary, the I/O thread) is hung when it has been busy without
    progress (a step, a boundary, a job or a write call returning) for longer than its limit, max(floor_s, factor
    x the longest wait without progress seen so far in this process), counted in time the process could run (a
    `kill -STOP` is not a hang).
    """

    enabled: bool = True
    """false: no watchdog thread (a hang then waits for an operator or an external timeout)."""
    floor_s: float = 900.0
    """The shortest limit in seconds: longer than a first step (compilation, `micro_batch_size = "auto"`), one
    forward of an eval or task audit (each one is progress), and one honest checkpoint write to a slow network disk (a 1.45 GB ANDREA-120M image at 10 MB/s takes
    ~150 s; the I/O thread reports progress per 64 MiB write call besides)."""
    factor: float = 10.0
    """The limit grows to this many times the longest wait without progress seen in this process (a slower
    machine or disk raises it on its own); >= 2."""
    poll_s: float = 0.0
    """How often the watchdog looks, in seconds; 0: floor_s / 20, at most 5 s."""

    def __post_init__(self) -> None:
        if not self.floor_s > 0:
            raise ConfigError(f"watchdog.floor_s={self.floor_s} must be > 0")
        if not self.factor >= 2:
            raise ConfigError(f"watchdog.factor={self.factor} must be >= 2 (a limit at the slowest seen step would "
                              f"kill healthy runs)")
        if self.poll_s < 0 or self.poll_s > self.floor_s / 2:
            raise ConfigError(f"watchdog.poll_s={self.poll_s} must be in [0, floor_s / 2] (0: automatic)")

    @property
    def poll(self) -> float:
        return self.poll_s or min(5.0, self.floor_s / 20)

    @property
    def collective_timeout_s(self) -> float:
        """How long one collective of the training thread may wait for a peer under torchrun: twice the floor,
        so the watchdog of the rank that is behind speaks (stacks, code 75) before its peers' collectives fail."""
        return 2 * self.floor_s


@dataclass
class NotifyConfig:
    """Notices to the operator (andrea/control/observe/notify.py): each event as one JSON object, given to a command on
    its standard input and/or POSTed to a URL, from a thread of its own (a step never waits for it, a failed
    notice is one warning line, never the run's failure)."""

    command: str = ""
    """A program and its arguments (split like a shell would, not run by one) that reads the event's JSON on
    stdin, e.g. `"/usr/local/bin/page-oncall --team ml"`; empty: none."""
    url: str = ""
    """An http:// or https:// URL the event's JSON is POSTed to (Content-Type: application/json); empty: none."""
    events: list[str] = field(default_factory=lambda: [notices.ALL])
    """The kinds sent: `["all"]`, every kind (those a later version adds too: run.toml records the intent, not
    today's list), or a list of kinds from docs/operating.md's table of notices."""
    timeout_s: float = 10.0
    """The longest a command or a POST may take, the whole exchange, before it is abandoned with a warning (a
    command's whole process group is ended then; control/observe/delivery.py)."""
    plateau_evals: int = 0
    """A `plateau` notice (and ledger marker) when this many evals in a row bring no new best held-out loss, and
    again after as many more (control/observe/plateau.py); 0: never."""
    max_per_hour: int = 6
    """Notices of one kind sent per rolling hour at most; the rest are dropped and counted in the next one
    (`suppressed`). The last notice of a process (finished, stopped, failed, stall) is always sent."""

    def __post_init__(self) -> None:
        import shlex
        from urllib.parse import urlsplit
        try:
            argv = shlex.split(self.command)
        except ValueError as e:
            raise ConfigError(f"notify.command={self.command!r}: {e}") from None
        if self.command.strip() and not argv:
            raise ConfigError(f"notify.command={self.command!r}: no program")
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"notify.url={self.url!r} must be an http:// or https:// URL with a host")
            try:
                _ = parts.port  # a port that is not a number raises
            except ValueError:
                raise ConfigError(f"notify.url={self.url!r}: bad port") from None
        unknown = notices.unknown(self.events)
        if unknown:
            raise ConfigError(f"notify.events: unknown event {unknown[0]!r} (known: {notices.known()})")
        if self.plateau_evals < 0:
            raise ConfigError(f"notify.plateau_evals={self.plateau_evals} must be >= 0 (0: no plateau notice)")
        if not self.timeout_s > 0 or self.max_per_hour < 1:
            raise ConfigError("notify.timeout_s must be > 0 and notify.max_per_hour >= 1")

    def sends(self, kind: str) -> bool:
        """Whether notices of `kind` are sent ("all" names every kind, a later version's too)."""
        return notices.wanted(self.events, kind)
