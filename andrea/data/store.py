"""A run's prepared data: its tokenizer, each arm's token arrays, and the batch at step t.

Writes, once per run at its first start (and for arms added later), into the run directory:
    tokenizer.json              byte-level BPE trained with HF `tokenizers` on the run's text arms
    data/<arm>.train.u16        little-endian uint16 tokens, documents joined by <|endoftext|>
    data/<arm>.val.u16          the held-out tail of the same stream (`data.val_fraction`)
Each file is written to a temporary name and renamed, so an interrupted preparation is redone, never half-used.
Resume reuses these files: the data a run trains on never changes under it, whatever the machine's stdlib.

The batch at step t is a pure function of (seed, t, the arm of each row): row offsets come from a
numpy PCG64 stream keyed by (seed, t), so no iterator position needs saving — the checkpoint's header step is
enough to continue the data stream exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from andrea.config import DataConfig
from andrea.data.sources import DataError, arm_documents, read_token_file

EOT = "<|endoftext|>"
TRAIN_STREAM, EVAL_STREAM, SAMPLE_STREAM, DROPOUT_STREAM = 0, 1, 2, 3  # independent RNG streams per purpose


def rng_for(seed: int, step: int, stream: int, *extra: int) -> np.random.Generator:
    """A generator that depends only on its key: the source of all data randomness."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, step, *extra])))


class TextCodec:
    """The run's tokenizer (HF tokenizers), with the id of the document separator."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eot = tokenizer.token_to_id(EOT)

    @classmethod
    def train(cls, documents: list[str], vocab_size: int) -> "TextCodec":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(documents, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "TextCodec":
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise DataError(f"{path}: not a tokenizer file: {str(e).splitlines()[0]}") from None

    def encode_documents(self, documents: list[str]) -> np.ndarray:
        ids: list[int] = []
        for enc in self.tokenizer.encode_batch(documents, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(self.eot)
        return np.asarray(ids, dtype=np.uint16)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


@dataclass
class ArmTokens:
    name: str
    train: np.ndarray  # uint16 (N,)
    val: np.ndarray  # uint16 (M,)


def _atomic_save(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.rename(tmp, path)


def prepare(cfg: DataConfig, run_dir: Path, vocab_size: int, block_size: int
            ) -> tuple[TextCodec | None, list[ArmTokens]]:
    """Load (or build at first start) the run's tokenizer and token arrays, in `cfg.arm_names()` order."""
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    token_arms = {s.name for s in cfg.sources if s.kind == "tokens"}
    text_arms = [a for a in cfg.arm_names() if a not in token_arms]
    codec = _tokenizer(cfg, run_dir, vocab_size, text_arms) if text_arms else None
    arms = []
    for name in cfg.arm_names():
        source = next((s for s in cfg.sources if s.name == name), None)
        if source is not None and source.kind == "tokens":
            tokens = read_token_file(source, vocab_size)
            cut = len(tokens) - max(int(len(tokens) * cfg.val_fraction), block_size + 1)
            arm = ArmTokens(name, tokens[:cut], tokens[cut:])
        else:
            arm = _text_arm(cfg, data_dir, name, codec)
        for split in ("train", "val"):
            if len(getattr(arm, split)) <= block_size + 1:
                raise DataError(f"arm {name!r}: {split} split has {len(getattr(arm, split))} tokens, "
                                f"fewer than block_size + 2 = {block_size + 2}")
        arms.append(arm)
    return codec, arms


def _tokenizer(cfg: DataConfig, run_dir: Path, vocab_size: int, text_arms: list[str]) -> TextCodec:
    path = run_dir / "tokenizer.json"
    if cfg.tokenizer != "bpe":
        codec = TextCodec.load(Path(cfg.tokenizer))
    elif path.exists():
        codec = TextCodec.load(path)
    else:
        documents = [d for arm in text_arms for d in arm_documents(cfg, arm)]
        codec = TextCodec.train(documents, vocab_size)
        _atomic_save(path, lambda p: codec.tokenizer.save(str(p)))
    if codec.eot is None:
        raise DataError(f"{path}: tokenizer has no {EOT} token")
    if codec.vocab_size > vocab_size:
        raise DataError(f"{path}: tokenizer has {codec.vocab_size} tokens, more than model.vocab_size={vocab_size}")
    return codec


def _text_arm(cfg: DataConfig, data_dir: Path, name: str, codec: TextCodec) -> ArmTokens:
    train_path, val_path = data_dir / f"{name}.train.u16", data_dir / f"{name}.val.u16"
    if not (train_path.exists() and val_path.exists()):
        tokens = codec.encode_documents(arm_documents(cfg, name))
        cut = len(tokens) - int(len(tokens) * cfg.val_fraction)
        _atomic_save(train_path, lambda p: tokens[:cut].tofile(p))
        _atomic_save(val_path, lambda p: tokens[cut:].tofile(p))
    return ArmTokens(name, np.fromfile(train_path, dtype="<u2"), np.fromfile(val_path, dtype="<u2"))


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
