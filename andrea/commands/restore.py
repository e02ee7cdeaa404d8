"""`andrea restore REPLICA --run-dir DIR`: a run brought back from its replica onto an empty disk.

Reads the replica (control/replica/remote.py's layout): `replica.json` (it must be an andrea replica), the ledger, the
published checkpoints newest first, each downloaded and hashed against its `.sum.json`, with its companions, its
ledger record (`step_N.ledger.json`) checked against the ledger and its checksum, until one restores whole: an
older one is taken, in one warning line, when the newest is corrupt, has a damaged or wrong ledger record, or was
removed by the run's retention while it was fetched (the replica is listed once more when that leaves none).
Then the checkpoints its guard state names (control/guard/decisions.py `named_checkpoints`: the known-good point a
rollback reads, the tentative ones that may become it), each the same way; one the replica does not hold is said
in one line (the guard's known-good point then becomes the restored checkpoint, control/guard/rollback.py). Then the
sidecars, archive/, run.toml, tokenizer.json and data/. Writes them into DIR, each atomically; the restored checkpoint's
`.bin` is renamed into place last. Then `andrea train --run-dir DIR` resumes from that checkpoint, to the same
bytes as a run that never lost its disk, with a guard that can roll back.

DIR must be absent or empty: a non-empty directory is refused in one line, untouched. `restore.partial` marks a
restore in progress (written first, removed last): `train` refuses such a directory, and running `restore` again
completes it (files already there at their replica size are kept, a verified checkpoint is not fetched again).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

from andrea.control.guard import decisions as guard_decisions
from andrea.control.replica.admit import run_record
from andrea.control.replica.plan import same_run
from andrea.rundir import checksum, regular
from andrea.control.replica import owner as replica_owner, remote as rep
from andrea.rundir.atomic import fsync_dir, write_atomic
from andrea.rundir.ledger_seal import ledger_problem
from andrea.rundir.names import LEDGER_NAME, RESTORING_NAME, checkpoint_name, companion_path

log = logging.getLogger("andrea.restore")
STEP_FILE_RE = re.compile(r"^step_(\d{6,})\.")


def check_target(run_dir: Path) -> bool:
    """True when DIR holds an interrupted restore to complete; ReplicaError when it holds anything else."""
    if not run_dir.exists():
        return False
    if not run_dir.is_dir():
        raise rep.ReplicaError(f"{run_dir}: not a directory: restore needs an empty or absent one", "other")
    entries = list(run_dir.iterdir())
    if not entries:
        return False
    if (run_dir / RESTORING_NAME).exists():
        return True
    raise rep.ReplicaError(f"{run_dir}: not empty ({len(entries)} entries): restore writes only into an empty or "
                           "absent directory; nothing was changed", "other")


def cmd_restore(args: argparse.Namespace) -> int:
    return restore(args.replica, Path(args.run_dir))


def restore(uri: str, run_dir: Path, out=None) -> int:
    resumed = check_target(run_dir)
    replica = rep.Replica(uri, create=False)
    owner = replica_owner.read(replica)
    listing = replica.listing()
    if owner is None:
        raise rep.ReplicaError(f"replica {uri}: no {replica_owner.OWNER_KEY}: not an andrea replica (or an empty one)",
                               "owner")
    if not rep.published_steps(listing):
        raise rep.ReplicaError(f"replica {uri}: holds no published checkpoint (none has its .sum.json)", "corrupt")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RESTORING_NAME, json.dumps({"replica": uri}).encode() + b"\n")
    if resumed:
        log.info("%s: completing an interrupted restore", run_dir)
    fetched = [_fetch(replica, run_dir, LEDGER_NAME, listing, always=True)]  # as long as any seal listed vouches for
    step, skipped, listing = _newest_restorable(replica, run_dir, listing, fetched)
    if step is None:
        raise rep.ReplicaError(f"replica {uri}: no checkpoint restores ({skipped[0]})", "corrupt")
    kept, lacking, guard = [], {}, _json(companion_path(run_dir, step, "guard"))
    for named in guard_decisions.named_checkpoints(guard):
        if named != step:
            try:
                problem = _take(replica, run_dir, named, listing, fetched) \
                    if named in rep.published_steps(listing) else "not in the replica"
            except FileNotFoundError as e:
                problem = f"{e} (removed by the run's retention while it was restored)"
            if problem is None:
                kept.append(named)
            else:
                lacking[named] = problem
    kept.append(step)
    good = guard.get("good") if isinstance(guard, dict) else None
    good = good.get("step") if isinstance(good, dict) else None
    if good in lacking:  # the next start then takes the restored checkpoint as the guard's known-good point
        log.warning("%s's guard state names %s as its known-good point, which does not restore (%s): the guard's "
                    "known-good point becomes %s (its data offset and lr scale are kept)", checkpoint_name(step),
                    checkpoint_name(good), lacking[good], checkpoint_name(step))
    elif lacking:  # tentative ones: the next start drops them from the guard
        log.info("%s's guard state names checkpoints about to be confirmed that do not restore (%s): the guard goes "
                 "on without them", checkpoint_name(step), ", ".join(checkpoint_name(s) for s in lacking))
    for stale in run_dir.glob("step_*"):  # a failed candidate's, or an interrupted restore's of another checkpoint
        if _step_of_any(stale.name) not in kept:
            stale.unlink()
    for key in _run_keys(listing):
        fetched.append(_fetch(replica, run_dir, key, listing))
    record = run_record(run_dir)
    if record is not None and not same_run(owner, record):
        raise rep.ReplicaError(f"replica {uri}: its ledger's start marker is not the run "
                               f"{replica_owner.OWNER_KEY} names", "owner")
    for s in kept:  # the restored checkpoint last: once it is in place, its guard's are too
        staged = run_dir / (checkpoint_name(s) + ".restore")
        if staged.exists():
            staged.rename(run_dir / checkpoint_name(s))
    fsync_dir(run_dir)
    (run_dir / RESTORING_NAME).unlink()
    fsync_dir(run_dir)
    older = f", with the guard's {', '.join(checkpoint_name(s) for s in kept[:-1])}" if kept[:-1] else ""
    print(f"restored step {step} from {uri} into {run_dir}{older} ({sum(fetched) / 2**20:.1f} MiB fetched"
          + (f", {len(skipped)} newer checkpoint(s) did not restore" if skipped else "")
          + f"); `andrea train --run-dir {run_dir}` continues the run", file=out, flush=True)
    return 0


def _newest_restorable(replica: rep.Replica, run_dir: Path, listing: dict[str, int],
                       fetched: list[int]) -> tuple[int | None, list[str], dict[str, int]]:
    """The newest published checkpoint that restores whole (`_take`), its older ones tried in turn, each failure
    said in one line; the replica listed once more when retention removed what the listing named (a restore
    racing the run on a slow link). Returns (step or None, the failures, the listing used)."""
    skipped, failed = [], set()
    for _ in range(2):
        gone = False
        for candidate in reversed(rep.published_steps(listing)):
            if candidate in failed:
                continue
            try:
                problem = _take(replica, run_dir, candidate, listing, fetched)
            except FileNotFoundError as e:
                problem, gone = f"{e} (removed by the run's retention while it was restored)", True
            if problem is None:
                return candidate, skipped, listing
            failed.add(candidate)
            skipped.append(problem)
            log.warning("%s; trying an older checkpoint", problem)
        if not gone:
            break
        listing = replica.listing()
        fetched.append(_fetch(replica, run_dir, LEDGER_NAME, listing, always=True))  # what newer ones vouch for
    return None, skipped, listing


def _take(replica: rep.Replica, run_dir: Path, step: int, listing: dict[str, int], fetched: list[int]) -> str | None:
    """Checkpoint `step` brought into DIR (its `.bin` verified, staged under its `.restore` name), with its
    companions and its `.sum.json`, its ledger record checked against the restored ledger and its checksum; why
    not, in one line. FileNotFoundError: an object the listing named is gone."""
    got = _fetch_checkpoint(replica, run_dir, step, listing)
    if isinstance(got, str):
        return got
    fetched.append(got.stat().st_size)
    for key in rep.companion_keys(step, listing):
        fetched.append(_fetch(replica, run_dir, key, listing))
    fetched.append(_fetch(replica, run_dir, checksum.sum_path(run_dir / checkpoint_name(step)).name, listing))
    name, seal_path = checkpoint_name(step), companion_path(run_dir, step, "ledger")
    if seal_path.exists():
        seal = _json(seal_path)
        if not isinstance(seal, dict) or not isinstance(seal.get("bytes"), int) \
                or not isinstance(seal.get("xxh3_128"), str):
            return f"replica {replica.uri}/{seal_path.name}: unreadable (not a ledger record)"
        problem = ledger_problem(run_dir / LEDGER_NAME, seal, name)
        if problem:
            return f"replica {replica.uri}: its ledger does not hold what {name} vouches for: {problem}"
    try:
        problem = checksum.check_companions(run_dir / name, checksum.read(run_dir / name))
    except checksum.ChecksumError as e:
        problem = str(e)
    return f"replica {replica.uri}/{name}: {problem}" if problem else None


def _json(path: Path):
    """A small JSON file's value; None when it is absent or not JSON (a damaged companion)."""
    try:
        return json.loads(regular.read_bytes(path))
    except (OSError, ValueError):
        return None


