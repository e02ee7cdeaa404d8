"""The chaos run's decisions (bench/chaos.py), as pure functions over plain data: no processes, files or clock.

- `decide`: the supervisor's next move after `andrea train` exits, as systemd (`Restart=on-failure`) plus an
  operator's runbook would make it: the run directory gone (or a restore left half done) -> `andrea restore`;
  a non-zero exit -> start `train` again; exit 0 at the target -> done; exit 0 short of it after a stop the chaos
  asked for (a preemption) -> start again; exit 0 short of it unasked -> stop and say so (systemd would leave the
  unit stopped there, and starting again would repeat it); exit 2, a configuration the trainer refuses, -> stop
  (a restart cannot fix it: `RestartPreventExitStatus=2`).
- `FAULTS`: each fault's kind, whether it ends the process, whether the run must end with the fault-free run's
  bytes after it and why, and the ledger markers and notices it should leave (the names andrea writes today and
  the ones issue 46 asks for: a name not yet written is reported as missing, not as a failure of the run).
- `faults_in_window`, `attribute`: which fault each ledger marker and notice belongs to (the newest fault
  injected at or before its time).
- `recovery`: per fault, the step the run had reached, the step it resumed from (steps lost), and the seconds from
  the process's exit to the first step of the next one.
- `goodput`, `steady_rate`: steps kept / (wall time x the fault-free run's steps/s).
- `settled`: the ledger's settled step entries (rundir/ledger.history) with their times dropped, for the bytes
  verdict; `first_broken`: which fault's recovery first diverged from the fault-free run (or what can be said).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RESTORE, RESTART, DONE, SHORT, REFUSED = "restore", "restart", "done", "short", "refused"
CONFIG_EXIT = 2  # `train`'s exit status for a bad configuration or command line (docs/operating.md)


@dataclass(frozen=True)
class DirState:
    """What the supervisor sees of the run directory after an exit."""

    gone: bool          # no run.toml, no ledger, no checkpoint: the machine's disk was lost
    restore_partial: bool  # `restore.partial`: an interrupted restore (train refuses the directory)
    newest: int | None  # the newest checkpoint's step on disk


def decide(rc: int, state: DirState, target: int, stop_requested: bool) -> str:
    """The supervisor's next action after `andrea train` exited with `rc`."""
    if state.gone or state.restore_partial:
        return RESTORE
    if rc == CONFIG_EXIT:
        return REFUSED
    if rc != 0:
        return RESTART
    if state.newest is not None and state.newest >= target:
        return DONE
    return RESTART if stop_requested else SHORT


@dataclass(frozen=True)
class Fault:
    kind: str
    what: str
    exits: bool                 # the trainer process ends (the supervisor acts)
    keeps_bytes: bool           # the final checkpoint must equal the fault-free run's
    why: str                    # why the bytes are (or are not) kept, from the code
    markers: tuple[tuple[str, ...], ...] = ()  # ledger events expected, each as its candidate names
    notices: tuple[tuple[str, ...], ...] = ()  # notice kinds expected, each as its candidate names


# The names of the records issue 46 adds (docs/formats.md's ledger markers, control/observe/notify.py's notices): matched by
# the ledger line's / the notice's "event" field; a name andrea does not write yet is reported missing.
QUARANTINE = ("quarantine",)      # a checkpoint that failed its checksum, moved to quarantine/
BELOW_NEWEST = ("resume_below",)  # a start that resumed below the newest checkpoint, and why
OUTAGE = ("replica_down",)        # the store stopped answering
CATCH_UP = ("replica_back",)      # it answers again (the replica catches up)

