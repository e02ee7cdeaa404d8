"""A checkpoint's content checksum: `step_NNNNNN.sum.json`, written beside each `.bin` before its rename.

`step_NNNNNN.bin` stays exactly the contract's five regions (docs/formats.md#the-checkpoint-format); what it held
when it was committed is recorded here, so a bit that changes afterwards (a disk, a controller, RAM on the way,
a copy tool, another node's stale blocks) is seen by `verify`, by every start and by every reader of a checkpoint.

Format (JSON, one object; format 1):

    {"format": 1, "algorithm": "xxh3_128", "step": 200, "n_params": 169728, "bytes": 2036744,
     "regions": {"header": "<32 hex digits>", "weights": "...", "m": "...", "v": "..."},
     "ledger": "<32 hex digits>", "run": "<32 hex digits>"}

    format      1; a reader refuses a format it does not know (named, not guessed)
    algorithm   xxh3_128 (the xxhash library): ~4 GB/s on one core of a loaded 2-core machine, against
                0.7 GB/s for zlib's crc32 and 0.46 GB/s for sha256 (measured there on 154 MB), so hashing the
                image overlaps its O_DIRECT write instead of lengthening the commit. It guards against accident,
                not against an adversary.
    step, n_params, bytes   the header's values and the file size the digests belong to
    regions     one digest per region of the file, so a mismatch names the region that changed: header
                (bytes 0-8), weights, m and v (4·n bytes each, in file order)
    ledger      the `xxh3_128` of the checkpoint's `step_NNNNNN.ledger.json` (written before it, by the same
                commit): the hash of every byte of the run's ledger when it committed, so this checksum belongs
                to this run's history. Absent for a checkpoint committed without a ledger record (a tool's,
                a test's, one from before ledger records existed)
    run         the run's id, as its ledger record holds it (the `run` of the ledger's newest `start` marker when
                the checkpoint committed: rundir/ledger.py): the checkpoint belongs to that run. Every reader
                compares it with the id of the run directory it finds the checkpoint in (`check_companions`): a
                complete set of another run's files copied in (its `.bin`, checksum and ledger record agree with
                each other) is refused as another run's, never resumed from. Absent where the ledger record
                names no run (a run started before ids were recorded) or there is no ledger record

Written atomically (rundir/atomic.py) after the `.tmp` image is durable and before the rename that commits the
checkpoint: a committed `.bin` always has its checksum. Deleted with its checkpoint by retention, copied with it by
`andrea branch` (it is one of the checkpoint's companions, rundir/names.py). A checkpoint committed before
checksums existed has none: readers call it unverifiable, never broken. A checkpoint that should have one and
has not (`companion_problem`: it has a ledger record, which came after checksums, or an older checkpoint beside
it has a checksum) lost it: it is unverified, and every reader refuses it like a bad one; so is one whose
checksum names another ledger than its `step_NNNNNN.ledger.json` (another run's `.bin` and `.sum.json` copied in).
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from andrea.errors import UserError
from andrea.rundir import regular, sidecars
from andrea.rundir.atomic import write_atomic
from andrea.rundir.jsonfile import read_json
from andrea.rundir.ledger_seal import run_id
from andrea.rundir.names import LEDGER_NAME, companion_path, step_of

FORMAT = 1
ALGORITHM = "xxh3_128"
REGIONS = ("header", "weights", "m", "v")
HEADER_BYTES = 8
READ_CHUNK = 16 << 20  # bytes per read when hashing a file: bounded memory, and a reader retention cannot stall


class ChecksumError(UserError, ValueError):
    """A checksum file that cannot be read or does not fit its checkpoint; one line naming the file."""


def sum_path(checkpoint: Path) -> Path:
    """`step_NNNNNN.sum.json` beside `step_NNNNNN.bin`."""
    step = step_of(checkpoint)
    if step is None:
        raise ValueError(f"{checkpoint}: not a checkpoint name")
    return companion_path(checkpoint.parent, step, "sum")


def region_bounds(n_params: int) -> list[tuple[str, int, int]]:
    """(region, first byte, end byte) of each region of a checkpoint of `n_params` parameters."""
    bounds, lo = [], 0
    for name, size in zip(REGIONS, (HEADER_BYTES, 4 * n_params, 4 * n_params, 4 * n_params)):
        bounds.append((name, lo, lo + size))
        lo += size
    return bounds


class RegionHasher:
    """Digests of the regions of a checkpoint fed to it in file order, in pieces of any size."""

    def __init__(self, n_params: int):
        self.bounds = region_bounds(n_params)
        self.hashers = {name: xxhash.xxh3_128() for name in REGIONS}
        self.offset = 0

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        end = self.offset + len(view)
        for name, lo, hi in self.bounds:
            a, b = max(lo, self.offset), min(hi, end)
            if a < b:
                self.hashers[name].update(view[a - self.offset:b - self.offset])
        self.offset = end

    def digests(self) -> dict[str, str]:
        return {name: h.hexdigest() for name, h in self.hashers.items()}


def image_digests(image, n_params: int) -> dict[str, str]:
    """Digests of a checkpoint held in memory (a staged image: header at byte 0, then [w | m | v])."""
    hasher = RegionHasher(n_params)
    view = memoryview(image).cast("B")
    for name, lo, hi in hasher.bounds:  # region by region: the GIL changes hands between the calls
        hasher.update(view[lo:hi])
    return hasher.digests()


def file_digests(path: Path, n_params: int) -> dict[str, str]:
    """Digests of the checkpoint file at `path`, read in READ_CHUNK pieces."""
    hasher = RegionHasher(n_params)
    with regular.open_file(path) as f:
        while piece := f.read(READ_CHUNK):
            hasher.update(piece)
    return hasher.digests()


def record(step: int, n_params: int, digests: dict[str, str], ledger: str | None = None,
           run: str | None = None) -> dict:
    out = {"format": FORMAT, "algorithm": ALGORITHM, "step": step, "n_params": n_params,
           "bytes": HEADER_BYTES + 12 * n_params, "regions": digests}
    out = out if ledger is None else {**out, "ledger": ledger}
    return out if run is None else {**out, "run": run}


def write(checkpoint: Path, step: int, n_params: int, digests: dict[str, str]) -> Path:
    """Write the checksum of the checkpoint that is about to be renamed onto `checkpoint`, durably, bound to the
    ledger record its commit wrote before it (when there is one) and to the run that record names."""
    path = sum_path(checkpoint)
    ledger = _ledger_record(companion_path(checkpoint.parent, step, "ledger"))
    body = record(step, n_params, digests, *ledger)
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode())
    return path


def _ledger_record(path: Path) -> tuple[str | None, str | None]:
    """The `xxh3_128` and the `run` a ledger record holds; None for each it has not or when it cannot be read."""
    try:
        body = json.loads(regular.read_bytes(path))
        digest, run = body.get("xxh3_128"), body.get("run")
    except regular.NotRegularFile:  # not "no record": a FIFO there is refused, never read
        raise
    except (OSError, ValueError, AttributeError):
        return None, None
    return (digest if isinstance(digest, str) else None), (run if isinstance(run, str) else None)


def _ledger_digest(path: Path) -> str | None:
    return _ledger_record(path)[0]


def companion_problem(recorded: dict | None, has_ledger_record: bool, ledger_digest: str | None,
                      older_has_checksum: bool, run: str | None = None) -> str | None:
    """Why a checkpoint cannot be verified by its companions, in words; None when it can (or when it predates
    checksums, as every checkpoint beside it does). `recorded`: its `.sum.json` (None: absent);
    `has_ledger_record`, `ledger_digest`: whether its `.ledger.json` exists and the hash it holds;
    `older_has_checksum`: whether an older checkpoint in the same directory has a `.sum.json`; `run`: the id of
    the run whose directory holds it (None: unknown, a run from before ids)."""
    if recorded is None:
        if has_ledger_record:
            return "its checksum (step_NNNNNN.sum.json) is missing, though it has a ledger record, which only " \
                   "checkpoints with checksums have: unverified"
        if older_has_checksum:
            return "its checksum (step_NNNNNN.sum.json) is missing, though older checkpoints beside it have one: " \
                   "unverified"
        return None
    owner = recorded.get("run")
    if run is not None and owner is not None and owner != run:
        return (f"another run's checkpoint (its checksum names run {owner}, this run directory's ledger run {run}): "
                "never resumed here (a start sets it aside in quarantine/; to continue from it, `andrea train "
                "--init-from` it in a new run directory)")
    bound = recorded.get("ledger")
    if bound is None:
        return None
    if not has_ledger_record:
        return "its ledger record (step_NNNNNN.ledger.json) is missing, though its checksum names one: unverified"
    if ledger_digest != bound:
        return (f"its checksum belongs to another ledger (recorded {bound}, its ledger record holds "
                f"{ledger_digest}): another run's checkpoint, or a stale copy")
    return None


def check_companions(checkpoint: Path, recorded: dict | None) -> str | None:
    """`companion_problem` for the checkpoint file at `checkpoint`, its companions read from its directory."""
    step = step_of(checkpoint)
    ledger = companion_path(checkpoint.parent, step, "ledger")
    damaged = sidecars.seal_problem(ledger)  # its length or last step changed: the checksum binds only its hash
    if damaged is not None:
        return f"its ledger record is damaged ({damaged}): unverified"
    older = recorded is None and any(
        (s := step_of(p.name[:-len(".sum.json")] + ".bin")) is not None and s < step
        for p in checkpoint.parent.glob("step_*.sum.json"))
    problem = companion_problem(recorded, ledger.exists(), _ledger_digest(ledger), older,
                                run_id(checkpoint.parent / LEDGER_NAME) if recorded is not None else None)
    return None if problem is None else problem.replace("step_NNNNNN", checkpoint.name[:-len(".bin")])


def read(checkpoint: Path) -> dict | None:
    """The recorded checksum of `checkpoint`; None when it has none (committed before checksums existed)."""
    path = sum_path(checkpoint)
    body = read_json(path, ChecksumError, unreadable="unreadable checksum ({e})")
    if body is None:
        return None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("algorithm") != ALGORITHM \
            or not isinstance(body.get("regions"), dict) or set(body["regions"]) != set(REGIONS):
        raise ChecksumError(f"{path}: not a checksum of format {FORMAT} ({ALGORITHM})")
    return body


def run_vouched_by(checkpoint: Path) -> str | None:
    """The run id `checkpoint`'s checksum records (its `.sum.json`'s `run`): the id a run keeps when no `start`
    marker of its ledger can be read (a flipped bit broke its line: campaign seed 201). None for a checkpoint that
    names none (committed before ids) or whose checksum is missing or unreadable."""
    try:
        run = (read(checkpoint) or {}).get("run")
    except (ValueError, OSError):  # ChecksumError is one, and so is a name that is no checkpoint's
        return None
    return run if isinstance(run, str) else None


def mismatch(recorded: dict, step: int, n_params: int, digests: dict[str, str]) -> str | None:
    """Why the checkpoint's bytes are not the ones recorded, in words; None when they are."""
    if (recorded.get("step"), recorded.get("n_params")) != (step, n_params):
        return (f"its checksum was recorded for step {recorded.get('step')} with n_params "
                f"{recorded.get('n_params')}, the file holds step {step} with n_params {n_params}")
    changed = [name for name in REGIONS if recorded["regions"][name] != digests[name]]
    if changed:
        return (f"checksum mismatch in {', '.join(changed)}: the bytes changed after the commit "
                f"({ALGORITHM} {digests[changed[0]]}, recorded {recorded['regions'][changed[0]]})")
    return None
