"""Reading a run's configuration: presets, `run.toml`, user TOML files and `--set` overrides, layered and checked.

Reads preset TOML files shipped in `andrea/presets/`, user TOML files and the run directory's `run.toml`
(the resolved configuration a run was started with; written by the trainer) into the dataclasses of
andrea/config.py. Every key is checked: an unknown or mistyped key, a wrong type or an out-of-range value raises
`ConfigError` with one line that names the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from andrea.config import SECTIONS, ConfigError, RunConfig, _section_types


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
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
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


def from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Build and validate a RunConfig; every unknown key or bad value is one `ConfigError` line."""
    check_keys(raw, source)
    try:
        return RunConfig(**{name: build(cls, raw.get(name, {}), name) for name, cls in _section_types().items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def check_keys(raw: dict[str, Any], source: str) -> None:
    """Refuse unknown section or key names, naming `source` (checked per file, before layers are merged)."""
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: {_unknown_message(section, list(SECTIONS))}")
        if isinstance(body, dict):
            names = [f.name for f in dataclasses.fields(_section_types()[section])]
            for key in body:
                if key not in names:
                    known = [f"{section}.{n}" for n in names]
                    raise ConfigError(f"{source}: {_unknown_message(f'{section}.{key}', known)}")


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


def _unknown_message(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}"


def build(cls: type, raw: Any, where: str) -> Any:
    """The dataclass `cls` from the table `raw` read at `where`: every key known, every value of its field's type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(_unknown_message(f"{where}.{key}", [f"{where}.{n}" for n in names]))
    kwargs = {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where}: {e}") from None


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where} must be {hint.__name__}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if dataclasses.is_dataclass(item):
            return [build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return {k: _check_type(v, item, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, types.UnionType):
        return value
    raise ConfigError(f"{where}: unsupported type {hint}")
