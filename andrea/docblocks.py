"""The docs' generated blocks besides the configuration reference: each written from the registry or source it
describes, so a new notice kind, ledger marker or module cannot leave its table behind.

    notice-kinds      docs/operating.md     andrea/notices.py `table()`
    incident-markers  docs/formats.md       andrea/rundir/markers.py `incidents_table()`
    modules           docs/architecture.md  every module's docstring's first sentence, package by package
                                            (`modules()`: a module without a docstring is refused)

A block lies between `<!-- generated: NAME ... -->` and `<!-- end of NAME -->` lines; nothing else in the file
is touched.

    python -m andrea.docblocks            print every block
    python -m andrea.docblocks --write    replace each block between its markers
    python -m andrea.docblocks --check    exit 1 if any block differs (tests/unit/test_docblocks.py does this)

Reads the registries, the package's source files (their docstrings, with `ast`) and the docs; `--write` rewrites
the docs between the markers only.
(docs/configuration.md has its own generator, andrea/config/doc.py.)
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from andrea import notices
from andrea.rundir import markers

PACKAGE = Path(__file__).resolve().parent
DOCS = PACKAGE.parent / "docs"


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring (its job, STYLE's "one job"); ValueError when it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path.parent.name}/{path.name}: no docstring (its first sentence says its job)")
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return m.group(1) if m else para


def modules(root: Path = PACKAGE) -> str:
    """docs/architecture.md's module list: per package (its `__init__.py`'s sentence), each module's sentence."""
    out = []
    for package in sorted({p.parent for p in root.rglob("*.py")}):
        init = package / "__init__.py"
        name = package.relative_to(root.parent).as_posix() + "/"
        out.append(f"**`{name}`**: {first_sentence(init)}" if init.exists() else f"**`{name}`**")
        for path in sorted(package.glob("*.py")):
            if path.name != "__init__.py":
                out.append(f"- `{path.name}`: {first_sentence(path)}")
        out.append("")
    return "\n".join(out).rstrip()


@dataclass(frozen=True)
class Block:
    name: str
    doc: Path
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return f"<!-- generated: {self.name} by `python -m andrea.docblocks --write`; do not edit -->"

    @property
    def end(self) -> str:
        return f"<!-- end of {self.name} -->"


BLOCKS = [Block("notice-kinds", DOCS / "operating.md", notices.table),
          Block("incident-markers", DOCS / "formats.md", markers.incidents_table),
          Block("modules", DOCS / "architecture.md", modules)]


def splice(text: str, block: Block) -> str:
    """`text` with what lies between `block`'s markers replaced by its rendering."""
    if text.count(block.begin) != 1 or text.count(block.end) != 1:
        raise ValueError(f"{block.doc.name}: the markers of {block.name} must appear once each")
    head, rest = text.split(block.begin)
    _, tail = rest.split(block.end)
    return f"{head}{block.begin}\n{block.render()}\n{block.end}{tail}"


def stale(blocks: list[Block] = BLOCKS) -> list[str]:
    """The names of the blocks whose doc differs from their rendering."""
    return [b.name for b in blocks if splice(b.doc.read_text(), b) != b.doc.read_text()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m andrea.docblocks", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite each block in its doc")
    g.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = p.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"{name} is stale: run `python -m andrea.docblocks --write`", file=sys.stderr)
        return 1 if names else 0
    for b in BLOCKS:
        if args.write:
            b.doc.write_text(splice(b.doc.read_text(), b))
        else:
            print(f"{b.begin}\n{b.render()}\n{b.end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
