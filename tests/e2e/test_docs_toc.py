"""docs/operating.md's table of contents lists every section and subsection, in the document's order, with the
anchor GitHub gives it: a section added without its line (or renamed) fails here."""

from __future__ import annotations

import re

from tests.runs import ROOT


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_operating_guide_table_of_contents_is_every_heading_in_order():
    text = (ROOT / "docs" / "operating.md").read_text()
    body = re.sub(r"(?ms)^```.*?^```", "", text)  # a `# comment` inside a code block is no heading
    headings = [("  " * (len(m.group(1)) - 2)) + f"- [{m.group(2)}](#{slug(m.group(2))})"
                for m in re.finditer(r"^(###?) (.+)$", body, re.M)]
    toc = [line for line in body.splitlines() if re.match(r"^ *- \[.+\]\(#[^)]+\)$", line)]
    assert toc == headings
