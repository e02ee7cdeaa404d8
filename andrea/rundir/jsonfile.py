"""Reading a small JSON file that may be absent, one way for every reader: the parsed value, None when there is no
file, else one line naming the file and the problem, raised as the reader's own error type.

Readers: the data manifest (data/manifest.py), a checkpoint's `.sum.json` (rundir/checksum.py), the sidecars
(rundir/sidecars.py). Reads the file, a regular file only (rundir/regular.py); writes nothing (writes:
rundir/atomic.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from andrea.rundir import regular


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def read_json(path: Path, error: Callable[[str], Exception], *, unreadable: str = "cannot read: {e}",
              invalid: str | None = None, constants: bool = True) -> Any | None:
    """The JSON value in `path`; None when it does not exist. `error(f"{path}: {unreadable}")` when it cannot be
    read or decoded as text, `error(f"{path}: {invalid}")` (default: `unreadable`) when it is not JSON, `{e}`
    being the cause. `constants=False` refuses NaN and Infinity, which JSON does not have."""
    try:
        text = regular.read_text(path)
    except FileNotFoundError:
        return None
    except regular.NotRegularFile:  # refused as it is (a UserError): not the reader's 'damaged', never moved
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: {unreadable.format(e=e)}") from None
    try:
        return json.loads(text, parse_constant=None if constants else _no_constant)
    except ValueError as e:
        raise error(f"{path}: {(invalid or unreadable).format(e=e)}") from None
