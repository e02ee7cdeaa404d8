"""Reading a run's configuration: presets, `run.toml`, user TOML files and `--set` overrides, layered.

Reads preset TOML files shipped in `andrea/presets/`, user TOML files and the run directory's `run.toml`
(the resolved configuration a run was started with; written by the trainer) into the dataclasses of
andrea/config/schema.py, which checks them. Every key is checked: an unknown or mistyped key, a wrong type or an
out-of-range value raises `ConfigError` with one line that names the file and the key.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from andrea.config.schema import SECTIONS, RunConfig, section_types
from andrea.config.check import ConfigError, build, unknown_message
from andrea.config.upgrade import upgrade_run_toml
from andrea.rundir import regular
from andrea.rundir.inspect import refuse_special_files, require_run_dir
from andrea.rundir.names import CONFIG_NAME

log = logging.getLogger("andrea.config.load")


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("andrea.presets").iterdir() if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    path = resources.files("andrea.presets") / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"--preset {name}: unknown preset (known: {', '.join(preset_names())})")
    return path.read_text()


def parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        raw = regular.read_bytes(path)  # run.toml or --config: a FIFO there is refused, never waited on
    except OSError as e:  # NotRegularFile's strerror: "a FIFO (named pipe), not a regular file"
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise ConfigError(f"{path}: starts with a byte-order mark, which TOML does not allow: save it as UTF-8 "
                          "without one")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): TOML files are UTF-8; save it as UTF-8 "
                          "(an editor's UTF-16 is not)") from None
    return parse_toml(text, str(path))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` → (["section", "key"], value); the value is read as TOML, else kept as a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base` (tables merge, everything else replaces)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def overridden_keys(layer: dict[str, Any], base: dict[str, Any], prefix: str = "") -> list[str]:
    """`section.key` of every value in `layer` that `base` sets otherwise (what a preset named again on an
    existing run does not change)."""
    out = []
    for k, v in layer.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out += overridden_keys(v, base[k], f"{prefix}{k}.")
        elif k in base and base[k] != v:
            out.append(f"{prefix}{k}")
    return out


def kept_by_run(preset: dict[str, Any], base: dict[str, Any], named: list[str]) -> list[str]:
    """What to warn about when a preset is named again on an existing run: the keys whose value the preset sets
    otherwise and that run.toml keeps, less those the command line names itself (`named`: its --set items and
    flags as `section.key=value`). A supervisor restarting the same command (its --steps, --checkpoint-every
    again) is told nothing; a preset named over a run of another preset is."""
    given = {item.split("=", 1)[0].strip() for item in named}
    return [key for key in overridden_keys(preset, base) if key not in given]


def from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Build and validate a RunConfig; every unknown key or bad value is one `ConfigError` line."""
    check_keys(raw, source)
    try:
        return RunConfig(**{name: build(cls, raw.get(name, {}), name) for name, cls in section_types().items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def check_keys(raw: dict[str, Any], source: str) -> None:
    """Refuse unknown section or key names, naming `source` (checked per file, before layers are merged)."""
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: {unknown_message(section, list(SECTIONS))}")
        if isinstance(body, dict):
            names = [f.name for f in dataclasses.fields(section_types()[section])]
            for key in body:
                if key not in names:
                    known = [f"{section}.{n}" for n in names]
                    raise ConfigError(f"{source}: {unknown_message(f'{section}.{key}', known)}")


def load(preset: str | None = None, config_file: str | Path | None = None, base: dict[str, Any] | None = None,
         overrides: list[str] = (), base_source: str = "run.toml") -> RunConfig:
    """Resolve a configuration. Later layers win: preset < base (a run's run.toml) < config file < --set items.

    So an existing run keeps its own settings when a command line names its preset again, and anything
    given explicitly (a file, a flag, --set) still applies. Each layer's keys are checked on their own, so
    an unknown key is attributed to the file or flag that holds it.
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    if preset is not None:
        layers.append((f"preset {preset}", parse_toml(preset_text(preset), f"preset {preset}")))
    if base:
        # an older run.toml's recorded defaults that today's schema would refuse or that withhold new kinds
        base, notes = upgrade_run_toml(base)
        for note in notes:
            log.info("%s: %s", base_source, note)
        layers.append((base_source, base))
    if config_file is not None:
        layers.append((str(config_file), read_toml(config_file)))
    for item in overrides:
        keys, value = parse_override(item)
        node: dict[str, Any] = {}
        cursor = node
        for k in keys[:-1]:
            cursor = cursor.setdefault(k, {})
        cursor[keys[-1]] = value
        layers.append((f"--set {item}", node))
    raw: dict[str, Any] = {}
    for source, layer in layers:
        check_keys(layer, source)
        raw = merge(raw, layer)
    return from_dict(raw, " + ".join(source for source, _ in layers) or "defaults")


def run_config(run_dir: Path) -> RunConfig:
    """The configuration a run trains with: its `run.toml`, checked (one line naming the run if it has none)."""
    path = run_dir / CONFIG_NAME
    if not run_dir.is_dir():
        require_run_dir(run_dir)  # no such directory / not a directory
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no {CONFIG_NAME})")
    refuse_special_files(run_dir)  # a FIFO at a checkpoint's name or a companion's: one line, nothing opened
    return load(base=read_toml(path), base_source=str(path))
