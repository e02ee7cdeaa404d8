"""The run's tokenizer: a byte-level BPE trained with HF `tokenizers`, or a user's `tokenizer.json`.

Reads and writes `tokenizer.json` (HF tokenizers' own format) through `Tokenizer.from_file` / `to_str`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from andrea.data.sources import DataError

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
    def load(cls, path: Path) -> "TextCodec":
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise DataError(f"{path}: not a tokenizer file: {str(e).splitlines()[0]}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
