"""The import graph of `andrea`: no circle, and no arrow running back up the layers (docs/architecture.md).

Reads every module's source (imports at module level and inside functions alike, found with `ast`), so a
deferred import that only hides a circle counts as the circle it is. Imports nothing from andrea itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "andrea"

# Lower layers never import higher ones. A module's layer is its package's, or its own where it has one.
LAYERS = [
    {"andrea.errors", "andrea.control.mixture.policy", "andrea.config.check",
     "andrea.control.observe.mfu", "andrea.control.run.allocator",
     "andrea.notices"},                                                     # pure: errors; caps, floors; types; MFU;
                                                                            # the C allocator's settings
    {"andrea.config", "andrea.config.schema", "andrea.config.corpus", "andrea.config.keepers",
     "andrea.config.outputs", "andrea.testhooks", "andrea.optim.registry",
     "andrea.optim.schedule"},                                              # the schema; the test hooks; the
                                                                            # optimizers' table, the schedules
    {"andrea.rundir", "andrea.control.replica.remote"},                     # the run directory's files, its replica
    {"andrea.config.load", "andrea.control.observe.progress"},              # TOML layered; progress lines
    {"andrea.data", "andrea.kernels", "andrea.control.run.devices", "andrea.model.memory"},
    {"andrea.model", "andrea.optim", "andrea.control.parallel.distributed", "andrea.control.parallel.zero",
     "andrea.control.run.trainer", "andrea.evals", "andrea.control.observe.plots", "andrea.config.doc",
     "andrea.docblocks",
     "andrea.kernels.compile_check"},                                       # compiles the presets' launches
    {"andrea.control", "andrea.control.run", "andrea.control.commit", "andrea.control.replica",
     "andrea.control.parallel", "andrea.control.mixture", "andrea.control.guard",
     "andrea.control.observe"},                                             # the control plane
    {"andrea.commands"},
    {"andrea.cli", "andrea.__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from andrea.rundir import sidecars`
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    # a module's own packages (their __init__, which Python runs first anyway) are no dependency of it
    return {name: {m for m in imports_of(path, name) if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def layer_of(module: str) -> int:
    """The layer of the longest entry that names `module` or a package above it."""
    matches = [(len(top), i) for i, layer in enumerate(LAYERS) for top in layer
               if module == top or module.startswith(top + ".")]
    if not matches:
        raise AssertionError(f"{module} has no layer in tests/unit/test_imports.py: place it")
    return max(matches)[1]


def test_every_module_has_a_layer():
    for module in graph():
        if module != "andrea" and not module.startswith("andrea.presets"):
            layer_of(module)


def test_no_module_imports_a_higher_layer():
    up = [(m, d) for m, deps in graph().items() if m != "andrea" and not m.startswith("andrea.presets")
          for d in deps if d != "andrea" and layer_of(d) > layer_of(m)]
    assert not up, "imports that run back up: " + ", ".join(f"{m} -> {d}" for m, d in sorted(up))


def test_the_import_graph_has_no_circle():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_graph_sees_deferred_imports():
    # The check is only as good as its reading: an import inside a function must count.
    g = graph()
    assert "andrea.commands.train" in g["andrea.cli"]  # cli imports each command's module inside its dispatch
    assert "andrea.control.run.runtime" in g["andrea.commands.train"]  # and train the runtime inside cmd_train


def doc_layers() -> list[set[str]]:
    """docs/architecture.md's layers table, each `path` cell as a module name (`rundir/` -> andrea.rundir)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    to_module = lambda path: "andrea." + path.removesuffix("/").removesuffix(".py").replace("/", ".")  # noqa: E731
    return [{to_module(p) for p in re.findall(r"`([^`]+)`", row[2])} for row in rows]


def test_the_architecture_docs_layers_table_is_layers():
    assert doc_layers() == LAYERS, "docs/architecture.md's layers table and LAYERS disagree: change both"


def test_no_two_modules_share_a_name():
    """A name finds one module (docs/architecture.md): `grep -r ledger.py` must not have to ask which."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}
