"""The test hooks: every `ANDREA_TEST_*` environment variable andrea reads, read here and nowhere else.

Each one makes a test or fault campaign able to see or provoke something a real run only meets by chance (a kill
inside the commit window, a divergence at a chosen step, an out-of-memory, a hung thread). Unset, each one is a
no-op: production never sets them. Each function reads its variable when called; the module that calls it says
so where it reads it (`testhooks.<name>()`), and reads it at the moment given below. The training step's hooks
(poison, flip, hang, step delay) reach the step through one seam, control/run/step_hooks.py, which production never
builds. Reads the environment only.

    variable                       read by (when)                          what it does; used by
    ANDREA_TEST_COMMIT_DELAY=s     control/commit/writer.py (each writer)          sleep s after a checkpoint's `.tmp` is
                                                                           complete, before the rename: the commit
                                                                           window made observable (tests/faults/,
                                                                           tests/e2e/test_signals.py)
    ANDREA_TEST_STEP_DELAY=s       control/run/step_hooks.py (each TrainingRun)    sleep s after each step: a window for
                                                                           signals (tests/e2e/test_guard_run.py,
                                                                           test_watchdog_run.py, test_replica_run.py,
                                                                           test_microbatch.py, test_chaos.py), or
                                                                           a job paced while a test talks to it
                                                                           (test_distributed.py)
    ANDREA_TEST_POISON_STEPS=n,..  control/run/step_hooks.py (each TrainingRun)    the step record of header step n reads
                                                                           loss = NaN the first time this process
                                                                           reaches n (weights untouched): a
                                                                           divergence the guard meets
                                                                           (tests/e2e/test_guard_run.py,
                                                                           test_durability.py and others)
    ANDREA_TEST_OOM_ROWS=r         control/run/trainer.py (each Trainer)           a pass over more than r rows raises
                                                                           torch.OutOfMemoryError after its forward
                                                                           (tests/e2e/test_microbatch.py)
    ANDREA_TEST_HANG=w@s[@r]       control/observe/watchdog.py (each call)         the training (w = train) or I/O (w = io)
                                                                           thread hangs for good at step s, on rank
                                                                           r or every rank, once per process
                                                                           (tests/e2e/test_watchdog_run.py); w =
                                                                           start, s = 0: the start hangs in its data
                                                                           preparation, s = 1: on the event loop's
                                                                           thread before the checkpoint is read
                                                                           (tests/faults/test_special_files.py)
    ANDREA_TEST_FILE_DELAY=s       data/encode.py (each arm's job)         sleep s after each source file of a
                                                                           preparation (tests/e2e/test_prepare_cli.py)
    ANDREA_TEST_STOP_AT_COMMIT=k   data/encode.py (each preparation)       a stop request right after the k-th
                                                                           commit of a preparation
                                                                           (tests/unit/data/test_stop_points.py,
                                                                           test_edges.py)
    ANDREA_TEST_REPLICA_BACKOFF=s  control/replica/replicator.py (each replica)    the first retry's delay after a failed
                                                                           pass (default 1 s)
                                                                           (tests/e2e/test_replica_run.py)
    ANDREA_TEST_REPLICA_DELAY=s    control/replica/remote.py (each upload)          sleep s after each piece of a `.bin`
                                                                           read for its upload: a slow store
                                                                           (tests/e2e/test_replica_run.py)
    ANDREA_TEST_FLIP_WEIGHT=s@r    control/run/step_hooks.py (each TrainingRun)    one mantissa bit of one weight flipped on
                                                                           rank r after the update that reaches
                                                                           header step s, once per process: a
                                                                           silently corrupted GPU, which the ranks'
                                                                           digests must catch (control/parallel/agreement.py;
                                                                           tests/e2e/test_distributed.py)
    ANDREA_TEST_START_GRACE=s      commands/train.py (each train)          seconds a stop signal may wait for a
                                                                           blocked start before the process ends
                                                                           (control/run/start_deadline.py; default
                                                                           20) (tests/faults/test_special_files.py)
"""

from __future__ import annotations

import os

from andrea.config.check import ConfigError

PREFIX = "ANDREA_TEST_"


def _number(name: str, default: float = 0.0) -> float:
    return float(os.environ.get(PREFIX + name, "") or default)


def commit_delay() -> float:
    """ANDREA_TEST_COMMIT_DELAY: seconds between a checkpoint's complete `.tmp` and its rename (0: none)."""
    return _number("COMMIT_DELAY")


def step_delay() -> float:
    """ANDREA_TEST_STEP_DELAY: seconds slept after each training step (0: none)."""
    return _number("STEP_DELAY")


def poison_steps() -> set[int]:
    """ANDREA_TEST_POISON_STEPS ("33" or "33,70"; empty: none): the header steps whose loss reads NaN once."""
    return parse_poison_steps(os.environ.get(PREFIX + "POISON_STEPS", ""))


def parse_poison_steps(text: str) -> set[int]:
    """The steps of ANDREA_TEST_POISON_STEPS; ConfigError for anything but header steps >= 1, comma-separated."""
    try:
        steps = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        steps = {0}
    if min(steps, default=1) < 1:
        raise ConfigError(f"ANDREA_TEST_POISON_STEPS={text!r}: expected header steps >= 1, comma-separated")
    return steps


OOM_ROWS = PREFIX + "OOM_ROWS"  # named in the injected error's message


def oom_rows() -> int:
    """ANDREA_TEST_OOM_ROWS: a pass over more rows than this runs out of memory (0: never)."""
    return int(os.environ.get(OOM_ROWS, "0") or 0)


def hang() -> str:
    """ANDREA_TEST_HANG: `<train|io>@<step>[@<rank>]`, or empty (control/observe/watchdog.py's test_hang reads it)."""
    return os.environ.get(PREFIX + "HANG", "")


def file_delay() -> float:
    """ANDREA_TEST_FILE_DELAY: seconds slept after each source file a preparation encodes (0: none)."""
    return _number("FILE_DELAY")


def stop_at_commit() -> int:
    """ANDREA_TEST_STOP_AT_COMMIT: a preparation stops right after its k-th commit (0: never)."""
    return int(os.environ.get(PREFIX + "STOP_AT_COMMIT", "0") or 0)


def start_grace() -> float | None:
    """ANDREA_TEST_START_GRACE: seconds a stop waits for a blocked start (None: control/run/start_deadline.py's)."""
    return _number("START_GRACE") or None


def replica_backoff() -> float:
    """ANDREA_TEST_REPLICA_BACKOFF: the replica's first retry delay in seconds (default 1)."""
    return _number("REPLICA_BACKOFF", 1.0)


def replica_delay() -> float:
    """ANDREA_TEST_REPLICA_DELAY: seconds slept after each piece of a `.bin` read for its upload (0: none)."""
    return _number("REPLICA_DELAY")


def flip_weight() -> tuple[int, int] | None:
    """ANDREA_TEST_FLIP_WEIGHT: (header step, rank) of the one weight bit to flip ("40@1"; no rank: 0); None: unset.
    Anything else is one line (ConfigError)."""
    text = os.environ.get(PREFIX + "FLIP_WEIGHT", "")
    if not text:
        return None
    step, _, rank = text.partition("@")
    try:
        return int(step), int(rank or 0)
    except ValueError:
        raise ConfigError(f"{PREFIX}FLIP_WEIGHT={text!r}: expected <header step>@<rank>") from None
