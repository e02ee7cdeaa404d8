"""The run configuration's data sections: where the tokens come from (`[data]`, its `[[data.sources]]` arms) and
the bounds on the mixture the data proxy's bandit draws them in (`[policy]`).

Part of the schema (andrea/config/schema.py, whose RunConfig holds these sections): dataclasses checked on
construction, each field with the docstring andrea/config/doc.py puts in docs/configuration.md; an out-of-range
value raises `ConfigError` with one line naming the key. Reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from andrea.config.check import ConfigError, build


@dataclass
class SourceConfig:
    """A user data source ("arm"): text, JSON lines or parquet (prepared into token files), or a token file."""

    name: str
    """Arm name: unique among arms, used in policy caps/floors and in .state.json; it names the arm's files in
    `data/`, so it holds no `/` or `\\` and does not start with a dot."""
    path: str
    """A file, a directory or a glob (`**` recurses; symbolic links are followed, each directory once); gzip, zstd,
    bzip2 and xz files (told by their first bytes) are decompressed as they are read. A relative path is made
    absolute against the working directory when the source is first prepared (run.toml keeps it so)."""
    kind: str = "text"
    """text (each file one document) | jsonl (one JSON object per line) | parquet (one row per document) | tokens
    (one flat little-endian token file, as nanoGPT's prepare.py writes; used in place, never copied)"""
    field: str = "text"
    """jsonl: the top-level key that holds each document's text; parquet: the column."""
    dtype: str = "uint16"
    """tokens: uint16 | uint32, the file's token width."""
    max_bytes: int = 0
    """Cap on the text prepared from this source, in bytes of UTF-8; 0 (the default) prepares the whole source."""

    def __post_init__(self) -> None:
        where = f"data.sources[{self.name!r}]"
        if not self.name or self.name.startswith(".") or any(c in self.name for c in "/\\\0"):
            raise ConfigError(f"{where}.name must be non-empty, hold no '/' or '\\' and not start with '.': it "
                              "names the arm's files in data/")
        if self.kind not in SOURCE_KINDS:
            raise ConfigError(f"{where}.kind={self.kind!r} must be one of {', '.join(SOURCE_KINDS)}")
        if self.dtype not in ("uint16", "uint32"):
            raise ConfigError(f"{where}.dtype={self.dtype!r} must be 'uint16' or 'uint32'")
        if self.max_bytes < 0:
            raise ConfigError(f"{where}.max_bytes={self.max_bytes} must be >= 0 (0: the whole source)")
        if not self.field:
            raise ConfigError(f"{where}.field must not be empty")


SOURCE_KINDS = ("text", "jsonl", "parquet", "tokens")
BUILTIN_ARMS = ("stdlib-docstrings", "stdlib-code", "pydoc-topics")


@dataclass
class DataConfig:
    """The training data: built-in and user arms, the tokenizer, the held-out split."""

    arms: list[str] = field(default_factory=lambda: list(BUILTIN_ARMS))
    """Built-in arms to train on (embedded, offline): any of stdlib-docstrings, stdlib-code, pydoc-topics."""
    sources: list[SourceConfig] = field(default_factory=list)
    """User arms, `[[data.sources]]` tables with name, path, kind."""
    max_bytes_per_arm: int = 8_000_000
    """Cap on the text of each built-in arm (the embedded corpus is small); user sources are prepared whole unless
    their own `max_bytes` is set. A cap that cuts an arm is logged with how much was used of how much."""
    tokenizer_sample_bytes: int = 16_000_000
    """Text the BPE tokenizer is trained on: a deterministic sample drawn evenly across the text arms and their
    files (the head of each chosen file), so training time and memory do not grow with the corpus."""
    val_fraction: float = 0.05
    """Share of each arm held out for validation (never trained on)."""
    tokenizer: str = "bpe"
    """bpe: train a byte-level BPE at the first start; or a path to an existing HF tokenizer.json (made absolute,
    and a missing file refused in one line, before the run directory is touched)."""

    def __post_init__(self) -> None:
        self.sources = [s if isinstance(s, SourceConfig) else build(  # a table as a dict: checked like TOML
                        SourceConfig, s, "data.sources")
                        for s in self.sources]
        unknown = [a for a in self.arms if a not in BUILTIN_ARMS]
        if unknown:
            raise ConfigError(f"data.arms: unknown built-in arm {unknown[0]!r} (known: {', '.join(BUILTIN_ARMS)})")
        names = self.arm_names()
        if not names:
            raise ConfigError("data: no arms configured (data.arms and data.sources are both empty)")
        if len(set(names)) != len(names):
            raise ConfigError(f"data: arm names must be unique, got {names}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        if self.max_bytes_per_arm < 1 or self.tokenizer_sample_bytes < 1:
            raise ConfigError("data.max_bytes_per_arm and data.tokenizer_sample_bytes must be >= 1")

    def arm_names(self) -> list[str]:
        return list(self.arms) + [s.name for s in self.sources]


@dataclass
class PolicyConfig:
    """The operator's bounds on the data mixture (docs/formats.md) and the bandit's knobs."""

    caps: dict[str, float] = field(default_factory=dict)
    """Per-arm maximum share; arms not listed are uncapped (1.0)."""
    floors: dict[str, float] = field(default_factory=dict)
    """Per-arm minimum share; arms not listed have floor 0."""
    update_every: int = 10
    """The bandit updates its mixture every this many steps, from the losses of the finished window."""
    eta: float = 0.1
    """EXP3 learning rate on rescaled rewards."""
    gamma: float = 0.05
    """EXP3 exploration: share of uniform mixing before the caps/floors projection."""
    target: dict[str, float] = field(default_factory=dict)
    """The objective the mixture serves: a weight per arm on its held-out loss (arms not listed weigh 1; the
    weights are normalised to sum 1). Default: the mean over the configured arms, what `eval` markers report as
    `target_loss`. An arm of weight 0 is sampled only as far as it helps the others (and its floor binds)."""

    def __post_init__(self) -> None:
        if self.update_every < 1 or self.eta <= 0 or not 0.0 <= self.gamma <= 1.0:
            raise ConfigError("policy.update_every must be >= 1, policy.eta > 0 and policy.gamma in [0, 1]")

    def target_weights(self, arms: list[str]) -> list[float]:
        """The normalised target weight of each arm in `arms` (validated by andrea/control/mixture/policy.py)."""
        raw = [float(self.target.get(a, 1.0)) for a in arms]
        return [w / sum(raw) for w in raw]
