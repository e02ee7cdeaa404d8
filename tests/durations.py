"""The test files' durations record (tests/durations.json) and the collection order derived from it.

`make durations` runs the suite as `make test` does, with `--durations=0` into build/durations.txt, then
`python -m tests.durations build/durations.txt`: each test file's seconds (the setup, call and teardown of all its
tests, as one xdist worker spent them) replace its entry; a file absent from that output keeps its entry (so a
run over a few files, `make durations ARGS=tests/e2e/test_signals.py`, updates those), and a file that no longer
exists is dropped. Commit the record with the change that moved the times.

tests/conftest.py hands pytest-xdist the files longest first by this record, so that no worker is left alone on a
long file at the end (`--dist loadfile --no-loadscope-reorder` keeps collection order). A file the record does not
know yet is placed by its directory: the mean of the recorded files beside it (a new tests/e2e/ file ranks as an
average e2e file), else of the directory above, else last. Nothing here changes which tests run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("durations.json")
# pytest's --durations lines: "12.34s call     tests/e2e/test_x.py::test_y[param]"
LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+([^\s:]+\.py)::")


def parse(text: str) -> dict[str, float]:
    """Seconds per test file in a `--durations=0` report."""
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    return seconds


def load(path: Path = RECORD) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def updated(record: dict[str, float], measured: dict[str, float], exists=lambda f: (ROOT / f).is_file()) -> dict:
    """The record with the measured files' seconds replaced, files that are gone dropped, sorted by name."""
    merged = {**record, **{f: round(s, 1) for f, s in measured.items()}}
    return {f: merged[f] for f in sorted(merged) if exists(f)}


def estimate(file: str, record: dict[str, float]) -> float:
    """The file's recorded seconds; unknown: the mean of the recorded files in its directory, or the one above."""
    if file in record:
        return record[file]
    parts = file.split("/")[:-1]
    while parts:
        prefix = "/".join(parts) + "/"
        beside = [s for f, s in record.items() if f.startswith(prefix)]
        if beside:
            return mean(beside)
        parts.pop()
    return 0.0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m tests.durations PYTEST_DURATIONS_OUTPUT\n")
        return 2
    measured = parse(Path(argv[0]).read_text())
    if not measured:
        sys.stderr.write(f"{argv[0]}: no --durations lines (run pytest with --durations=0)\n")
        return 1
    record = updated(load(), measured)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{RECORD.relative_to(ROOT)}: {len(measured)} files measured, {len(record)} recorded, "
          f"{sum(record.values()) / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
