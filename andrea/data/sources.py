"""Where an arm's text comes from: the embedded standard-library arms and user text/token sources.

Reads only: the running interpreter's standard library (`stdlib-code`: module source text;
`stdlib-docstrings`: module, class and function docstrings extracted with `ast`; `pydoc-topics`: the
reference-manual prose shipped in `pydoc_data`), and user files named in `[[data.sources]]`.
Documents are visited in a fixed order (sorted by a hash of their relative path, so a byte cap still samples
the whole library) and the text of each arm is capped at `data.max_bytes_per_arm`.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from andrea.config import DataConfig, SourceConfig

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ValueError):
    """A data source that cannot be used; one line naming the source and the problem."""


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _docstrings(source: str) -> Iterator[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old escape sequences in some stdlib modules
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                yield doc


def builtin_documents(name: str) -> Iterator[str]:
    if name == "pydoc-topics":
        from pydoc_data.topics import topics
        yield from (topics[k] for k in sorted(topics))
    elif name == "stdlib-code":
        yield from filter(None, map(_read, stdlib_files()))
    elif name == "stdlib-docstrings":
        for text in filter(None, map(_read, stdlib_files())):
            yield from _docstrings(text)
    else:
        raise DataError(f"data.arms: unknown built-in arm {name!r}")


def source_files(src: SourceConfig) -> list[Path]:
    path = Path(src.path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data.sources[{src.name!r}].path: no file matches {src.path!r}")
    return files


def user_documents(src: SourceConfig) -> Iterator[str]:
    for f in source_files(src):
        text = _read(f)
        if text:
            yield text


def capped(docs: Iterator[str], max_bytes: int) -> Iterator[str]:
    total = 0
    for doc in docs:
        if total >= max_bytes:
            return
        doc = doc[: max_bytes - total]
        total += len(doc.encode("utf-8", errors="ignore"))
        yield doc


def arm_documents(cfg: DataConfig, name: str) -> list[str]:
    """The (capped) documents of a text arm; DataError if it has none."""
    source = next((s for s in cfg.sources if s.name == name), None)
    docs = builtin_documents(name) if source is None else user_documents(source)
    out = list(capped(docs, cfg.max_bytes_per_arm))
    if not out or not any(d.strip() for d in out):
        where = f"data.sources[{name!r}] ({source.path})" if source else f"data.arms[{name!r}]"
        raise DataError(f"{where}: the source is empty")
    return out


def read_token_file(src: SourceConfig, vocab_size: int) -> np.ndarray:
    """A pre-tokenized uint16 file (nanoGPT prepare.py layout), memory-mapped and checked against the vocab."""
    files = source_files(src)
    if len(files) != 1:
        raise DataError(f"data.sources[{src.name!r}].path: a token source must be one file, {len(files)} match")
    size = files[0].stat().st_size
    if size < 4 or size % 2:
        raise DataError(f"{files[0]}: not a uint16 token file ({size} bytes)")
    tokens = np.memmap(files[0], dtype="<u2", mode="r")
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{files[0]}: token id {top} does not fit model.vocab_size={vocab_size}")
    return tokens
