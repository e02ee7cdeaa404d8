"""`andrea --help` is complete and README's command block says what it says: every flag and argument of every
subcommand is described, with its default; `--config` names every section of the schema; the choices README shows
(`--kernels auto|torch|triton`) are the parser's; a mistyped subcommand is one line with the closest command.
In process (cli.build_parser(), cli.main()): milliseconds."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from andrea import cli
from andrea.config.schema import RunConfig
from tests.runs import ROOT, andrea_here


def subparsers() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def described(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(subparsers()))
def test_every_flag_and_argument_is_described_and_its_default_shown(name):
    parser = subparsers()[name]
    text = parser.format_help()
    for action in described(parser):
        what = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and len(action.help) > 10, f"andrea {name} {what}: no description"
        if action.option_strings and action.default not in (None, False):
            assert "default" in action.help or f"(default: {action.default})" in " ".join(text.split()), \
                f"andrea {name} {what}: its default {action.default!r} is not shown"
    assert parser.description, f"andrea {name} --help says nothing of what it does"


def test_config_names_every_section_of_the_schema():
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    for name in ("train", "prepare", "info"):
        [config] = [a for a in subparsers()[name]._actions if "--config" in a.option_strings]
        missing = [s for s in sections if not re.search(rf"\b{s}\b", config.help)]
        assert not missing, f"andrea {name} --config does not name {missing}"


def test_a_mistyped_subcommand_is_one_line_naming_the_closest_command():
    result = andrea_here("stauts", "runs/x")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["andrea: error: no command 'stauts': did you mean 'status'?"], result.stderr
    nothing = andrea_here("xyzzy")
    [line] = nothing.stderr.splitlines()
    assert nothing.returncode == 2 and line.startswith("andrea: error: no command 'xyzzy' (commands: ") and \
        "train" in line


def test_a_bad_flag_is_one_line_not_the_usage():
    result = andrea_here("train", "--steps", "many", "--run-dir", "x")
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and line.startswith("andrea: error: argument --steps") and "--help" in line


def readme_synopsis() -> dict[str, str]:
    """README's ```text block of `python -m andrea SUB ...` lines, continuation lines joined, by subcommand."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```text\n(.*?)```", text, re.S) if "python -m andrea train" in b)
    lines: dict[str, str] = {}
    last = None
    for raw in block.splitlines():
        line = raw.split("  #")[0]
        if line.startswith("python -m andrea "):
            last = line.split()[3]
            lines[last] = line
        elif line.startswith(" ") and last:
            lines[last] += " " + line.strip()
    return lines


def test_the_readme_command_block_shows_the_choices_the_parser_has():
    shown = readme_synopsis()
    subs = subparsers()
    assert set(shown) == set(subs)
    for name, line in shown.items():
        for flag, alternatives in re.findall(r"(--[a-z-]+) ([a-z0-9]+(?:\|[a-z0-9]+)+)", line):
            [action] = [a for a in subs[name]._actions if flag in a.option_strings]
            assert sorted(alternatives.split("|")) == sorted(action.choices), f"README: andrea {name} {flag}"
        for action in subs[name]._actions:  # a flag with choices is shown with them
            if action.option_strings and action.choices:
                assert f"{action.option_strings[0]} {'|'.join(action.choices)}" in line, \
                    f"README: andrea {name} {action.option_strings[0]} does not show {'|'.join(action.choices)}"
