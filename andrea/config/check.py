"""The configuration's error and its type checks: a table read from TOML (or given as a dict) into a dataclass.

`build(cls, table, where)` checks every key against the dataclass's fields (an unknown one is named with the
closest known one) and every value against its field's type, then constructs it (its `__post_init__` checks
ranges); any problem is one `ConfigError` line naming the key. The schema itself is andrea/config/schema.py (and
andrea/config/keepers.py). Reads and writes nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from andrea.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration that cannot be used; the message is one line naming the source and the key."""

    exit_code = 2  # a bad configuration or command line


def unknown_message(key: str, known: list[str]) -> str:
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
            raise ConfigError(unknown_message(f"{where}.{key}", [f"{where}.{n}" for n in names]))
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
        if hint is float and not math.isfinite(value):  # TOML reads inf and nan; no key means anything by them
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
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
