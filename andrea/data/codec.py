"""The run's tokenizer: a byte-level BPE trained with HF `tokenizers`, or a user's `tokenizer.json`.

Reads and writes `tokenizer.json` (HF tokenizers' own format) through `Tokenizer.from_file` / `to_str`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from andrea.data.sources import DataError
from andrea.rundir import regular

EOT = "<|endoftext|>"


class TextCodec:
    """The run's tokenizer (HF tokenizers), with the id of the document separator."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eot = tokenizer.token_to_id(EOT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "TextCodec":
        """Train on `texts` as they stream by (the sample is never held as one list)."""
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, text: str) -> "TextCodec":
        return cls(Tokenizer.from_str(text))

    @classmethod
    def load(cls, path: Path) -> "TextCodec":
        try:
            text = regular.read_text(path)  # a FIFO at tokenizer.json: refused, never waited on
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not a tokenizer file: not UTF-8 text ({e.reason})") from None
        except OSError as e:
            if isinstance(e, regular.NotRegularFile):
                raise
            raise DataError(f"{path}: not a tokenizer file: {e.strerror}") from None
        try:
            return cls(Tokenizer.from_str(text))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise DataError(f"{path}: not a tokenizer file: {str(e).splitlines()[0]}") from None

    def cut_problem(self) -> str | None:
        """Why this tokenizer would encode a document cut into pieces (read.py: cuts.py's places) otherwise than
        the whole document, or None. A prefix space added to every text is the known case (a space per cut)."""
        if _adds_prefix_space(json.loads(self.tokenizer.to_str())):
            return ("its pre-tokenizer adds a prefix space to every text it encodes (ByteLevel or Metaspace with "
                    "add_prefix_space / prepend_scheme), which would put a space at every place andrea cuts a long "
                    "document: save it with add_prefix_space=false (prepend_scheme=\"never\")")
        for a, b in _PROBES:
            if self.encode(a) + self.encode(b) != self.encode(a + b):
                return (f"it encodes {a + b!r} otherwise than {a!r} then {b!r}, and andrea cuts long documents at "
                        f"such places: use a byte-level BPE like GPT-2's")
        return None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


# Texts cut where cuts.py cuts: after a newline, before a space, between a letter run and punctuation or digits.
_PROBES = (("first line\n", "second line"), ("one", " two three"), ("日本語", "，テスト。"), ("abc", "123"),
           ("word", "'s end"))


def _adds_prefix_space(node) -> bool:
    """A ByteLevel/Metaspace pre-tokenizer (or a Prepend normalizer) anywhere in a tokenizer.json that adds a
    space in front of a text."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "ByteLevel" and node.get("add_prefix_space"):
            return True
        if kind == "Metaspace" and (node.get("add_prefix_space") or node.get("prepend_scheme") in ("always",
                                                                                                  "first")):
            return True
        if kind == "Prepend":
            return True
        return any(_adds_prefix_space(v) for k, v in node.items() if k in ("pre_tokenizer", "normalizer",
                                                                             "pretokenizers", "normalizers"))
    if isinstance(node, list):
        return any(_adds_prefix_space(v) for v in node)
    return False
