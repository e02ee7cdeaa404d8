"""The policy pivot (docs/operating.md#pivots-and-branches): new caps and floors, same weights, m, v and loss history.

Reads a policy file (a TOML file with a `[policy]` table: caps, floors and optionally the bandit's knobs) and
the run's `run.toml`; writes `run.toml` with the new policy, moves `.state.json` and `.samples.json` into
`archive/phase-K/` (sidecars.archive_phase) and returns the `pivot` marker for `.loss.json`.
`.loss.json` itself is never touched here.

A policy file may also hold an `[anneal]` table (`steps = N`; `andrea pivot --anneal N` adds it): a polish pivot
that warms the lr down over N steps from the pivot's step (andrea/optim/schedule.py). The step is known only when
the pivot takes effect (a hot pivot's checkpoint), so the policy read holds the anneal as pending (anneal_at =
PENDING) until `at_step` gives it the pivot's step; run.toml and the `pivot` marker record train.anneal_at and
train.anneal_steps, and every later start (a resume in the middle of the anneal included) reads them there.

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
from andrea.optim.schedule import pivot_anneal
from andrea.rundir import atomic, names, sidecars
from andrea.rundir.ledger import marker


PENDING = -1  # train.anneal_at of a policy read with an [anneal] table, until `at_step` gives it the pivot's step


def read_policy(path: Path, cfg: RunConfig) -> RunConfig:
    """`cfg` with the policy of `path`, validated against the run's arms (one-line errors)."""
    return parse_policy(configload.read_toml(path), cfg, str(path))


def parse_policy(raw: dict, cfg: RunConfig, source: str) -> RunConfig:
    """`cfg` with the policy (and the pending anneal, if any) of a policy file's tables `raw`."""
    if "policy" not in raw or set(raw) - {"policy", "anneal"}:
        raise ConfigError(f"{source}: a policy file holds one [policy] table (and optionally an [anneal] table), "
                          f"found {sorted(raw)}")
    new = configload.from_dict({**cfg.to_dict(), "policy": raw["policy"]}, source)
    if "anneal" in raw:
        table = raw["anneal"]
        if not isinstance(table, dict) or set(table) != {"steps"} or type(table["steps"]) is not int:
            raise ConfigError(f"{source}: [anneal] holds one integer, steps = N (the warmdown's length), found "
                              f"{table!r}")
        try:
            pivot_anneal(table["steps"], cfg.train)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        new.train.anneal_at, new.train.anneal_steps = PENDING, table["steps"]  # set past validation: pending
    return new


def at_step(new_cfg: RunConfig, step: int) -> RunConfig:
    """The policy's configuration as of its pivot at `step`: a pending anneal starts there."""
    if new_cfg.train.anneal_at != PENDING:
        return new_cfg
    return dataclasses.replace(new_cfg, train=dataclasses.replace(new_cfg.train, anneal_at=step))


def apply_pivot(run_dir: Path, new_cfg: RunConfig, step: int, phase: int) -> dict:
    """Archive the phase's sidecars and switch run.toml to the new policy (`new_cfg` as of `at_step`); return the
    ledger marker (with `anneal` when this pivot starts one)."""
    archived = sidecars.archive_phase(run_dir)
    atomic.write_atomic(run_dir / names.CONFIG_NAME, new_cfg.to_toml().encode())
    policy = dataclasses.asdict(new_cfg.policy)
    tc = new_cfg.train
    anneal = {"anneal": {"at": step, "steps": tc.anneal_steps}} if tc.anneal_steps and tc.anneal_at == step else {}
    return marker("pivot", step, phase=phase, archived=str(archived.relative_to(run_dir)),
                  caps=policy["caps"], floors=policy["floors"], **anneal)
