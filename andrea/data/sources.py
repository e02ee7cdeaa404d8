"""Where an arm's text comes from: the embedded standard-library arms, and the files of user sources.

Reads only: the running interpreter's standard library (`stdlib-code`: module source text;
`stdlib-docstrings`: module, class and function docstrings extracted with `ast`; `pydoc-topics`: the
reference-manual prose shipped in `pydoc_data`), and the names of user files named in `[[data.sources]]`
(read.py reads their content). Documents are visited in a fixed order (sorted by a hash of their relative path,
so a byte cap still samples the whole library); `data.max_bytes_per_arm` caps a built-in arm (prepare.py).
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import hashlib
import os
import re
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from andrea.errors import UserError
from andrea.config.corpus import SourceConfig

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(UserError, ValueError):
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


def walk(root: Path) -> Iterator[Path]:
    """Every file under `root` (hidden ones, .git or .DS_Store, excepted), symbolic links followed but each real
    directory entered once: a link back up the tree (a loop) or a second link to one directory adds nothing."""
    seen: set[tuple[int, int]] = set()
    for top, dirs, files in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(top) / name


def _glob_files(pattern: str) -> list[Path]:
    """The files a glob names, `**` through `walk` (glob.glob follows symlink loops forever)."""
    magic = re.compile(r"[*?[]")
    parts = Path(pattern).parts
    fixed = next((i for i, p in enumerate(parts) if magic.search(p)), len(parts))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    if "**" not in parts[fixed:]:
        return [Path(p) for p in glob.glob(pattern)]
    rest = [re.compile(fnmatch.translate(p)) if p != "**" else None for p in parts[fixed:]]

    def matches(rel: tuple[str, ...], pats: list) -> bool:
        if not pats:
            return not rel
        if pats[0] is None:  # "**": zero or more directories
            return any(matches(rel[k:], pats[1:]) for k in range(len(rel) + 1))
        return bool(rel) and bool(pats[0].match(rel[0])) and matches(rel[1:], pats[1:])

    return [p for p in walk(root) if matches(p.relative_to(root).parts, rest)]


def source_files(src: SourceConfig) -> list[Path]:
    path = Path(src.path).expanduser()
    if path.is_dir():  # hidden files and directories (.git, .DS_Store) are not documents
        files = list(walk(path))
    elif path.is_file():
        files = [path]
    else:
        files = [p for p in _glob_files(str(path)) if p.is_file()]
    unique: dict[tuple[int, int], Path] = {}
    for f in sorted(files):  # a file reached twice (two links to it) is one document, under its first name
        try:
            st = f.stat()
        except OSError:
            continue
        unique.setdefault((st.st_dev, st.st_ino), f)
    files = sorted(unique.values())
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
