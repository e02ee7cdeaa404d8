"""A run's replica in object storage or on a second disk: the store, its layout, and what goes into it (who it
belongs to, its `replica.json`, is control/replica/owner.py's).

`checkpoint.replica` names it: an object-store URI (`s3://bucket/prefix`; `gs://`, `az://`, `memory://` come with
the library) or a plain path (`/mnt/backup/run`, `file:///...`). S3 endpoint, region and credentials come from the
standard environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`): nothing secret is written to run.toml or the log (the URI holds none).

The library is obstore (Rust's object_store behind a Python wheel, `andrea[replica]`), chosen over fsspec+s3fs by
measurement on this repository's machine against a local SeaweedFS: a 200 MB file uploads at 51-58 MB/s with
obstore against 33-48 MB/s with s3fs, obstore imports in 0.01 s against 0.78 s, and it is one 16 MB wheel with no
dependencies where s3fs brings aiobotocore, botocore, aiohttp and their eight companions (~40 MB). Its LocalStore
gives the plain-path replica the same semantics from the same code.

Layout under the replica's prefix (the run directory's own names, rundir/names.py):

    replica.json              who the replica belongs to: the run's owner record, written first and checked
                              before anything else is written (its format and checks: control/replica/owner.py)
    replica.probe-<pid>-<ns>  a start's test write (`Replica.probe`), deleted at once
    step_NNNNNN.bin           a checkpoint, byte for byte
    step_NNNNNN.<kind>.json   its companions (state, guard, ledger); `step_NNNNNN.sum.json` is uploaded LAST:
                              a checkpoint is in the replica exactly when its `.sum.json` is (its *publication*)
    .loss.json                the ledger, whole: replaced only by a longer copy, never by an older, shorter one
    .state.json, .samples.json, .wandb.json, archive/phase-K/*   the sidecars
    run.toml, tokenizer.json, data/*                the configuration, the tokenizer and the prepared data
                              (data/manifest.json last; a data file already there at its size is not sent again)

Complete or absent. Each object is published whole by the store: an S3 object appears only when its PUT or its
CompleteMultipartUpload succeeds (a process killed mid-upload leaves an incomplete multipart upload, which no
listing or GET shows); LocalStore writes a staging file and renames it. A checkpoint's `.bin` is hashed as it is
read for the upload and the upload is aborted when the bytes are not the ones its `.sum.json` recorded; once
stored, the store's own ETag vouches for what it received where it is an MD5 of the bytes (S3 without SSE-KMS: the
MD5 of a single PUT, or of the parts' MD5s for a multipart upload, computed here as the parts are sent), and
elsewhere (an encrypted object, GCS, Azure, a plain path) the object is read back and hashed again; only then are
its companions and its `.sum.json` published. Writes `RUN_DIR/.replica.json` (the replica's newest step and lag,
for `andrea status`): {"uri", "step", "local_step", "lag_steps", "lag_seconds", "error", "updated"}.
Test hook (andrea/testhooks.py): `ANDREA_TEST_REPLICA_DELAY=<seconds>` sleeps after each piece of a `.bin` read for its upload (a slow
store, and a window in which to kill the uploading process). Never set in production.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from andrea import testhooks
from andrea.errors import UserError
from andrea.rundir import checksum, regular
from andrea.rundir.atomic import streamed
from andrea.rundir.names import (ARCHIVE_DIR, QUARANTINE_DIR, CONFIG_NAME, DATA_DIR, LEDGER_NAME, MANIFEST_NAME, SAMPLES_NAME,
                                 REPLICA_STATUS_NAME, STATE_NAME, TOKENIZER_NAME, WANDB_STATE_NAME, checkpoint_name,
                                 tmp_path)

PROBE_PREFIX = "replica.probe-"  # a start's test write (Replica.probe); a leftover one is no object of a run
STATUS_NAME = REPLICA_STATUS_NAME
CHUNK = 8 << 20  # bytes per read of a file being uploaded, and per multipart part
SUM_RE = re.compile(r"^step_(\d{6,})\.sum\.json$")
STEP_RE = re.compile(r"^step_(\d{6,})\.(bin|[a-z]+\.json)$")
SIDECARS = (STATE_NAME, SAMPLES_NAME, WANDB_STATE_NAME)  # .wandb.json: a restored run goes on in its W&B run
EXTRA_MISSING = ("the replica needs the `replica` extra: pip install -e '.[replica]' from andrea's clone (obstore); or train without "
                 "one (--set checkpoint.replica=\"\")")


class ReplicaError(UserError, RuntimeError):
    """The store refused or could not be reached: one line naming the replica and the problem; `kind` is
    bucket | credentials | unreachable | unavailable | full | owner | corrupt | missing | readonly | other."""

    def __init__(self, message: str, kind: str = "other"):
        super().__init__(message)
        self.kind = kind


PASSING = ("unreachable", "unavailable")  # kinds a run with checkpoints trains through (the replica catches up)


def is_uri(target: str) -> bool:
    return "://" in target and not target.startswith("file://")


def classify(uri: str, e: BaseException) -> ReplicaError:
    """One line for a store error: what the operator must fix, then the store's own words (first line, cut)."""
    if isinstance(e, ReplicaError):
        return e
    text = str(e)
    first = " ".join(text.split())[:240]
    checks = [
        ("bucket", ("NoSuchBucket", "bucket does not exist"), "the bucket does not exist"),
        ("credentials", ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden",
                         "InvalidClientTokenId", "Unauthenticated", "PermissionDenied"),
         "the store refuses the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"),
        ("full", ("QuotaExceeded", "StorageFull", "InsufficientStorage", "EntityTooLarge", "No space left",
                  "507 ", "ENOSPC", "Errno 28"), "the store is full or over its quota"),
        ("unreachable", ("error sending request", "Connection refused", "connection refused", "timed out",
                         "dns error", "tcp connect", "operation timed out", "Timeout"),
         f"the endpoint cannot be reached ({os.environ.get('AWS_ENDPOINT_URL', 'the default endpoint')})"),
        # after "full" (507): a server error is the store's passing state (starting, overloaded, throttling), not
        # an answer about this replica
        ("unavailable", ("status code: 500", "status code: 502", "status code: 503", "status code: 504",
                         "Internal Server Error", "Service Unavailable", "Bad Gateway", "Gateway Timeout",
                         "<Code>SlowDown</Code>", "<Code>InternalError</Code>", "<Code>ServiceUnavailable</Code>"),
         "the store answers with a server error (starting, overloaded or throttling)"),
    ]
    for kind, needles, what in checks:
        if any(n in text for n in needles):
            return ReplicaError(f"replica {uri}: {what}: {first}", kind)
    return ReplicaError(f"replica {uri}: {first}", "other")


