"""A run's prepared data as the trainer sees it: each arm's token arrays (memory-mapped) and the batch at step t.

Reads `tokenizer.json` and `data/` (manifest.py documents the layout; prepare.py writes it, at `andrea prepare` or
the first start, and for arms added later). A run prepared before the manifest existed (`data/<arm>.train.u16` and
`.val.u16` without a record) is read as it is: the data a run trains on never changes under it. Token files are
memory-mapped, so a trainer's memory does not grow with the corpus.

The batch at step t is a pure function of (seed, t, the arm of each row): row offsets come from a
numpy PCG64 stream keyed by (seed, t), so no iterator position needs saving — the checkpoint's header step is
enough to continue the data stream exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from andrea.config.corpus import DataConfig
from andrea.data import manifest as mf, splits
from andrea.data.codec import EOT, TextCodec  # noqa: F401  (EOT: re-exported for callers of store)
from andrea.data.preparation import prepare_run
from andrea.data.sources import DataError
from andrea.rundir import regular
from andrea.rundir.names import DATA_DIR

log = logging.getLogger("andrea.data")
TRAIN_STREAM, EVAL_STREAM, SAMPLE_STREAM, DROPOUT_STREAM = 0, 1, 2, 3  # independent RNG streams per purpose


def rng_for(seed: int, step: int, stream: int, *extra: int) -> np.random.Generator:
    """A generator that depends only on its key: the source of all data randomness."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, step, *extra])))


@dataclass
class ArmTokens:
    name: str
    train: np.ndarray  # (N,) uint16 or uint32, memory-mapped
    val: np.ndarray  # (M,)


def legacy_arms(cfg: DataConfig, data_dir: Path, manifest: mf.Manifest | None) -> set[str]:
    """Arms prepared before the manifest existed: their pair of .u16 files and no record."""
    known = manifest.arms if manifest else {}
    return {a for a in cfg.arm_names() if a not in known
            and (data_dir / f"{a}.train.u16").exists() and (data_dir / f"{a}.val.u16").exists()}


def prepare(cfg: DataConfig, run_dir: Path, vocab_size: int, block_size: int,
            should_stop: Callable[[], bool] = lambda: False) -> tuple[TextCodec | None, list[ArmTokens]]:
    """Prepare what is not prepared yet, then map the run's arms in `cfg.arm_names()` order."""
    data_dir = run_dir / DATA_DIR
    legacy = legacy_arms(cfg, data_dir, mf.Manifest.load(data_dir))
    codec, manifest, did = prepare_run(cfg, run_dir, vocab_size, should_stop=should_stop, legacy=legacy)
    return codec, load_arms(cfg, data_dir, manifest, legacy, block_size, check_sources=not did)


def load_arms(cfg: DataConfig, data_dir: Path, manifest: mf.Manifest, legacy: set[str], block_size: int,
              check_sources: bool = True) -> list[ArmTokens]:
    """Map every arm's token files; `check_sources`: warn once per arm whose source files changed or vanished
    since they were prepared (the prepared tokens are used all the same)."""
    arms = []
    for name in cfg.arm_names():
        if name in legacy:
            arm = ArmTokens(name, *(np.memmap(data_dir / f"{name}.{s}.u16", dtype="<u2", mode="r")
                                    for s in ("train", "val")))
        else:
            arm = _mapped(data_dir, name, manifest.arms[name], np.dtype(manifest.dtype), cfg.val_fraction,
                          block_size)
            changed = mf.drift(data_dir, name, manifest.arms[name]) if check_sources else []
            if changed and manifest.arms[name].kind == "tokens":
                rec = manifest.arms[name]
                log.warning("data: arm %r: %s since it was checked; training reads the %d tokens recorded then "
                            "(to use the file as it is now, give the source another name)", name, changed[0],
                            rec.train_tokens + rec.val_tokens)
            elif changed:
                log.warning("data: arm %r: %d source file(s) changed or gone since preparation (first: %s); "
                            "training continues on the prepared tokens", name, len(changed), changed[0])
        for split in ("train", "val"):
            if len(getattr(arm, split)) <= block_size + 1:
                raise DataError(f"arm {name!r}: {split} split has {len(getattr(arm, split))} tokens, "
                                f"fewer than block_size + 2 = {block_size + 2}")
        arms.append(arm)
    return arms


def _mapped(data_dir: Path, name: str, rec: mf.ArmRecord, dtype: np.dtype, val_fraction: float,
            block_size: int) -> ArmTokens:
    if rec.kind == "tokens":  # used in place; the held-out tail as before the manifest existed
        n = rec.train_tokens + rec.val_tokens  # exactly the tokens checked and recorded, even if the file grew
        tokens = _map(Path(rec.source), np.dtype(rec.dtype).newbyteorder("<"), n)
        cut = len(tokens) - max(int(len(tokens) * val_fraction), block_size + 1)
        return ArmTokens(name, tokens[:cut], tokens[cut:])
    if rec.train_tokens + rec.val_tokens == 0:
        raise DataError(f"data.sources[{name!r}] ({rec.source}): the source is empty")
    dtype, ext = dtype.newbyteorder("<"), splits.suffix(dtype)
    return ArmTokens(name, *(_map(data_dir / f"{name}.{s}.{ext}", dtype, n)
                             for s, n in (("train", rec.train_tokens), ("val", rec.val_tokens))))


def _map(path: Path, dtype: np.dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    try:
        f = regular.open_file(path)  # a FIFO there: refused, never waited on
    except regular.NotRegularFile:
        raise
    except OSError as e:
        raise DataError(f"{path}: cannot map the prepared tokens: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < n * dtype.itemsize:
            raise DataError(f"{path}: holds {size // dtype.itemsize} tokens, fewer than the {n} recorded in the "
                            f"data manifest: restore the file, or delete the run's data/ to prepare afresh")
        try:
            return np.memmap(f, dtype=dtype, mode="r", shape=(n,))
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot map the prepared tokens: {e}") from None


def rows(arms: list[ArmTokens], arm_ids: np.ndarray, block_size: int, rng: np.random.Generator,
         split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (B, T) int64 for one batch: row i is a random window of arm `arm_ids[i]`'s split."""
    B, T = len(arm_ids), block_size
    x = np.empty((B, T), dtype=np.int64)
    y = np.empty((B, T), dtype=np.int64)
    for i, a in enumerate(arm_ids):
        tokens = getattr(arms[a], split)
        off = int(rng.integers(0, len(tokens) - T - 1))
        window = tokens[off:off + T + 1].astype(np.int64)
        x[i], y[i] = window[:-1], window[1:]
    return torch.from_numpy(x), torch.from_numpy(y)
