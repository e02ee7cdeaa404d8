"""The README's configuration reference is the generator's output for today's andrea/config.py (it cannot drift)."""

import dataclasses

from andrea import config, configdoc


def test_readme_config_reference_matches_the_dataclasses():
    readme = configdoc.README.read_text()
    assert configdoc.BEGIN in readme and configdoc.END in readme
    assert configdoc.splice(readme, configdoc.render()) == readme, (
        "README.md's configuration reference is stale: run `python -m andrea.configdoc --write`")


def test_every_key_of_every_section_has_a_row_with_type_default_and_meaning():
    tables, current = {}, None
    for line in configdoc.render().splitlines():
        if line.startswith("#### `"):
            current = tables.setdefault(line.strip("#` ").strip("[]"), [])
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            assert len(cells) == 4 and all(cells), line
            current.append(cells[0].strip("`"))
    expected = {s: [f.name for f in dataclasses.fields(c)] for s, c in config._section_types().items()}
    expected["data.sources"] = [f.name for f in dataclasses.fields(config.SourceConfig)]
    assert tables == expected
    assert "| `lr` | float | `0.0006` | Peak learning rate" in configdoc.render()


def test_a_field_without_a_docstring_is_refused():
    source = "class X:\n    a: int = 1\n    \"\"\"Documented.\"\"\"\n    b: int = 2\n"
    docs = configdoc.class_docs(source)
    assert [(f.name, f.doc) for f in docs["X"][1]] == [("a", "Documented."), ("b", "")]

    @dataclasses.dataclass
    class X:
        a: int = 1
        b: int = 2

    try:
        configdoc._table("[x]", "", X, docs)
    except ValueError as e:
        assert "X.b has no docstring" in str(e)
    else:
        raise AssertionError("an undocumented field must be refused")
