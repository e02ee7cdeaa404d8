"""Checks of the schema's sections (config/schema.py) that hold a promise made in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from andrea.config.check import ConfigError
from andrea.config.outputs import CheckpointConfig

OPERATING = Path(__file__).resolve().parents[3] / "docs" / "operating.md"


def documented_grace_periods() -> list[int]:
    """The grace periods of docs/operating.md's systemd, Kubernetes and SLURM templates, in seconds."""
    text = OPERATING.read_text()
    found = [int(g) for pattern in (r"TimeoutStopSec=(\d+)", r"terminationGracePeriodSeconds: (\d+)",
                                    r"--signal=(?:B:)?TERM@(\d+)") for g in re.findall(pattern, text)]
    assert len(found) >= 3, found
    return found


def test_a_sigterms_wait_for_the_replica_fits_well_inside_the_documented_grace_period():
    """SIGTERM with the store frozen waits replica_wait: by default at most half of every template's grace period
    (the other half is the step in flight and its checkpoint), and stop_grace_s is the templates' figure."""
    cfg = CheckpointConfig(replica="s3://bucket/run")
    graces = documented_grace_periods()
    assert set(graces) == {cfg.stop_grace_s}
    assert 2 * cfg.replica_wait <= min(graces)


def test_a_replica_wait_that_does_not_fit_the_grace_period_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(replica="s3://bucket/run", replica_wait=120)
    assert str(err.value).startswith("checkpoint.replica_wait=120 s does not fit the stop's grace period "
                                     "(checkpoint.stop_grace_s=120 s;") and "\n" not in str(err.value)
    assert CheckpointConfig(replica="s3://bucket/run", replica_wait=120, stop_grace_s=600).replica_wait == 120
    assert CheckpointConfig(replica="", replica_wait=120).replica_wait == 120  # no replica: nothing to wait for