FAULTS: dict[str, Fault] = {f.kind: f for f in (
    Fault("sigterm", "SIGTERM to the trainer (a preemption): a clean stop with a checkpoint", True, True,
          "the stop checkpoints the step reached; the next start resumes it exactly",
          markers=(("resume",),), notices=(("stopped",),)),
    Fault("sigkill", "SIGKILL to the trainer (a crash)", True, True,
          "the next start resumes the newest checkpoint and trains the lost steps again to the same bytes",
          markers=(("resume",),)),
    Fault("bitflip", "SIGKILL, then one mantissa bit flipped in the newest checkpoint's weights", True, True,
          "the start's checksum check quarantines the file and resumes the next older one; the steps after it are "
          "trained again", markers=(("resume",), QUARANTINE, BELOW_NEWEST), notices=(QUARANTINE, BELOW_NEWEST)),
    Fault("loss", "SIGKILL, then the run directory deleted (the machine lost); `andrea restore` from the replica",
          True, True, "restore brings back a checkpoint whose bytes verify and the ledger it vouches for; training "
          "from it repeats the lost steps", markers=(("resume",),)),
    Fault("hang", "a hung rank under torchrun (2 CPU ranks, ANDREA_TEST_HANG on rank 1 one step after the resume)",
          True, True, "the hung job commits no checkpoint (it hangs before the next cadence); the next one-process "
          "start resumes the same checkpoint. A job that committed a checkpoint would not keep the bytes: two ranks "
          "reduce in another float order", markers=(("stall",),), notices=(("stall",),)),
    Fault("outage", "the S3 server killed, then started again on the same ports", False, True,
          "uploads run beside training and never touch the trainer's state", markers=(OUTAGE, CATCH_UP),
          notices=(OUTAGE, CATCH_UP)),
    Fault("disk", "the run directory's filesystem filled to the last byte, then freed", False, True,
          "a failed checkpoint write is retried at the next cadence, a failed ledger append is rolled back and "
          "written again: training never stops or changes", notices=(("write_error",),)),
    Fault("poison", "a poisoned step (ANDREA_TEST_POISON_STEPS: the record of step n reads loss = NaN)", False,
          True, "the guard rolls back to its known-good checkpoint and moves the data stream by T - G (a remedy), so "
          "the bytes differ from a run never poisoned; they equal the fault-free run given the same poisoned step "
          "(the same command), because the guard's state and its decisions are a function of the records and "
          "travel in every checkpoint's guard companion", markers=(("incident",), ("rollback",)),
          notices=(("incident",), ("rollback",))),
)}
ORDER = ("sigterm", "poison", "sigkill", "hang", "bitflip", "outage", "disk", "loss")  # poison, hang: after an exit


@dataclass
class Injected:
    """One fault as it happened (times are Unix seconds, the ledger's clock)."""

    kind: str
    at: float                       # when it was injected
    exit_at: float | None = None    # when the trainer it ended exited (None: it ended none)
    reached: int | None = None      # the ledger's newest step when it struck
    notes: list[str] = field(default_factory=list)


def attribute(times: list[float], injected: list[Injected]) -> list[int | None]:
    """For each time, the index of the newest fault injected at or before it (None: before the first fault)."""
    out: list[int | None] = []
    for t in times:
        idx = None
        for i, f in enumerate(injected):
            if f.at <= t:
                idx = i
        out.append(idx)
    return out


def matches(expected: tuple[tuple[str, ...], ...], seen: list[str]) -> list[tuple[str, str | None]]:
    """Each expected item as (its candidate names joined, the name found among `seen` or None: missing)."""
    return [("|".join(names), next((n for n in names if n in seen), None)) for names in expected]


