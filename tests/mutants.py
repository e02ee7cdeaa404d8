"""`make mutants`: plausible bugs planted one at a time in the durable paths and the step boundary's order;
each must fail a test.

Reads the working tree (the files `git ls-files --cached --others --exclude-standard` lists) and copies it into
a scratch directory; never writes the checkout. For each mutation in MUTANTS (plain data: the file, the exact
old text, the new text, the pytest arguments of the tests that should catch it) the driver replaces the old text
in the scratch copy, runs only those tests there (`-x`, `-m "not slow"`, under a timeout), restores the file and
prints one table: mutation, file, tests run, caught (the tests failed), seconds.

Every mutation must apply exactly once: an old text found zero or two times stops the driver before anything
runs (exit 2), so the list cannot rot silently when the code under it changes. Before the mutations, the
union of their tests runs once unmutated: a selection that already fails would "catch" everything (exit 2).
Exit 0 only when every mutation was caught; a timeout is not a catch (a test must fail, not hang).

Why: a SIGKILL campaign cannot see a missing fsync, and a suite can stay green over a real bug in a path it
does not observe (issue #28). This is the check that the tests observe what users depend on.

    python -m tests.mutants [--only SUBSTRING] [--list] [--keep] [--show] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments, run from the scratch copy's root


DURABILITY = "tests/e2e/test_durability.py"
REAL_RUN = ("tests/e2e/test_durability.py::"
            "test_a_real_run_publishes_each_checkpoint_after_its_ledger_lines_and_companions_and_reuses_the_spare")
POWER = "tests/faults/test_power_loss.py"
# The guard's deterministic tests (plain records, the real writer in a temporary directory): no trajectory.
GUARD = ("tests/unit/control/guard/test_decisions.py", "tests/unit/control/guard/test_guard_retention.py")
BOUNDARY_FILE, BOUNDARY = "andrea/control/run/boundary.py", "tests/unit/control/run/test_boundary.py"

MUTANTS = [
    # --- issue #28's five survivors --------------------------------------------------------------------------
    Mutant("#28.1 buffered commit: no fsync before the rename", "andrea/rundir/checkpoint_write.py",
           '            pwrite_all(fd, memoryview(data).cast("B"), offset)\n        os.fsync(fd)\n',
           '            pwrite_all(fd, memoryview(data).cast("B"), offset)\n',
           (DURABILITY, POWER, "-k", "not sigkill")),
    Mutant("#28.2 ledger sync: no fsync", "andrea/rundir/ledger.py",
           "        try:\n            os.fsync(self._fd)\n        except OSError:\n",
           "        try:\n            pass\n        except OSError:\n",
           (DURABILITY,)),
    Mutant("#28.3 ZeRO-1 write_blocks: no fsync before the vote", "andrea/control/commit/shards.py",
           "it\n        os.fsync(fd)\n    finally:\n", "it\n    finally:\n",
           (DURABILITY, "-k", "rank")),
    Mutant("#28.4 retention not told what the guard protects", "andrea/rundir/retention.py",
           "victims(steps, self.policy, self.spared() | set(also), self.scores())",
           "victims(steps, self.policy, set(also), self.scores())",
           (*GUARD, REAL_RUN)),
    Mutant("#28.4 the runtime never hands the guard's protection to the writer", "andrea/control/run/runtime.py",
           '        retention.spare("guard", guard.protected)', '        retention.spare("guard", tuple)',
           (REAL_RUN, "tests/e2e/test_guard_run.py", "-k", "real_run or divergence_after")),
    Mutant("#28.5 commit gate open while an incident is pending", "andrea/control/guard/decisions.py",
           "        return self.pending is None and sum(self.detector.flags) < max(1, self.cfg.persist - 1)\n",
           "        return sum(self.detector.flags) < max(1, self.cfg.persist - 1)\n",
           GUARD),
    Mutant("#28 AdamW bias correction at max(step, 1)", "andrea/control/run/trainer.py",
           "        hp = Hyper(step + 1, lr,", "        hp = Hyper(max(step, 1), lr,",
           ("tests/unit/control/run/test_trainer.py",)),
    # --- the one-process commit ------------------------------------------------------------------------------
    Mutant("O_DIRECT commit: no fsync before the rename", "andrea/rundir/checkpoint_write.py",
           "        os.ftruncate(fd, size)\n        os.fsync(fd)\n    finally:\n",
           "        os.ftruncate(fd, size)\n    finally:\n",
           (DURABILITY, POWER, "-k", "not sigkill")),
    Mutant("publish: no directory fsync after the rename", "andrea/rundir/atomic.py",
           "    fsync_dir(final.parent)\n    return final\n", "    return final\n",
           (DURABILITY, POWER, "-k", "not sigkill")),
    Mutant("buffered commit: fsync before the writes", "andrea/rundir/checkpoint_write.py",
           "        os.ftruncate(fd, size)\n        for offset, data in regions:\n"
           "            pwrite_all(fd, memoryview(data).cast(\"B\"), offset)\n        os.fsync(fd)\n",
           "        os.ftruncate(fd, size)\n        os.fsync(fd)\n        for offset, data in regions:\n"
           "            pwrite_all(fd, memoryview(data).cast(\"B\"), offset)\n",
           (DURABILITY, POWER, "-k", "not sigkill")),
    # --- sidecars and companions -----------------------------------------------------------------------------
    Mutant("sidecars: no fsync of each temporary file", "andrea/rundir/atomic.py",
           "                f.flush()\n                os.fsync(f.fileno())\n", "                f.flush()\n",
           (DURABILITY, "-k", "sidecars or real_run")),
    Mutant("sidecars: fsync before the Python buffer is flushed", "andrea/rundir/atomic.py",
           "                f.write(data)\n                f.flush()\n", "                f.write(data)\n",
           (DURABILITY, "-k", "sidecars")),
    Mutant("sidecars: no directory fsync after the renames", "andrea/rundir/atomic.py",
           "    for directory in {path.parent for path in files}:\n        fsync_dir(directory)\n",
           "    for directory in {path.parent for path in files}:\n        pass\n",
           (DURABILITY, "-k", "sidecars")),
    Mutant("writer: before_commit (ledger, companions) after the .bin", "andrea/control/commit/writer.py",
           "        if before_commit is not None:\n            before_commit()\n"
           "        return checkpoint_write.commit_image(self.run_dir, step, self.images[slot].numpy(), self.n,\n"
           "                                             direct=self.direct, before_rename=before_rename)\n",
           "        path = checkpoint_write.commit_image(self.run_dir, step, self.images[slot].numpy(), self.n,\n"
           "                                             direct=self.direct, before_rename=before_rename)\n"
           "        if before_commit is not None:\n            before_commit()\n"
           "        return path\n",
           (DURABILITY, "-k", "writer or real_run")),
    # --- the sharded commit ----------------------------------------------------------------------------------
    Mutant("ZeRO-1: each rank votes before it writes", "andrea/control/commit/shards.py",
           "    attempt(lambda: write(tails))\n    votes = world.to_leader(world.rank + 1 if error else 0)\n",
           "    votes = world.to_leader(world.rank + 1 if error else 0)\n    attempt(lambda: write(tails))\n",
           (DURABILITY, "-k", "rank")),
    # --- the spare and the rollback --------------------------------------------------------------------------
    Mutant("spare claimed, then dropped: every commit writes a fresh file", "andrea/rundir/checkpoint_write.py",
           "            spare.claim(tmp)\n            write_image(tmp, view, size, direct)\n",
           "            spare.claim(tmp) and tmp.unlink()\n            write_image(tmp, view, size, direct)\n",
           (DURABILITY, "-k", "spare")),
    Mutant("rollback: no directory fsync after deleting the abandoned checkpoints", "andrea/control/guard/rollback.py",
           "    if dropped:\n        atomic.fsync_dir(run_dir)\n", "    if dropped:\n        pass\n",
           (DURABILITY, "-k", "rollback")),
    Mutant("rollback: guard state rewritten without its fsync", "andrea/control/guard/rollback.py",
           "    atomic.write_atomic(companion_path(run_dir, step), companion_bytes(state))\n",
           "    companion_path(run_dir, step).write_bytes(companion_bytes(state))\n",
           (DURABILITY, "-k", "rollback")),
    # --- the step boundary's order (issue #24): fake trainer and writer, no processes --------------------------
    Mutant("boundary: a pivot before its checkpoint", BOUNDARY_FILE,
           "        action = boundary_action(self.step, stop_at, ck.every, self.req)\n        taken = True\n",
           "        action = boundary_action(self.step, stop_at, ck.every, self.req)\n        taken = True\n"
           "        if action.pivot:\n            await self.pivot()\n",
           (BOUNDARY,)),
    Mutant("boundary: audits at the step a process starts from", BOUNDARY_FILE,
           "        if self.step != self.start:  # 5. the audits\n            await self.audit()\n",
           "        await self.audit()\n", (BOUNDARY,)),
    Mutant("boundary: abandoned checkpoints deleted before the guard state", BOUNDARY_FILE,
           "        if sharing.from_leader(self.world, rollback.in_run_dir, g, self.run_dir):\n"
           "            self.feed.flush(force_sync=True)\n",
           "        rollback.drop_after(self.run_dir, plan.to_step)\n"
           "        if sharing.from_leader(self.world, rollback.in_run_dir, g, self.run_dir):\n"
           "            self.feed.flush(force_sync=True)\n",
           (BOUNDARY,)),
    Mutant("boundary: no commit gate", BOUNDARY_FILE, "        if not guard.may_commit():", "        if False:",
           (BOUNDARY,)),
    Mutant("boundary: a stop before the stopping step's checkpoint", BOUNDARY_FILE,
           "        taken = True\n", "        taken = True\n        if action.stop:\n            return action, taken\n",
           (BOUNDARY,)),
    Mutant("boundary: a failed write never stops the run", BOUNDARY_FILE,
           "            self.req.failed = self.writer.first_error  #", "            pass  #", (BOUNDARY,)),
    Mutant("boundary: the rollback does not reload the known-good state", BOUNDARY_FILE,
           "        await loop.run_in_executor(self.train, trainer.load, payload)\n", "", (BOUNDARY,)),
]


def tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_tree(dest: Path) -> None:
    for rel in tree_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def check_applies(mutants: list[Mutant], root: Path) -> list[str]:
    """One line per mutation whose old text is not found exactly once (the list has rotted)."""
    problems = []
    for m in mutants:
        path = root / m.file
        count = path.read_text().count(m.old) if path.exists() else -1
        if count != 1:
            problems.append(f"{m.file}: mutation {m.name!r}: old text found {count} times (expected once)"
                            if count >= 0 else f"{m.file}: mutation {m.name!r}: no such file")
    return problems


def run_tests(root: Path, args: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """('failed' | 'passed' | 'timeout' | 'no tests', seconds, output tail) of pytest `args` in `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *args]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return "timeout", time.monotonic() - t0, str(e.stdout or "")[-2000:]
    seconds = time.monotonic() - t0
    verdict = {0: "passed", 5: "no tests"}.get(r.returncode, "failed")
    return verdict, seconds, (r.stdout + r.stderr)[-2000:]


def union(mutants: list[Mutant]) -> list[tuple[str, ...]]:
    """The distinct test selections, each once (the baseline runs every one unmutated)."""
    seen: list[tuple[str, ...]] = []
    for m in mutants:
        if m.tests not in seen:
            seen.append(m.tests)
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run the mutations whose name contains this (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--show", action="store_true", help="print how each caught mutation failed (pytest's tail)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run (default 900)")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or any(part in m.name for part in args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.name:<70} {m.file:<28} {' '.join(m.tests)}")
        return 0
    problems = check_applies(MUTANTS, ROOT)
    if problems:
        for line in problems:
            print(f"andrea: error: {line}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="andrea-mutants-"))
    try:
        copy_tree(scratch)
        where = subprocess.run([sys.executable, "-c", "import andrea; print(andrea.__file__)"], cwd=scratch,
                               env={**os.environ, "PYTHONPATH": str(scratch)}, capture_output=True, text=True)
        if not where.stdout.strip().startswith(str(scratch)):
            print(f"andrea: error: {scratch}: the scratch copy imports andrea from {where.stdout.strip()!r}",
                  file=sys.stderr)
            return 2
        for tests in union(mutants):
            verdict, seconds, tail = run_tests(scratch, tests, args.timeout)
            print(f"baseline  {verdict:<8} {seconds:6.1f}s  {' '.join(tests)}", flush=True)
            if verdict != "passed":
                print(tail, file=sys.stderr)
                print(f"andrea: error: {' '.join(tests)}: fails without any mutation ({verdict}); fix that first",
                      file=sys.stderr)
                return 2
        rows = []
        for m in mutants:
            path = scratch / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                verdict, seconds, tail = run_tests(scratch, m.tests, args.timeout)
            finally:
                path.write_text(original)
            caught = {"failed": "yes", "passed": "NO", "timeout": "NO (timeout)", "no tests": "NO (no tests)"}[verdict]
            rows.append((m, caught, seconds))
            print(f"mutant    {caught:<8} {seconds:6.1f}s  {m.name}", flush=True)
            if verdict != "failed" or args.show:
                print(tail, file=sys.stderr if verdict != "failed" else sys.stdout)
        print_table(rows)
        return 0 if all(caught == "yes" for _, caught, _ in rows) else 1
    finally:
        if args.keep:
            print(f"scratch copy kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def short(arg: str) -> str:
    """A pytest argument as the table shows it: the file's name, a test's name cut at 28 characters."""
    path, _, node = arg.partition("::")
    name = Path(path).name if path.startswith("tests/") else path
    return name + (f"::{node[:28]}…" if len(node) > 28 else f"::{node}" if node else "")


def print_table(rows: list[tuple[Mutant, str, float]]) -> None:
    head = ("mutation", "file", "tests run", "caught", "seconds")
    lines = [(m.name, m.file, " ".join(map(short, m.tests)), caught, f"{s:.1f}") for m, caught, s in rows]
    widths = [max(len(str(r[i])) for r in [head, *lines]) for i in range(len(head))]
    print()
    for r in [head, tuple("-" * w for w in widths), *lines]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\n{sum(c == 'yes' for _, c, _ in rows)} of {len(rows)} mutations caught")


if __name__ == "__main__":
    sys.exit(main())
