"""andrea/testhooks.py: every ANDREA_TEST_* variable is read there and nowhere else, each documented in its table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from andrea import testhooks
from andrea.config.check import ConfigError

ROOT = Path(testhooks.__file__).parent


def test_no_other_module_reads_a_test_hook_from_the_environment():
    readers = [f"{path.relative_to(ROOT.parent)}:{n}" for path in ROOT.rglob("*.py") if path.name != "testhooks.py"
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"environ|getenv", line) and "ANDREA_TEST_" in line]
    assert not readers, f"read the hook through andrea/testhooks.py: {readers}"


def test_every_hook_read_is_in_the_table_and_every_module_that_reads_one_cites_it():
    source = Path(testhooks.__file__).read_text()
    table = {m.group(1) for m in re.finditer(r"^    (ANDREA_TEST_[A-Z_]+)=", testhooks.__doc__, re.M)}
    read = {testhooks.PREFIX + name for name in re.findall(r'PREFIX \+ "([A-Z_]+)"|_number\("([A-Z_]+)"', source)
            for name in name if name}
    assert read and read == table, (sorted(read), sorted(table))
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if path.name != "testhooks.py" and "testhooks." in text:
            assert "andrea/testhooks.py" in text, f"{path.name} reads a test hook without citing andrea/testhooks.py"


def test_unset_hooks_are_no_ops(monkeypatch):
    for name in ("COMMIT_DELAY", "STEP_DELAY", "POISON_STEPS", "OOM_ROWS", "HANG", "FILE_DELAY", "STOP_AT_COMMIT",
                 "REPLICA_BACKOFF", "REPLICA_DELAY"):
        monkeypatch.delenv(testhooks.PREFIX + name, raising=False)
    assert (testhooks.commit_delay(), testhooks.step_delay(), testhooks.oom_rows(), testhooks.file_delay(),
            testhooks.stop_at_commit(), testhooks.replica_delay()) == (0, 0, 0, 0, 0, 0)
    assert testhooks.poison_steps() == set() and testhooks.hang() == "" and testhooks.replica_backoff() == 1.0


def test_the_poison_hook_reads_steps_and_refuses_anything_else_in_one_line(monkeypatch):
    assert testhooks.parse_poison_steps("40") == {40} and testhooks.parse_poison_steps("5, 8") == {5, 8}
    monkeypatch.setenv("ANDREA_TEST_POISON_STEPS", "33,70")
    assert testhooks.poison_steps() == {33, 70}
    for bad in ("x", "0", "5,-1", "4.5"):
        with pytest.raises(ConfigError, match=r"^ANDREA_TEST_POISON_STEPS='.*': expected header steps >= 1"):
            testhooks.parse_poison_steps(bad)