def _step_of_any(name: str) -> int | None:
    """The step of a checkpoint's file of any kind in DIR (`.bin`, `.bin.restore`, a companion)."""
    match = STEP_FILE_RE.match(name)
    return int(match.group(1)) if match else None


def _run_keys(listing: dict[str, int]) -> list[str]:
    """The run's other files in the replica: run.toml, tokenizer, sidecars, archive/, data/ (manifest last)."""
    top = [k for k in (rep.CONFIG_NAME, rep.TOKENIZER_NAME, *rep.SIDECARS) if k in listing]
    nested = sorted(k for k in listing if k.startswith((rep.ARCHIVE_DIR + "/", rep.DATA_DIR + "/")))
    return top + sorted(nested, key=lambda k: k == f"{rep.DATA_DIR}/{rep.MANIFEST_NAME}")


def _fetch(replica: rep.Replica, run_dir: Path, key: str, listing: dict[str, int], always: bool = False) -> int:
    """Download `key` unless DIR already has it at the replica's size (a completed restore's earlier run)."""
    dest = run_dir / key
    if not always and dest.is_file() and dest.stat().st_size == listing.get(key):
        return 0
    return replica.download(key, dest)


def _fetch_checkpoint(replica: rep.Replica, run_dir: Path, step: int, listing: dict[str, int]) -> Path | str:
    """`step_N.bin` downloaded to its `.restore` name and verified against its `.sum.json` on the way; the path,
    or why it does not verify (one line)."""
    name = checkpoint_name(step)
    final = run_dir / name
    staged = run_dir / (name + ".restore")
    raw = replica.get(checksum.sum_path(final).name)
    if raw is None:
        raise FileNotFoundError(f"replica {replica.uri}/{checksum.sum_path(final).name}: not found")
    try:
        recorded = json.loads(raw)
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("regions"), dict) \
            or not all(isinstance(recorded.get(k), int) for k in ("step", "n_params", "bytes")):
        return f"replica {replica.uri}/{name}: its .sum.json is unreadable"
    for path in (final, staged):  # an earlier run of this restore got it: keep it if it verifies
        if path.is_file():
            try:
                feed, finish = rep.verifier(recorded, str(path))
                with regular.open_file(path) as f:
                    while piece := f.read(rep.CHUNK):
                        feed(piece)
                finish()
                return path
            except rep.ReplicaError:
                path.unlink()
    if name not in listing:
        return f"replica {replica.uri}/{name}: missing"
    feed, finish = rep.verifier(recorded, f"replica {replica.uri}/{name}")
    try:
        replica.download(name, staged, feed)
        finish()
    except rep.ReplicaError as e:
        staged.unlink(missing_ok=True)
        if e.kind == "corrupt":
            return str(e)
        raise
    return staged