def open_store(uri: str, timeout_s: float = 60.0, create: bool = True):
    """The obstore store for `uri` (an object-store URI or a plain path, made when `create`); ReplicaError for a
    bad one ("missing": a plain path that does not exist and is not to be made)."""
    try:
        import obstore.store as stores
    except ImportError:
        raise ReplicaError(EXTRA_MISSING, "other") from None
    retry = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=min(timeout_s, 10)),
             "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                         "max_backoff": datetime.timedelta(seconds=2), "base": 2}}
    try:
        if not is_uri(uri):
            path = Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser().absolute()
            if not create and not path.is_dir():
                raise ReplicaError(f"replica {uri}: no such directory", "missing")
            path.mkdir(parents=True, exist_ok=True)
            return stores.LocalStore(str(path), mkdir=True)
        options = {"timeout": f"{int(timeout_s)}s", "connect_timeout": "5s"}
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://") or uri.startswith("memory://"):
            options["allow_http"] = True
        if uri.startswith("memory://"):
            return stores.MemoryStore()
        return stores.from_url(uri, client_options=options, retry_config=retry)
    except ReplicaError:
        raise
    except Exception as e:  # noqa: BLE001  (obstore raises its own classes)
        raise ReplicaError(f"replica {uri}: not a usable location: {' '.join(str(e).split())[:200]}") from None


