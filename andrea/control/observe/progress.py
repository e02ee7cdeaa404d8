"""Progress for people: a live tqdm bar on a terminal, plain periodic log lines otherwise (systemd, files).

Three reporters share `_Reporter` (the bar or the log, and when a log line is due) and `eta`: the training loop's
`Progress`, data preparation's `ByteProgress` (data/preparation.py) and `andrea eval`'s `CountProgress`.
Writes to stderr (the bar) or the `andrea.control.observe.progress` log. While a bar is on the terminal every log
record goes through tqdm (`logging_redirect_tqdm`): a line is printed above the bar, never glued to its tail.
Without a terminal the training loop's first line comes at its first step (then every `train.log_every`), and
once `TIMED_STEPS` steps are timed one line says the seconds per step and when the target step will be reached.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("andrea.control.observe.progress")


def eta(left: float, rate: float) -> str:
    """The time `left` more units take at `rate` per second (0 when there is no rate yet): H:M:S, days past one."""
    seconds = left / rate if rate > 0 else 0.0
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f}d"


class _Reporter:
    """A tqdm bar when `bar` is asked and stderr is a terminal, else log lines at most every LOG_SECONDS."""

    LOG_SECONDS = 0.0

    def __init__(self, bar: bool, **tqdm_kw):
        self.t0 = self.last_log = time.monotonic()
        self.bar = tqdm(dynamic_ncols=True, **tqdm_kw) if bar and sys.stderr.isatty() else None
        self._redirect = contextlib.ExitStack()
        if self.bar is not None:  # the root logger's stream handlers write through tqdm.write while the bar lives
            self._redirect.enter_context(logging_redirect_tqdm())

    def log_due(self, now: float) -> bool:
        """Without a bar, LOG_SECONDS after the last line: a line is due (and counted as said)."""
        if self.bar is not None or now - self.last_log < self.LOG_SECONDS:
            return False
        self.last_log = now
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._redirect.close()


class Progress(_Reporter):
    """The training loop's progress: step, loss, lr, tokens/s since this process started, and the model FLOP/s
    and MFU over the last steps (andrea/control/observe/mfu.py) — MFU as a percentage, or `no_peak` (the reason, said once at
    the start: a CPU, a GPU not in the table) when there is no peak to measure against."""

    TIMED_STEPS = 10  # the steps timed before the ETA is said (the first ones include warm-up and compiles)

    def __init__(self, start: int, stop: int, tokens_per_step: int, log_every: int):
        self.start, self.stop, self.tokens_per_step, self.log_every = start, stop, tokens_per_step, log_every
        self.first_at: float | None = None  # when the first step of this process ended
        self.eta_said = False
        super().__init__(True, total=stop, initial=start, unit="step")

    def update(self, step: int, loss: float, lr: float, flops: float | None = None, mfu: float | None = None) -> None:
        done = step - self.start
        now = time.monotonic()
        elapsed = max(now - self.t0, 1e-9)
        if self.first_at is None:
            self.first_at = now
        elif done > self.TIMED_STEPS and not self.eta_said:
            self.say_eta(step, now)
        tok_s = done * self.tokens_per_step / elapsed
        extra = {} if flops is None else {"tflops": f"{flops / 1e12:.3g}",
                                          "mfu": "no_peak" if mfu is None else f"{100 * mfu:.1f}%"}
        model = f"{extra['tflops']} TFLOP/s mfu {extra['mfu']}" if extra else ""
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", **extra, refresh=False)
            self.bar.refresh()
        elif step % self.log_every == 0 or done == 1:  # the first line at the first step
            log.info("step %d/%d loss %.4f lr %.3e %.0f tok/s %seta %s", step, self.stop, loss, lr, tok_s,
                     model + " " if model else "", eta(self.stop - step, max(done, 1) / elapsed))


    def say_eta(self, step: int, now: float) -> None:
        """Once, when steps are timed (after the first, which includes warm-up): seconds per step and when the
        target step comes at that rate."""
        self.eta_said = True
        per_step = (now - self.first_at) / max(step - self.start - 1, 1)
        left = (self.stop - step) * per_step
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + left))
        log.info("timed: %.3g s/step over steps %d-%d; step %d in %s (%s)", per_step, self.start + 2, step,
                 self.stop, eta(left, 1.0), when)


class ByteProgress(_Reporter):
    """Data preparation's progress: a tqdm bar of source bytes on a terminal, a log line every few seconds otherwise.

    `base` is the bytes of arms already done in this call; `advance` takes the current arm's bytes read and the
    tokens written so far. A resumed preparation starts at what earlier runs did: the rate counts this run's."""

    LOG_SECONDS = 5.0

    def __init__(self, total: int, what: str):
        self.total, self.what, self.base, self.tokens, self.first = total, what, 0, 0, None
        super().__init__(bool(total), total=total, unit="B", unit_scale=True, desc=what)

    def advance(self, arm_bytes: int, arm_tokens: int) -> None:
        done = min(self.base + arm_bytes, self.total)
        now = time.monotonic()
        if self.first is None:  # the first report: what earlier runs did (0 unless resumed)
            self.first, self.t0 = done, now
        rate = (done - self.first) / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix(tokens=f"{arm_tokens:,}", refresh=False)
            self.bar.refresh()
        elif self.log_due(now):
            log.info("%s: %.1f of %.1f MB (%.0f %%), %s tokens in this arm, %.2f MB/s, eta %s", self.what,
                     done / 1e6, self.total / 1e6, 100 * done / max(self.total, 1), f"{arm_tokens:,}", rate / 1e6,
                     eta(self.total - done, rate))


class CountProgress(_Reporter):
    """Items done out of a known total (`andrea eval`'s examples): a tqdm bar on a terminal, a log line every
    LOG_SECONDS otherwise. Called with the number of items each piece of work finished."""

    LOG_SECONDS = 10.0

    def __init__(self, total: int, what: str, unit: str):
        self.total, self.what, self.unit, self.done = total, what, unit, 0
        super().__init__(True, total=total, unit=unit, desc=what)

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(n)
        elif self.log_due(now):
            rate = self.done / max(now - self.t0, 1e-9)
            log.info("%s: %d of %d %s (%.0f %%), %.1f %s/s, eta %s", self.what, self.done, self.total, self.unit,
                     100 * self.done / max(self.total, 1), rate, self.unit, eta(self.total - self.done, rate))