def first_step_after(entries: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The first step entry recorded after time t."""
    return next((e for e in entries if "event" not in e and e["time"] > t), None)


def resumed_step(entries: list[dict[str, Any]], t: float) -> int | None:
    """The step the first start/resume/rollback marker after time t continues from."""
    return next((e["step"] for e in entries if e.get("event") in ("start", "resume", "rollback") and e["time"] > t),
                None)


@dataclass(frozen=True)
class Recovery:
    reached: int | None
    resumed: int | None
    lost: int | None
    seconds: float | None  # exit -> first new step (None: no exit, or no step after it)


def recovery(fault: Injected, entries: list[dict[str, Any]], until: float | None = None) -> Recovery:
    """Steps lost and seconds to the first new step for one fault (a fault without an exit: from its injection to
    the first step after a rollback it caused, steps lost = the rollback's T - G). `until`: the next fault's time,
    where this one's seconds stop counting (a restart that meets the next fault is that fault's too)."""
    if fault.exit_at is not None:
        resumed = resumed_step(entries, fault.exit_at)
        first = first_step_after(entries, fault.exit_at)
        end = first["time"] if first else None
        if until is not None and until > fault.exit_at and (end is None or end > until):
            end = until
        seconds = end - fault.exit_at if end is not None else None
    else:
        rollback = next((e for e in entries if e.get("event") == "rollback" and e["time"] >= fault.at), None)
        if rollback is None:
            return Recovery(fault.reached, None, 0, None)
        resumed = rollback["step"]
        first = first_step_after(entries, rollback["time"])
        seconds = first["time"] - fault.at if first else None
        return Recovery(rollback.get("from"), resumed, rollback.get("from", resumed) - resumed, seconds)
    lost = fault.reached - resumed if fault.reached is not None and resumed is not None else None
    return Recovery(fault.reached, resumed, lost, seconds)


def steady_rate(entries: list[dict[str, Any]], skip: int = 1) -> float:
    """Steps/s of a fault-free run: its effective step entries from the `skip`-th to the last (the first step pays
    for the process's warm-up, not for training)."""
    steps = [e for e in entries if "event" not in e][skip:]
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        raise ValueError("too few timed steps for a rate")
    return (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"])


def segment_rate(entries: list[dict[str, Any]], spans: list[tuple[float, float]]) -> float | None:
    """Steps/s of a run's own processes while they trained: within each (start, exit) span, its step entries from
    the second to the last (restarts and the first step's warm-up excluded), pooled over the spans."""
    steps = seconds = 0.0
    for start, end in spans:
        inside = [e for e in entries if "event" not in e and start < e["time"] <= end][1:]
        if len(inside) >= 2:
            steps += inside[-1]["step"] - inside[0]["step"]
            seconds += inside[-1]["time"] - inside[0]["time"]
    return steps / seconds if seconds > 0 else None


def high_water(entries: list[dict[str, Any]], t: float) -> int:
    """The highest step any step entry recorded by time t reached: the run's new ground (steps trained again after a
    crash or a rollback do not move it)."""
    return max((e["step"] for e in entries if "event" not in e and e["time"] <= t), default=0)


def window_loss(entries: list[dict[str, Any]], start: float, end: float, rate: float) -> tuple[int, float]:
    """(new steps, seconds lost) between two times: the window's length less what its new steps take at the
    fault-free rate. The windows between consecutive faults add up to the run's whole loss, wall - kept / rate."""
    gained = high_water(entries, end) - high_water(entries, start)
    return gained, (end - start) - gained / rate


def goodput(steps_kept: int, wall_s: float, rate: float) -> float:
    """Steps kept / (wall time x the fault-free steps/s): 1.0 is a run that lost nothing to its faults."""
    if wall_s <= 0 or rate <= 0:
        raise ValueError(f"wall time {wall_s} s and rate {rate} steps/s must be > 0")
    return steps_kept / (wall_s * rate)


SETTLED_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "phase")


def settled(history: list[dict[str, Any]], upto: int) -> list[tuple]:
    """The settled step entries (the effective history up to the final checkpoint) without their times."""
    return [tuple(e.get(k) for k in SETTLED_FIELDS) for e in history if e["step"] <= upto]


def loss_may_strike(replica_step: int | None, poison_step: int | None) -> bool:
    """Whether the loss of the machine may strike now without erasing an earlier fault's record.

    A guard rollback is written only in the run directory until the replica holds a checkpoint past the poisoned
    step; a loss before that restores a run that never met the poison (the test hook poisons one process), which
    then trains the original data where the command's run skipped it: a different run, not a lost one. So the loss
    waits for the replica to hold a checkpoint past the poisoned step (faults do not overlap)."""
    return poison_step is None or (replica_step or 0) > poison_step


def first_broken(recoveries: list[tuple[str, int | None]], same_checkpoint: bool, first_different_step: int | None,
                 compared_through: int) -> str:
    """Which fault's recovery first diverged from the fault-free run, in one sentence; `recoveries`: each fault
    injected, in order, as (kind, the step its recovery resumed from; None: it caused none). The settled ledger
    entry of step D was written after the LAST recovery that resumed below D (a later one resumed at or above D,
    or superseded it), so a ledger that differs first at step D names that fault; the checkpoint alone differing,
    with every settled entry through `compared_through` equal, cannot be pinned on a fault by the ledger."""
    if first_different_step is None:
        if same_checkpoint:
            return "no fault changed the bytes"
        return (f"every settled ledger entry through step {compared_through} equals the fault-free run's, the "
                "checkpoint does not: which fault changed the weights cannot be told from the ledger (compare the "
                "kept run's checkpoints with the fault-free run's, oldest first)")
    d = first_different_step
    culprit = next(((i, kind, g) for i, (kind, g) in reversed(list(enumerate(recoveries)))
                    if g is not None and g < d), None)
    if culprit is None:
        return f"the ledger differs from step {d}, before any fault's recovery: the run itself is not reproducible"
    i, kind, g = culprit
    return (f"fault #{i + 1} ({kind}) broke them: its recovery resumed from step {g}, and the steps it trained "
            f"again differ from the fault-free run's from step {d}")
