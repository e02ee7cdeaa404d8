"""A recorder of the os calls a durable write makes, and the assertions crash consistency needs of them.

Why the os calls. A SIGKILL cannot see a missing fsync: the page cache outlives the process, so every kill
campaign passes without one. A power cut loses what was never fsynced, and a rename whose directory was never
fsynced. What protects a file against that is an order of calls, and that order is what these tests read:

    data      every byte of a file is written, then the file is fsynced (fdatasync counts), and nothing
              modifies it again before it is renamed onto its final name
    rename    rename (or replace) of the complete, fsynced temporary file onto the final name: the commit point
    directory the directory holding the final name is fsynced after the rename: the rename itself is durable
    order     what a file vouches for (the ledger lines before a checkpoint, each rank's blocks before its vote)
              is durable before the call that relies on it

Usage, in-process (the os module's functions are replaced for the `with` block, every thread included):

    with OsCalls() as calls:
        commit_checkpoint(run_dir, 20, payload)
    rename, dir_sync = calls.published(run_dir / "step_000020.bin")   # indices into calls.events
    calls.durable_before(run_dir / ".loss.json", rename, min_size=n)  # an fsync of >= n bytes before it
    calls.mark("vote", rank=1)                                         # your own event, in the same order

Out of process, a real `python -m andrea ...` with the recorder installed (events as JSON lines, written at exit):

    python -m tests.oscalls EVENTS.jsonl [--refuse-o-direct] -- train --run-dir D ...
    calls = OsCalls.load(EVENTS.jsonl)

What is recorded (`Call`): os.open, os.write, os.pwrite, os.ftruncate, os.fsync, os.fdatasync, os.rename,
os.replace, os.unlink, os.remove, and `mark`. A descriptor's path is read from /proc/self/fd when the call is made
(so an fsync names the file as it is called at that moment, and a descriptor from the builtin `open()` is named
too), with its inode, its size after the call, whether it is a directory ("dir"), and the calling thread's name.
A rename records the source's inode and size just before it. Writes through a Python file object (`f.write`)
reach the kernel outside os.write and are not events; `durable_before` still catches bytes added after the
fsync, because the file's size at the fsync must equal its size at the rename (or reach `min_size`, for a file
relied on in place). `--refuse-o-direct` answers EINVAL to every open with O_DIRECT (a filesystem that refuses
it: the buffered path). A NaN at a chosen step comes from the trainer's own test hook, ANDREA_TEST_POISON_STEPS
(control/run/runtime.py), set in the environment.

For the data pipeline (pieces and a manifest), "every piece durable before the manifest that says it is done":

    with OsCalls() as calls:
        prepare(...)
    pieces = [calls.published(p) for p in piece_paths]        # each: fsynced, renamed, directory fsynced
    manifest_rename, _ = calls.published(manifest_path)
    assert max(dir_sync for _, dir_sync in pieces) < manifest_rename

Files written in place (no rename) use `calls.durable_before(path, calls.mark("relied on"))`. Every assertion
message lists the events around the failure (`describe`). tests/e2e/test_durability.py shows each helper at work,
and checks that each assertion refuses the order it exists to refuse.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

FD_OPS = ("write", "pwrite", "ftruncate", "fsync", "fdatasync")
MODIFY = ("write", "pwrite", "ftruncate")
SYNC = ("fsync", "fdatasync")
RECORDED = ("open", *FD_OPS, "rename", "replace", "unlink", "remove")


@dataclass
class Call:
    """One os call that happened (failed calls are not events), in the order the process made them."""

    op: str  # open | write | pwrite | ftruncate | fsync | fdatasync | rename | replace | unlink | remove | mark
    path: str  # absolute; for rename/replace the source
    dst: str | None = None  # rename/replace: the destination
    ino: int | None = None  # the file's inode (for rename and unlink: the source's, just before)
    size: int | None = None  # the file's size after the call (rename: the source's before it)
    kind: str = "file"  # "dir" for a directory
    thread: str = ""
    info: dict | None = None  # open: {"flags": ...}; mark: what the caller said


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def _abs(path) -> str:
    return os.path.abspath(os.fsdecode(path))


class OsCalls:
    """Records os calls while installed (a context manager); `events` in call order, across threads."""

    def __init__(self, refuse_o_direct: bool = False):
        self.events: list[Call] = []
        self.refuse_o_direct = refuse_o_direct  # EINVAL at an open with O_DIRECT: a filesystem that refuses it
        self._real: dict[str, object] = {}
        self._lock = threading.Lock()

    # --- recording -----------------------------------------------------------------------------------------
    def __enter__(self) -> OsCalls:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        assert not self._real, "installed twice"
        for name in RECORDED:
            self._real[name] = getattr(os, name)
            setattr(os, name, getattr(self, f"_{name}"))

    def uninstall(self) -> None:
        for name, fn in self._real.items():
            setattr(os, name, fn)
        self._real = {}

    def _add(self, call: Call) -> None:
        call.thread = threading.current_thread().name
        with self._lock:
            self.events.append(call)

    def mark(self, op: str, **info) -> int:
        """Add an event of the caller's own (a vote, a phase of a test) to the same order; return its index."""
        with self._lock:
            self.events.append(Call("mark", "", thread=threading.current_thread().name, info={"what": op, **info}))
            return len(self.events) - 1

    def _fd_call(self, op: str, fd: int) -> None:
        try:
            st = os.fstat(fd)
        except OSError:
            return
        self._add(Call(op, _fd_path(fd), ino=st.st_ino, size=st.st_size,
                       kind="dir" if stat.S_ISDIR(st.st_mode) else "file"))

    def _open(self, path, flags, mode=0o777, *args, **kwargs):
        if self.refuse_o_direct and flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), os.fsdecode(path))
        fd = self._real["open"](path, flags, mode, *args, **kwargs)
        st = os.fstat(fd)
        self._add(Call("open", _fd_path(fd), ino=st.st_ino, size=st.st_size,
                       kind="dir" if stat.S_ISDIR(st.st_mode) else "file", info={"flags": flags}))
        return fd

    def _write(self, fd, data):
        out = self._real["write"](fd, data)
        self._fd_call("write", fd)
        return out

    def _pwrite(self, fd, data, offset):
        out = self._real["pwrite"](fd, data, offset)
        self._fd_call("pwrite", fd)
        return out

    def _ftruncate(self, fd, length):
        out = self._real["ftruncate"](fd, length)
        self._fd_call("ftruncate", fd)
        return out

    def _fsync(self, fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        out = self._real["fsync"](fd)
        self._fd_call("fsync", fd)
        return out

    def _fdatasync(self, fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        out = self._real["fdatasync"](fd)
        self._fd_call("fdatasync", fd)
        return out

    def _moved(self, op: str, src, dst, *args, **kwargs):
        try:
            st = os.lstat(src)
            ino, size = st.st_ino, st.st_size
        except (OSError, TypeError):
            ino = size = None
        try:
            replaced = os.lstat(dst).st_ino  # the inode the rename frees, if dst existed
        except (OSError, TypeError):
            replaced = None
        out = self._real[op](src, dst, *args, **kwargs)
        self._add(Call(op, _abs(src), _abs(dst), ino=ino, size=size, info={"replaced": replaced}))
        return out

    def _rename(self, src, dst, *args, **kwargs):
        return self._moved("rename", src, dst, *args, **kwargs)

    def _replace(self, src, dst, *args, **kwargs):
        return self._moved("replace", src, dst, *args, **kwargs)

    def _removed(self, op: str, path, *args, **kwargs):
        try:
            ino = os.lstat(path).st_ino
        except (OSError, TypeError):
            ino = None
        out = self._real[op](path, *args, **kwargs)
        self._add(Call(op, _abs(path), ino=ino))
        return out

    def _unlink(self, path, *args, **kwargs):
        return self._removed("unlink", path, *args, **kwargs)

    def _remove(self, path, *args, **kwargs):
        return self._removed("remove", path, *args, **kwargs)

    # --- persistence (the out-of-process runner) -------------------------------------------------------------
    def dump(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for call in self.events:
                f.write(json.dumps(asdict(call)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> OsCalls:
        calls = cls()
        calls.events = [Call(**json.loads(line)) for line in Path(path).read_text().splitlines() if line]
        return calls

    # --- queries -----------------------------------------------------------------------------------------
    def where(self, op: str | tuple[str, ...] | None = None, *, path=None, dst=None, ino: int | None = None,
              kind: str | None = None, thread: str | None = None, what: str | None = None) -> list[int]:
        """Indices of the events that match every criterion given (`what`: a mark's name)."""
        ops = (op,) if isinstance(op, str) else op
        path = _abs(path) if path is not None else None
        dst = _abs(dst) if dst is not None else None
        found = []
        for i, c in enumerate(self.events):
            if ((ops is None or c.op in ops) and (path is None or c.path == path) and (dst is None or c.dst == dst)
                    and (ino is None or c.ino == ino) and (kind is None or c.kind == kind)
                    and (thread is None or c.thread == thread)
                    and (what is None or (c.info or {}).get("what") == what)):
                found.append(i)
        return found

    def renames_onto(self, final) -> list[int]:
        return self.where(("rename", "replace"), dst=final)

    def describe(self, lo: int = 0, hi: int | None = None) -> str:
        """The events lo..hi, one a line: what an assertion message shows."""
        rows = []
        for i, c in list(enumerate(self.events))[lo:hi]:
            where = c.path + (f" -> {c.dst}" if c.dst else "")
            extra = f" {c.info}" if c.info else ""
            rows.append(f"{i:5d} {c.thread:<14} {c.op:<9} {c.kind:<4} ino={c.ino} size={c.size} {where}{extra}")
        return "\n".join(rows)

    # --- assertions --------------------------------------------------------------------------------------
    def durable_before(self, target, index: int, *, min_size: int | None = None) -> int:
        """Assert that the file `target` (a path, or an inode as an int) is durable at event `index`: an fsync
        of its inode before `index`, with no write, pwrite or ftruncate of that inode between the fsync and
        `index`, and a size at the fsync that is the size relied on (the size the rename at `index` saw, else
        at least `min_size`). Return the fsync's index."""
        if isinstance(target, int):
            ino = target
        else:
            seen = [i for i in range(index) if self.events[i].path == _abs(target) and self.events[i].ino]
            assert seen, f"no call on {target} before event {index}:\n{self.describe(max(0, index - 40), index + 1)}"
            ino = self.events[seen[-1]].ino
        # The inode's life as this file: after the last unlink of it, or rename over it (a number is reused).
        freed = [i for i in range(index) if (self.events[i].op in ("unlink", "remove") and self.events[i].ino == ino)
                 or (self.events[i].op in ("rename", "replace") and (self.events[i].info or {}).get("replaced") == ino)]
        born = freed[-1] + 1 if freed else 0
        mine = [i for i in range(born, index) if self.events[i].ino == ino and self.events[i].kind == "file"]
        syncs = [i for i in mine if self.events[i].op in SYNC]
        assert syncs, (f"{target}: never fsynced before event {index} ({self.events[index].op} "
                       f"{self.events[index].path}):\n{self.describe(max(0, index - 40), index + 1)}")
        last_sync = syncs[-1]
        later = [i for i in mine if i > last_sync and self.events[i].op in MODIFY]
        assert not later, (f"{target}: modified after its last fsync (event {last_sync}) and before event "
                           f"{index}:\n{self.describe(last_sync, index + 1)}")
        relied, got = self.events[index], self.events[last_sync].size
        if relied.op in ("rename", "replace") and relied.ino == ino:  # the file renamed is the file fsynced
            ok, want = got == relied.size, relied.size
        else:
            ok, want = min_size is None or got >= min_size, min_size
        assert ok, (f"{target}: {got} bytes at its last fsync (event {last_sync}), {want} relied on at "
                    f"event {index}: bytes written after the fsync are not durable")
        return last_sync

    def dir_synced_after(self, directory, index: int, before: int | None = None) -> int:
        """Assert a directory fsync of `directory` after event `index` (and before `before`); return its index."""
        syncs = [i for i in self.where(SYNC, path=directory, kind="dir")
                 if i > index and (before is None or i < before)]
        assert syncs, (f"{directory}: no directory fsync after event {index}"
                       + (f" and before event {before}" if before is not None else "")
                       + f":\n{self.describe(index, (before or index + 40) + 1)}")
        return syncs[0]

    def published(self, final, *, occurrence: int = -1, before: int | None = None) -> tuple[int, int]:
        """Assert the atomic publication of `final`: a rename onto it of a file durable at that moment (fsynced
        after its last write, nothing added since), then a fsync of final's directory (before `before` when
        given). `occurrence` picks among several renames onto the same name. Return (rename, dir fsync)."""
        renames = self.renames_onto(final)
        assert renames, f"{final}: never renamed into place:\n{self.describe(max(0, len(self.events) - 60))}"
        rename = renames[occurrence]
        call = self.events[rename]
        self.durable_before(call.ino if call.ino is not None else call.path, rename)
        return rename, self.dir_synced_after(Path(_abs(final)).parent, rename, before)


def main(argv: list[str]) -> int:
    """python -m tests.oscalls EVENTS [--refuse-o-direct] -- ANDREA_ARGS..."""
    if "--" not in argv or not argv:
        sys.stderr.write("usage: python -m tests.oscalls EVENTS [--refuse-o-direct] -- ARGS\n")
        return 2
    split = argv.index("--")
    opts, args = argv[:split], argv[split + 1:]
    events = opts[0]
    calls = OsCalls(refuse_o_direct="--refuse-o-direct" in opts)
    from andrea.cli import main as andrea_main
    calls.install()
    try:
        return andrea_main(args)
    finally:
        calls.uninstall()
        calls.dump(events)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
