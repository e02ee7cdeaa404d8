"""`andrea restore REPLICA --run-dir DIR`: a run brought back from its replica onto an empty disk.

Reads the replica (replica/store.py's layout): `replica.json` (it must be an andrea replica), the published
checkpoints newest first, each downloaded and hashed against its `.sum.json` until one verifies (an older one is
taken when the newest does not), its companions, the ledger (checked against what that checkpoint vouches for:
`step_N.ledger.json`), the sidecars, archive/, run.toml, tokenizer.json and data/. Writes them into DIR, each
atomically; the checkpoint's `.bin` is renamed into place last. Then `andrea train --run-dir DIR` resumes from
that checkpoint, to the same bytes as a run that never lost its disk.

DIR must be absent or empty: a non-empty directory is refused in one line, untouched. `restore.partial` marks a
restore in progress (written first, removed last): `train` refuses such a directory, and running `restore` again
completes it (files already there at their replica size are kept, a verified checkpoint is not fetched again).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from andrea.replica.replicator import run_record
from andrea.rundir import checksum
from andrea.replica import store as rep
from andrea.rundir.atomic import fsync_dir, write_atomic
from andrea.rundir.ledger import ledger_problem
from andrea.rundir.names import LEDGER_NAME, RESTORING_NAME, checkpoint_name, companion_path

log = logging.getLogger("andrea.restore")


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


def restore(uri: str, run_dir: Path, out=None) -> int:
    resumed = check_target(run_dir)
    replica = rep.Replica(uri, create=False)
    owner = replica.owner()
    listing = replica.listing()
    if owner is None:
        raise rep.ReplicaError(f"replica {uri}: no {rep.OWNER_KEY}: not an andrea replica (or an empty one)", "owner")
    steps = rep.published_steps(listing)
    if not steps:
        raise rep.ReplicaError(f"replica {uri}: holds no published checkpoint (none has its .sum.json)", "corrupt")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RESTORING_NAME, json.dumps({"replica": uri}).encode() + b"\n")
    if resumed:
        log.info("%s: completing an interrupted restore", run_dir)
    fetched = 0
    step, tmp_bin, skipped = None, None, []
    for candidate in reversed(steps):
        got = _fetch_checkpoint(replica, run_dir, candidate, listing)
        if isinstance(got, str):
            skipped.append(got)
            log.warning("%s; trying an older checkpoint", got)
            continue
        step, tmp_bin, n = candidate, got, got.stat().st_size
        fetched += n
        break
    if step is None:
        raise rep.ReplicaError(f"replica {uri}: no checkpoint verifies against its checksum ({skipped[0]})", "corrupt")
    stem = checkpoint_name(step)[:-len(".bin")]
    for stale in run_dir.glob("step_*"):  # an earlier, interrupted restore of another checkpoint: not this run's
        if not stale.name.startswith(stem + "."):
            stale.unlink()
    for key in rep.companion_keys(step, listing):
        fetched += _fetch(replica, run_dir, key, listing)
    fetched += _fetch(replica, run_dir, checksum.sum_path(run_dir / checkpoint_name(step)).name, listing)
    fetched += _fetch(replica, run_dir, LEDGER_NAME, listing, always=True)
    seal = companion_path(run_dir, step, "ledger")
    if seal.exists():
        problem = ledger_problem(run_dir / LEDGER_NAME, json.loads(seal.read_bytes()), checkpoint_name(step))
        if problem:
            raise rep.ReplicaError(f"replica {uri}: its ledger does not hold what {checkpoint_name(step)} vouches "
                                   f"for: {problem}", "corrupt")
    for key in _run_keys(listing):
        fetched += _fetch(replica, run_dir, key, listing)
    record = run_record(run_dir)
    if record is not None and any(record.get(k) != owner.get(k) for k in ("started", "identity", "branched")):
        raise rep.ReplicaError(f"replica {uri}: its ledger's start marker is not the run {rep.OWNER_KEY} names",
                               "owner")
    final = run_dir / checkpoint_name(step)
    if tmp_bin != final:
        tmp_bin.rename(final)
    fsync_dir(run_dir)
    (run_dir / RESTORING_NAME).unlink()
    fsync_dir(run_dir)
    print(f"restored step {step} from {uri} into {run_dir} ({fetched / 2**20:.1f} MiB fetched"
          + (f", {len(skipped)} newer checkpoint(s) failed their checksum" if skipped else "")
          + f"); `andrea train --run-dir {run_dir}` continues the run", file=out, flush=True)
    return 0


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
    try:
        recorded = json.loads(replica.get(checksum.sum_path(final).name) or b"null")
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("regions"), dict):
        return f"replica {replica.uri}/{name}: its .sum.json is unreadable"
    for path in (final, staged):  # an earlier run of this restore got it: keep it if it verifies
        if path.is_file():
            try:
                feed, finish = rep.verifier(recorded, str(path))
                with open(path, "rb") as f:
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
