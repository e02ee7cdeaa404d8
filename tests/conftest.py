"""Test-wide set-up: the Triton interpreter must be chosen before triton is first imported; the heaviest test
files are collected first, so that pytest-xdist starts them first.

`make test` runs pytest-xdist with `--dist loadfile --no-loadscope-reorder`: files are handed to the workers in
collection order (xdist's default reorder would sort them by their number of tests, which starts a one-test file
of minutes, such as tests/e2e/test_kernels_in_trainer.py, last, and leaves one worker alone on it at the end). With the
longest files first (`HEAVY`, by seconds measured on 2 cores), the last ones to start are short and the
workers finish together. The order changes no test: a plain `pytest` runs the same tests, in this order.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.runs import train

# Longest first: the larger of a file's wall and CPU seconds run alone (`pytest -n 0 FILE`, trainer processes and
# their waits included; CPU counts the files that keep both cores busy: two kill chains, two compile workers, two
# ranks). Measured 2026-12-02, 2 cores. A file not listed runs after these, in pytest's usual order; a listed name
# that no longer exists is skipped.
HEAVY = [
    "tests/faults/test_kill_anywhere.py",
    "tests/unit/kernels/test_compile.py",
    "tests/e2e/test_distributed.py",
    "tests/e2e/test_guard_run.py",
    "tests/e2e/test_muon_run.py",  # ~150 s: 8 trainer processes, 3 of them torchrun's 2 ranks
    "tests/e2e/test_microbatch.py",
    "tests/faults/test_bad_inputs.py",
    "tests/e2e/test_trunk.py",
    "tests/e2e/test_signals.py",
    "tests/e2e/test_run_life.py",
    "tests/faults/test_signals.py",
    "tests/e2e/test_evaltasks.py",
    "tests/e2e/test_kernels_in_trainer.py",  # ~40 s: two trainers, one of them in the Triton interpreter
    "tests/e2e/test_bench_smoke.py",
    "tests/e2e/test_run_integrity.py",
    "tests/e2e/test_gpu_check.py",
    "tests/e2e/test_watchdog_run.py",
    "tests/e2e/test_replica_run.py",
    "tests/e2e/test_chaos.py",  # ~25 s of CPU: three trainer starts, a restore, the fault-free run, the S3 server
    "tests/faults/test_full_disk.py",
    "tests/e2e/test_wandb.py",
    "tests/e2e/test_integrity.py",
    "tests/e2e/test_generation.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY)}
    # sorted() is stable: the tests of a file, and the files not listed, keep their order
    items[:] = sorted(items, key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY)))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A tiny run's first start (tokenizer + token files), made once per session and copied by tests."""
    run_dir = tmp_path_factory.mktemp("template")
    result = train(run_dir, "--steps", "0")
    assert result.returncode == 0, result.stderr
    return run_dir
