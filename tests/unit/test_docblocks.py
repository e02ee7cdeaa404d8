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
