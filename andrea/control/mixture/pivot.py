"""The policy pivot (docs/operating.md#pivots): new caps and floors, same weights, m, v and loss history.

Reads a policy file (a TOML file with a `[policy]` table: caps, floors and optionally the bandit's knobs) and
the run's `run.toml`; writes `run.toml` with the new policy, moves `.state.json` and `.samples.json` into
`archive/phase-K/` (sidecars.archive_phase) and returns the `pivot` marker for `.loss.json`.
`.loss.json` itself is never touched here.

The bandit restarts because the data proxy sees that the policy fingerprint of the checkpoint's saved state
differs from the configuration's (control/mixture/proxy.py): a new phase starting at the pivot step. A hot pivot
(SIGHUP) and an offline one (`python -m andrea pivot`) therefore continue identically, and a crash right
after either resumes into the same new phase.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from andrea.config import load as configload
from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.rundir import atomic, names, sidecars
from andrea.rundir.ledger import marker


def read_policy(path: Path, cfg: RunConfig) -> RunConfig:
    """`cfg` with the policy of `path`, validated against the run's arms (one-line errors)."""
    raw = configload.read_toml(path)
    if set(raw) != {"policy"}:
        raise ConfigError(f"{path}: a policy file holds exactly one [policy] table, found {sorted(raw)}")
    return configload.from_dict({**cfg.to_dict(), "policy": raw["policy"]}, str(path))


def apply_pivot(run_dir: Path, new_cfg: RunConfig, step: int, phase: int) -> dict:
    """Archive the phase's sidecars and switch run.toml to the new policy; return the ledger marker."""
    archived = sidecars.archive_phase(run_dir)
    atomic.write_atomic(run_dir / names.CONFIG_NAME, new_cfg.to_toml().encode())
    policy = dataclasses.asdict(new_cfg.policy)
    return marker("pivot", step, phase=phase, archived=str(archived.relative_to(run_dir)),
                  caps=policy["caps"], floors=policy["floors"])
