"""Data preparation against the tokenizer's own floor, and peak memory at two corpus sizes.

    python bench/prepare.py                      # 300 MB and 1200 MB corpora (made once under bench/out/)
    python bench/prepare.py --sizes 50 --quick   # a smoke run (tests/e2e/test_bench_smoke.py)
    python bench/prepare.py --sizes 100 --records 100   # + one huge parquet row group and one huge JSON record

For each size: a corpus of text files (lines of the standard library's source and docstrings, shuffled by a seeded
RNG into ~2 MB files: deterministic, code-and-prose like the built-in arms), then, each in its own process:
  prepare  `python -m andrea prepare --preset andrea-12m` on it: tokenizer training on the sample included
  floor    the same files through HF tokenizers' `encode_batch_fast` with the same tokenizer, eight files a batch
           (streaming, all cores, nothing written): what the tokenizer alone costs
  train    `andrea train` for a few steps on the prepared run: the trainer's peak memory
  stop     a second `andrea prepare` sent SIGTERM 3 s into its encoding: seconds from the signal to its exit 0
Prints one table: wall time, prepare/floor ratio (target <= 1.5), peak RSS of each process (target <= 2 GiB at
every size; the trainer's must not grow with the corpus), the stop latency. With `--records MB`, a second table:
`andrea prepare`'s wall time and peak RSS on a parquet file of one row group of MB megabytes (rows of the same
corpus lines) and on a JSON-lines file holding one record of MB megabytes (target: peak RSS <= 0.6 GiB, the
bound docs/data.md states, whatever the record's size). Reads and writes only under bench/out/.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
FILE_BYTES = 2_000_000
GIB = 1 << 30


def lines_of_the_library() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from andrea.data.sources import builtin_documents
    lines = []
    for arm in ("stdlib-code", "stdlib-docstrings", "pydoc-topics"):
        for doc in builtin_documents(arm):
            lines += doc.splitlines()
    return lines


def make_corpus(mb: int) -> Path:
    root = OUT / f"corpus-{mb}mb"
    if (root / "DONE").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng, lines = random.Random(mb), lines_of_the_library()
    written, k = 0, 0
    while written < mb * 1_000_000:
        out, size = [], 0
        while size < FILE_BYTES:
            start = rng.randrange(len(lines) - 200)
            chunk = lines[start:start + rng.randint(5, 200)]  # runs of lines keep code and prose coherent
            out += chunk
            size += sum(len(line) + 1 for line in chunk)
        data = "\n".join(out).encode("utf-8", "replace")
        (root / f"part-{k:05d}.txt").write_bytes(data)
        written, k = written + len(data), k + 1
    (root / "DONE").write_text(str(written))
    return root


def measured(argv: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, stderr tail) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024 / GIB, err[-2000:]


def stop_latency(argv: list[str], run: Path) -> float:
    """Seconds from SIGTERM (sent 3 s after the arm's encoding began) to the preparation's exit 0."""
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (run / "data" / "corpus.plan.json").exists():  # the tokenizer is trained; encoding begins
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the interrupted preparation never began encoding")
        time.sleep(0.05)
    time.sleep(3.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    if proc.wait(120) != 0:
        raise SystemExit("the interrupted preparation did not exit 0")
    return time.perf_counter() - t0


def floor(corpus: Path, tokenizer: Path) -> None:
    """The tokenizer alone: every file through encode_batch_fast, eight at a time."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer))
    files = sorted(p for p in corpus.iterdir() if p.suffix == ".txt")
    tokens = 0
    for i in range(0, len(files), 8):
        docs = [p.read_text() for p in files[i:i + 8]]
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(docs, add_special_tokens=False))
    print(tokens)


def make_records(mb: int) -> tuple[Path, Path]:
    """One parquet file of one row group, and one JSON-lines file of one record, each of `mb` MB of text."""
    import json
    root = OUT / f"records-{mb}mb"
    if (root / "DONE").exists():
        return root / "one-group.parquet", root / "one-record.jsonl"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    text = (make_corpus(mb) / "part-00000.txt").read_text()
    rows, size, rng = [], 0, random.Random(mb)
    while size < mb * 1_000_000:
        start = rng.randrange(len(text) - 20_000)
        rows.append(text[start:start + rng.randint(500, 20_000)])
        size += len(rows[-1].encode())
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": rows}), root / "one-group.parquet", row_group_size=len(rows))
    with open(root / "one-record.jsonl", "w") as f:
        f.write(json.dumps({"id": 0, "text": "".join(rows)}) + "\n")
    del rows
    (root / "DONE").write_text("")
    return root / "one-group.parquet", root / "one-record.jsonl"