class Replica:
    """The store behind one replica URI: object I/O, every failure a ReplicaError of one line."""

    def __init__(self, uri: str, timeout_s: float = 60.0, create: bool = True):
        self.uri = uri
        self.store = open_store(uri, timeout_s, create)
        import obstore
        self.obs = obstore

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (StopIteration, ReplicaError):
            raise
        except Exception as e:  # noqa: BLE001  (obstore raises FileNotFoundError too, with its debug dump)
            if isinstance(e, FileNotFoundError) or type(e).__name__ == "NotFoundError":
                raise FileNotFoundError(f"replica {self.uri}/{args[1] if len(args) > 1 else ''}: not found") \
                    from None
            if type(e).__name__ == "AlreadyExistsError":
                raise FileExistsError(f"{self.uri}/{args[1] if len(args) > 1 else ''}") from None
            raise classify(self.uri, e) from None

    # --- objects ----------------------------------------------------------------------------------------
    def listing(self, prefix: str | None = None) -> dict[str, int]:
        """Every object under the replica (or under `prefix` in it): key -> size."""
        def collect():
            out = {}
            for batch in self.obs.list(self.store, prefix=prefix):
                for meta in batch:
                    out[meta["path"]] = meta["size"]
            return out
        return self._call(collect)

    def size(self, key: str) -> int | None:
        try:
            return self._call(self.obs.head, self.store, key)["size"]
        except FileNotFoundError:
            return None

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self._call(lambda s, k: self.obs.get(s, k).bytes(), self.store, key))
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes | Iterator[bytes], *, create: bool = False) -> str | None:
        """Store `data` as `key`; the store's ETag."""
        result = self._call(self.obs.put, self.store, key, data, mode="create" if create else "overwrite",
                            chunk_size=CHUNK, max_concurrency=4)
        return (result or {}).get("e_tag")

    def delete(self, key: str) -> None:
        try:
            self._call(self.obs.delete, self.store, key)
        except FileNotFoundError:
            pass

    def chunks(self, key: str) -> Iterator[bytes]:
        """The object's bytes in pieces (a streamed GET)."""
        result = self._call(self.obs.get, self.store, key)
        stream = iter(result.stream(min_chunk_size=CHUNK))
        while True:
            try:
                piece = self._call(next, stream)
            except StopIteration:
                return
            yield bytes(piece)

    def probe(self) -> None:
        """A test write (put, then delete) under the replica: ReplicaError when the store refuses writes (a
        read-only key, a read-only path) while it answers reads."""
        key = f"{PROBE_PREFIX}{os.getpid()}-{time.time_ns()}"
        self.put(key, b"andrea: a test write at start, deleted at once\n")
        self.delete(key)

    # --- files -------------------------------------------------------------------------------------------
    def put_file(self, key: str, path: Path, check: Callable[[bytes], None] | None = None,
                 done: Callable[[], None] | None = None) -> tuple[int, str | None]:
        """Upload the file at `path` as `key`, streamed in CHUNK pieces (one multipart part each); `check(piece)`
        sees every piece read and `done()` runs after the last one, before the upload completes: raising there
        aborts it (nothing published). Returns (bytes sent, the store's ETag)."""
        sent = 0
        delay = testhooks.replica_delay()  # test hook ANDREA_TEST_REPLICA_DELAY (andrea/testhooks.py)

        def pieces() -> Iterator[bytes]:
            nonlocal sent
            with regular.open_file(path) as f:
                while piece := f.read(CHUNK):
                    if check is not None:
                        check(piece)
                    sent += len(piece)
                    if delay and check is not None:  # a checkpoint's .bin
                        time.sleep(delay)
                    yield piece
            if done is not None:
                done()
        etag = self.put(key, pieces())
        return sent, etag

    def download(self, key: str, dest: Path, check: Callable[[bytes], None] | None = None) -> int:
        """Write object `key` to `dest` atomically (temporary name, fsync, rename, directory fsync); `check(piece)`
        sees every piece and may raise (nothing at `dest` changes). Returns the bytes written."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with streamed(dest) as f:
            for piece in self.chunks(key):
                if check is not None:
                    check(piece)
                f.write(piece)
                n += len(piece)
        return n


# --- checkpoints -------------------------------------------------------------------------------------------
def published_steps(listing: dict[str, int]) -> list[int]:
    """The checkpoints the replica holds: those whose `.sum.json` is published, oldest first."""
    return sorted(int(m.group(1)) for key in listing if (m := SUM_RE.match(key)))


def unpublished_steps(listing: dict[str, int], published: list[int]) -> list[int]:
    """Steps with objects in the replica but no `.sum.json`: uploads that never finished."""
    found = {int(m.group(1)) for key in listing if (m := STEP_RE.match(key))}
    return sorted(found - set(published))


def companion_keys(step: int, listing: dict[str, int] | None = None, run_dir: Path | None = None) -> list[str]:
    """A checkpoint's companion names other than its `.sum.json`, from the replica's listing or a run dir."""
    stem = checkpoint_name(step)[:-len(".bin")]
    names = listing.keys() if listing is not None else [p.name for p in run_dir.glob(f"{stem}.*.json")]
    return sorted(k for k in names if k.startswith(stem + ".") and k.endswith(".json") and k != f"{stem}.sum.json")


def verifier(recorded: dict, what: str) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """(feed, finish): hash pieces of a checkpoint in file order; finish raises ReplicaError("corrupt") when the
    bytes are not the ones `recorded` (a `.sum.json`) holds."""
    hasher = checksum.RegionHasher(recorded["n_params"])

    def finish() -> None:
        problem = "wrong size" if hasher.offset != recorded["bytes"] else \
            checksum.mismatch(recorded, recorded["step"], recorded["n_params"], hasher.digests())
        if problem:
            raise ReplicaError(f"{what}: {problem}", "corrupt")
    return hasher.update, finish


def etag_matches(etag: str | None, parts: list[bytes]) -> bool:
    """Whether an S3 ETag is the MD5 of the bytes sent in `parts` (their MD5 digests, in order): a single PUT's
    MD5, or a multipart upload's MD5 of the parts' MD5s + "-N". False for any other kind of ETag (an encrypted
    object's, another store's, a local file's), which then calls for a read-back."""
    tag = (etag or "").strip('"')
    if tag.endswith(f"-{len(parts)}"):
        return tag == hashlib.md5(b"".join(parts)).hexdigest() + f"-{len(parts)}"
    return len(parts) == 1 and tag == parts[0].hex()


def upload_checkpoint(replica: Replica, run_dir: Path, step: int, before_publish: Callable[[], None]) -> int:
    """Upload `step_N.bin` (hashed on the way against its `.sum.json`; the stored bytes checked by the store's
    ETag where it is an MD5 of them, else read back and hashed again), then its companions, then
    `before_publish()` (the ledger), then its `.sum.json`: the publication. Returns the bytes sent."""
    name = checkpoint_name(step)
    local = run_dir / name
    recorded = checksum.read(local)
    if recorded is None:
        raise ReplicaError(f"{local}: no checksum (written before checksums existed): not replicated", "corrupt")
    feed, finish = verifier(recorded, f"{local}: changed while it was uploaded")
    parts: list[bytes] = []

    def hashed(piece: bytes) -> None:
        feed(piece)
        parts.append(hashlib.md5(piece).digest())  # one multipart part per piece (CHUNK)
    sent, etag = replica.put_file(name, local, hashed, finish)
    if not etag_matches(etag, parts):
        feed, finish = verifier(recorded, f"replica {replica.uri}/{name}: read back")
        for piece in replica.chunks(name):
            feed(piece)
        try:
            finish()
        except ReplicaError:
            replica.delete(name)
            raise
    for key in companion_keys(step, run_dir=run_dir):
        sent += replica.put_file(key, run_dir / key)[0]
    before_publish()
    sum_file = checksum.sum_path(local)
    sent += replica.put_file(sum_file.name, sum_file)[0]
    return sent


def remove_checkpoint(replica: Replica, step: int, listing: dict[str, int]) -> None:
    """Retention in the replica: unpublish (the `.sum.json` first), then the rest."""
    stem = checkpoint_name(step)[:-len(".bin")]
    replica.delete(f"{stem}.sum.json")
    for key in [checkpoint_name(step), *companion_keys(step, listing)]:
        replica.delete(key)


# --- the ledger and the other files ---------------------------------------------------------------------------
def upload_ledger(replica: Replica, run_dir: Path, remote_size: int | None) -> int | None:
    """The ledger up to its last complete line, when longer than the replica's copy (never a shorter one over
    a longer one); returns the replica's size after it."""
    path = run_dir / LEDGER_NAME
    if not path.exists():
        return remote_size
    data = regular.read_bytes(path)
    data = data[:data.rfind(b"\n") + 1]
    if remote_size is not None and len(data) <= remote_size:
        return remote_size
    replica.put(LEDGER_NAME, data)
    return len(data)


def run_files(run_dir: Path) -> list[str]:
    """The run's files besides checkpoints and the ledger, in upload order (data/manifest.json after the token
    files it describes): run.toml, tokenizer.json, the sidecars, archive/, quarantine/ (the evidence of a
    checkpoint that failed validation: it must outlive the machine), data/."""
    keys = [k for k in (CONFIG_NAME, TOKENIZER_NAME, *SIDECARS) if (run_dir / k).is_file()]
    for top in (ARCHIVE_DIR, QUARANTINE_DIR, DATA_DIR):
        files = sorted(p for p in (run_dir / top).rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
        rel = [str(p.relative_to(run_dir)) for p in files]
        keys += sorted(rel, key=lambda k: k == f"{DATA_DIR}/{MANIFEST_NAME}")
    return keys


def write_status(run_dir: Path, record: dict) -> None:
    """`.replica.json` (the replica's newest step and lag; format in the module docstring): atomic (temporary name,
    rename) but not fsynced, an advisory file rewritten every pass that must not compete with the run's fsyncs."""
    path = run_dir / STATUS_NAME
    tmp = tmp_path(path)
    tmp.write_bytes((json.dumps({**record, "updated": round(time.time(), 3)}, indent=1) + "\n").encode())
    os.replace(tmp, path)


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads(regular.read_bytes(run_dir / STATUS_NAME))
    except (OSError, ValueError):
        return None
