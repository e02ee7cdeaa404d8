"""The configuration a command runs under, and its run directory made: shared by `train`, `prepare` and `info`.

Reads an existing run's `run.toml`, the preset, `--config` and every `--set` or flag on top (later wins:
config/load.py); creates the run directory (nothing else is written here).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

from andrea.config import load as configload
from andrea.config.schema import RunConfig
from andrea.rundir import names

DEFAULT_PRESET = "andrea-12m"
log = logging.getLogger("andrea")


def resolve_config(args: argparse.Namespace, run_dir: Path | None,
                   check: Callable[[RunConfig], None] | None = None) -> RunConfig:
    """An existing run's run.toml, then --preset, --config and every override on top (later wins). `check` refuses
    what the command cannot start from (its error is the one line said); a note that run.toml keeps its own keys
    over a --preset comes only after it passed."""
    overrides = list(getattr(args, "set", None) or [])
    for flag, key in (("steps", "train.steps"), ("checkpoint_every", "checkpoint.every"), ("seed", "train.seed"),
                      ("device", "train.device"), ("kernels", "train.kernels")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    saved = run_dir / names.CONFIG_NAME if run_dir is not None else None
    base = configload.read_toml(saved) if saved is not None and saved.exists() else None
    preset = args.preset or (None if args.config or base else DEFAULT_PRESET)
    if preset == DEFAULT_PRESET and not args.preset:
        say_default_preset()
    cfg = configload.load(preset=preset, config_file=args.config, base=base, overrides=overrides,
                          base_source=str(saved))
    if check is not None:
        check(cfg)
    if base and args.preset:
        overridden = configload.kept_by_run(configload.parse_toml(configload.preset_text(args.preset),
                                                                  f"preset {args.preset}"), base, overrides)
        if overridden:
            log.warning("--preset %s: %s keeps its own %s (the run's; --set changes a key deliberately)",
                        args.preset, saved, ", ".join(overridden[:4]) + (" ..." if len(overridden) > 4 else ""))
    return cfg


def say_default_preset() -> None:
    """A command run without --preset, --config or a run.toml uses DEFAULT_PRESET: said aloud, never silently."""
    log.info("no --preset: the default preset %s (--preset NAME picks another: %s)", DEFAULT_PRESET,
             ", ".join(configload.preset_names()))


def make_run_dir(run_dir: Path) -> None:
    """The run directory, created with its parents if absent; OSError (one line naming it) when it cannot be."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{run_dir}: cannot create the run directory: {e.strerror}") from None
