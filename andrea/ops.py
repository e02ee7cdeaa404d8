"""Operations on a run's life: status (more to come with the data-proxy work)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_status(args: argparse.Namespace) -> int:
    from andrea.control.ctl import status
    print(json.dumps(status(Path(args.run_dir)), indent=1))
    return 0


def add_commands(sub, add_config_flags) -> None:
    p = sub.add_parser("status", help="a run's step, newest checkpoint, loss EMA, arms' shares, phase")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_status)