def records_table(mb: int, preset: str) -> bool:
    py = sys.executable
    print("| one record or row group | prepare (s) | prepare RSS (GiB) |")
    print("|---|---|---|")
    ok = True
    # made in a process of their own: a child forked from a bench process holding them would count its pages
    subprocess.run([py, __file__, "--make-records", str(mb)], check=True, cwd=ROOT)
    for path, kind in zip(make_records(mb), ("parquet", "jsonl")):
        run = OUT / f"prepare-run-{kind}"
        shutil.rmtree(run, ignore_errors=True)
        source = ["--set", "data.arms=[]", "--set", f"data.sources=[{{name='big', path='{path}', kind='{kind}'}}]"]
        wall, rss, _ = measured([py, "-m", "andrea", "prepare", "--preset", preset, "--run-dir", str(run), *source])
        size = path.stat().st_size
        print(f"| {kind}: {size / 1e6:.0f} MB in one {'row group' if kind == 'parquet' else 'record'} | {wall:.1f} "
              f"| {rss:.2f} |")
        ok = ok and rss <= 0.6
        shutil.rmtree(run, ignore_errors=True)
    print("target (peak RSS <= 0.6 GiB whatever one record's size):", "met" if ok else "MISSED")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[300, 1200], help="corpus sizes in MB")
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--quick", action="store_true", help="skip the trainer run (a smoke test)")
    ap.add_argument("--records", type=int, metavar="MB", help="also prepare one MB-sized parquet row group and one "
                    "MB-sized JSON record, and report their peak RSS")
    ap.add_argument("--floor", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    ap.add_argument("--make-records", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_records:
        make_records(args.make_records)
        return None
    if args.floor:
        return floor(Path(args.floor[0]), Path(args.floor[1]))
    py = sys.executable
    rows = []
    for mb in args.sizes:
        corpus = make_corpus(mb)
        run = OUT / f"prepare-run-{mb}mb"
        shutil.rmtree(run, ignore_errors=True)
        source = ["--set", "data.arms=[]", "--set", f"data.sources=[{{name='corpus', path='{corpus}'}}]"]
        prep = measured([py, "-m", "andrea", "prepare", "--preset", args.preset, "--run-dir", str(run), *source])
        low = measured([py, __file__, "--floor", str(corpus), str(run / "tokenizer.json")])
        trained = (None if args.quick else
                   measured([py, "-m", "andrea", "train", "--run-dir", str(run), "--steps", "3", "--set",
                             "train.batch_size=8"]))
        stopped = None
        if not args.quick:
            shutil.rmtree(run, ignore_errors=True)
            stopped = stop_latency([py, "-m", "andrea", "prepare", "--preset", args.preset, "--run-dir", str(run),
                                    *source], run)
        size = int((corpus / "DONE").read_text())
        rows.append((size, prep, low, trained, stopped))
    print("| corpus | prepare (s) | floor (s) | ratio | prepare RSS (GiB) | floor RSS (GiB) | trainer RSS (GiB) "
          "| SIGTERM to exit (s) |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
    for size, prep, low, trained, stopped in rows:
        ratio = prep[0] / low[0]
        train_rss = f"{trained[1]:.2f}" if trained else "-"
        stop = f"{stopped:.2f}" if stopped is not None else "-"
        print(f"| {size / 1e6:.0f} MB | {prep[0]:.1f} | {low[0]:.1f} | {ratio:.2f}x | {prep[1]:.2f} | {low[1]:.2f} "
              f"| {train_rss} | {stop} |")
        verdicts += [ratio <= 1.5, prep[1] <= 2.0] + ([trained[1] <= 2.0] if trained else [])
    print("targets (ratio <= 1.5x, every peak RSS <= 2 GiB):", "met" if all(verdicts) else "MISSED")
    if args.records:
        print()
        records_table(args.records, args.preset)


if __name__ == "__main__":
    main()
