"""Test-wide set-up: the Triton interpreter must be chosen before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.runs import train


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A tiny run's first start (tokenizer + token files), made once per session and copied by tests."""
    run_dir = tmp_path_factory.mktemp("template")
    result = train(run_dir, "--steps", "0")
    assert result.returncode == 0, result.stderr
    return run_dir
