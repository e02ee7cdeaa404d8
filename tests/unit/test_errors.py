"""Every error a person fixes from its message derives from `UserError` (andrea/errors.py), so the command line's
one `andrea: error:` line cannot miss a new kind: found by importing every module of the package."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import andrea
from andrea import cli
from andrea.config.check import ConfigError
from andrea.errors import UserError

# Exception classes that never reach the command line, each with where it ends.
INTERNAL = {
    "andrea.control.commit.writer.CommitFailed": "a failed commit becomes CommitResult.error (control/commit/writer.py)",
    "andrea.control.commit.shards.ShardFailure": "a CommitFailed",
    "andrea.data.encode.Interrupted": "a stop during data preparation: exit 0 with what is done kept",
    "andrea.data.jsonscan.NotJSON": "a bad source line: counted and skipped by data/read.py",
    "andrea.control.guard.detector.GuardStateError": "a bad guard companion: said as a warning by control/guard/rollback.py",
    "andrea.control.observe.delivery.Expired": "a notice past its deadline: logged by control/observe/notify.py, the run goes on",
    "andrea.rundir.checkpoint_write._Refused": "O_DIRECT refused: the write goes buffered",
}


def exception_classes() -> dict[str, type[BaseException]]:
    found = {}
    for info in pkgutil.walk_packages(andrea.__path__, "andrea."):
        if info.name == "andrea.__main__":
            continue  # running it is the command line itself
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name:
                found[f"{info.name}.{value.__qualname__}"] = value
    return found


def test_every_error_of_the_package_is_a_user_error_or_named_internal():
    classes = exception_classes()
    assert "andrea.rundir.ledger.LedgerError" in classes and "andrea.control.run.boundary.RunFailed" in classes
    missed = sorted(name for name, cls in classes.items() if not issubclass(cls, UserError) and name not in INTERNAL)
    assert not missed, f"derive these from andrea.errors.UserError (or list them in INTERNAL, with why): {missed}"
    assert not sorted(set(INTERNAL) - set(classes)), "INTERNAL names a class that no longer exists"


@pytest.mark.parametrize("raised, code", [(ConfigError("run.toml: bad key"), 2), (UserError("x.bin: broken"), 1),
                                          (FileNotFoundError("y: gone"), 1)])
def test_the_command_line_says_one_line_and_the_class_exit_code(raised, code, capsys, monkeypatch):
    def fail(args):
        raise raised
    monkeypatch.setattr(cli, "cmd_info", fail)
    assert cli.main(["info"]) == code
    assert capsys.readouterr().err.splitlines()[-1] == f"andrea: error: {raised}"
