"""The docs' generated blocks (andrea/docblocks.py): each equals its rendering from the registry it describes, and a
row added to a registry shows in its doc's block."""

from __future__ import annotations

import pytest

from andrea import docblocks, notices
from andrea.rundir import markers


def test_every_generated_block_matches_its_registry():
    assert docblocks.stale() == [], "a generated doc block is stale: run `python -m andrea.docblocks --write`"
    assert docblocks.main(["--check"]) == 0


def test_a_new_notice_kind_or_incident_marker_makes_its_block_stale(monkeypatch):
    monkeypatch.setitem(notices.NOTICE_KINDS, "plateau_test", notices.Kind("plateau_test", "no new best"))
    monkeypatch.setitem(markers.MARKERS, "odd_test", markers.Marker("odd_test", "something odd", "a", incident=True))
    assert set(docblocks.stale()) == {"notice-kinds", "incident-markers"}
    assert "| `plateau_test` | no new best |" in notices.table()
    assert "| `odd_test` | something odd | `a` | no |" in markers.incidents_table()


def test_a_block_without_its_markers_is_refused(tmp_path):
    block = docblocks.Block("x", tmp_path / "x.md", lambda: "body")
    with pytest.raises(ValueError, match="markers of x"):
        docblocks.splice("no markers here", block)
    text = f"head\n{block.begin}\nold\n{block.end}\ntail\n"
    assert docblocks.splice(text, block) == f"head\n{block.begin}\nbody\n{block.end}\ntail\n"


def test_the_module_list_is_each_modules_first_sentence_and_a_module_without_a_docstring_is_refused(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package. More here."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""A sub-package: what it holds\nacross two lines. Then more."""\n')
    (pkg / "sub" / "job.py").write_text('"""One job, said once (its reasons: elsewhere).\n\nDetails."""\nx = 1\n')
    assert docblocks.modules(pkg).splitlines() == [
        "**`pkg/`**: The package.", "",
        "**`pkg/sub/`**: A sub-package: what it holds across two lines.",
        "- `job.py`: One job, said once (its reasons: elsewhere)."]
    (pkg / "sub" / "silent.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="silent.py: no docstring"):
        docblocks.modules(pkg)


def test_every_module_of_the_package_is_in_architecture_md():
    text = (docblocks.DOCS / "architecture.md").read_text()
    for path in docblocks.PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            assert f"- `{path.name}`: {docblocks.first_sentence(path)}" in text, path
