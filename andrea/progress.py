"""Progress for people: a live tqdm bar on a terminal, plain periodic log lines otherwise (systemd, files)."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("andrea.progress")


class Progress:
    def __init__(self, start: int, stop: int, tokens_per_step: int, log_every: int):
        self.start, self.stop, self.tokens_per_step, self.log_every = start, stop, tokens_per_step, log_every
        self.t0 = time.monotonic()
        self.bar = tqdm(total=stop, initial=start, unit="step", dynamic_ncols=True) if sys.stderr.isatty() else None

    def update(self, step: int, loss: float, lr: float) -> None:
        done = step - self.start
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        tok_s = done * self.tokens_per_step / elapsed
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.refresh()
        elif step % self.log_every == 0:
            eta = (self.stop - step) * elapsed / max(done, 1)
            log.info("step %d/%d loss %.4f lr %.3e %.0f tok/s eta %s", step, self.stop, loss, lr, tok_s,
                     time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 86400 else f"{eta / 86400:.1f}d")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
