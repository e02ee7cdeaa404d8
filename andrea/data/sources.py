"""Where an arm's text comes from: the embedded standard-library arms, and the files of user sources.

Reads only: the running interpreter's standard library (`stdlib-code`: module source text;
`stdlib-docstrings`: module, class and function docstrings extracted with `ast`; `pydoc-topics`: the
reference-manual prose shipped in `pydoc_data`), and the names of user files named in `[[data.sources]]`
(read.py reads their content). Documents are visited in a fixed order (sorted by a hash of their relative path,
so a byte cap still samples the whole library); `data.max_bytes_per_arm` caps a built-in arm (prepare.py).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from andrea.config import SourceConfig

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
    if path.is_dir():  # hidden files and directories (.git, .DS_Store) are not documents
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data.sources[{src.name!r}].path: no file matches {src.path!r}")
    return files


def builtin_source_bytes(name: str) -> int | None:
    """The size of a built-in arm's whole text where it is known without reading it all (None: docstrings)."""
    if name == "stdlib-code":
        return sum(p.stat().st_size for p in stdlib_files())
    if name == "pydoc-topics":
        from pydoc_data.topics import topics
        return sum(len(t.encode()) for t in topics.values())
    return None
