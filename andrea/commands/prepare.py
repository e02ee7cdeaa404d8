"""`python -m andrea prepare`: a run's data prepared without training (on a CPU box, before the GPU is free).

Writes what data/preparation.py writes (`tokenizer.json`, `data/`) and the resolved `run.toml`, so that a later
`andrea train --run-dir DIR` trains on exactly this preparation. Holds the run's lock (a trainer and a
preparation never write one run at once). SIGTERM or Ctrl-C stops at the next chunk with everything done kept,
exit 0; running it again continues, and on a prepared run it does nothing and says so.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from andrea.commands.run_config import make_run_dir, resolve_config
from andrea.config.schema import RunConfig
from andrea.data import manifest as mf, store
from andrea.data.preparation import Interrupted, anchor_paths, check_unchanged, prepare_run
from andrea.control.run import early_signals
from andrea.rundir import atomic, names
from andrea.rundir.runlock import RunLock


class StopFlag:
    """SIGTERM / SIGINT handlers that only record (the preparation polls between chunks)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.previous = {sig: signal.signal(sig, self._set) for sig in (signal.SIGTERM, signal.SIGINT)}
        if (early := early_signals.take()) is not None:  # received while the process started
            self._set(signal.Signals[early], None)

    def _set(self, signum: int, frame: object) -> None:
        if self.signal == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: leave now (every committed piece stays valid)
        self.signal = signal.Signals(signum).name
        sys.stderr.write(f"andrea: {self.signal} received: stopping data preparation at the next chunk\n")

    def __call__(self) -> bool:
        return self.signal is not None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def prepare_command(cfg: RunConfig, run_dir: Path, out=None) -> int:
    out = out or sys.stdout  # the stream of the moment (a default argument would be bound at import)
    stop = StopFlag()
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        data_dir = run_dir / names.DATA_DIR
        check_unchanged(cfg.data, mf.Manifest.load(data_dir))  # before run.toml says otherwise
        atomic.write_atomic(run_dir / names.CONFIG_NAME, cfg.to_toml().encode())
        legacy = store.legacy_arms(cfg.data, data_dir, mf.Manifest.load(data_dir))
        try:
            _, manifest, did = prepare_run(cfg.data, run_dir, cfg.model.vocab_size, should_stop=stop, legacy=legacy)
        except Interrupted as e:
            print(e, file=out)
            return 0
        arms = store.load_arms(cfg.data, data_dir, manifest, legacy, cfg.model.block_size,  # checks the splits
                               check_sources=not did)
        train = sum(len(a.train) for a in arms)
        val = sum(len(a.val) for a in arms)
        verb = "prepared" if did else "already prepared, nothing to do:"
        print(f"data {verb} {len(arms)} arm(s), {train:,} train + {val:,} val tokens in {data_dir}", file=out)
        return 0
    finally:
        lock.release()
        stop.restore()


def cmd_prepare(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    cfg = resolve_config(args, run_dir)
    anchor_paths(cfg.data, run_dir / names.DATA_DIR)  # run.toml records where a new source is, absolutely
    make_run_dir(run_dir)
    return prepare_command(cfg, run_dir)
