"""The spare: the checkpoint retention releases, kept under `spare.ckpt` so the next commit overwrites its blocks.

Reads nothing; renames and unlinks files in a run directory. `spare.ckpt` is not a checkpoint: its name is not
`step_NNNNNN.bin`, so nothing lists, validates or loads it (rundir/checkpoint.py), and its bytes are whatever the
last commit into it left (a released checkpoint, or a commit that was interrupted).

Why. A checkpoint written into a fresh file makes the filesystem allocate every block as the O_DIRECT writes
arrive: on ext4 each write into unallocated space journals new extents and takes the inode exclusively, so the
ZeRO-1 ranks writing one file take turns. Overwriting blocks that are already allocated is a pure data write:
no allocation, no extent journal, and the ranks' writes run side by side. Measured on this repository's CI
machine (ext4 on a virtual disk, ANDREA-12M, `bench/checkpoint_dist.py`): one writer's commit 1.6-2x faster
into the spare than into a new file (0.036 s against 0.072 s), part of it the virtual disk's own cost of first
writes. Retention's unlink of a large file (freeing its extents) becomes a rename.

The cycle, on the commit's I/O thread (rank 0's in a ZeRO-1 run):
    retire   retention releases `step_K.bin`: rename it onto `spare.ckpt` (an older spare goes, as an unlink
             would take it), then keep it only if it has no other name and no other process has it open
             (below); else unlink it.
    claim    the next commit renames `spare.ckpt` onto its `step_N.bin.tmp` (unless it has another name too,
             `cp -al RUN COPY`: then it is unlinked and the commit writes a fresh file), then writes every byte of
             [0, 8 + 12·n) and sets the length: nothing of the released checkpoint survives. The atomic protocol
             is unchanged (write, fsync, rename, directory fsync); only the `.tmp` starts out allocated. In a
             ZeRO-1 run rank 0 claims before the exchange that starts the commit, and the other ranks open
             the `.tmp` only after it (andrea/control/commit/shards.py).
Disk space: between commits the spare is one checkpoint more on disk; during a commit it is the `.tmp`, so the
peak (K checkpoints and the one being written) is what it was without it.

Readers. Unlinking a file never disturbs a process that has it open, nor another name of it: they keep the old
bytes. Overwriting does. So a released checkpoint becomes the spare only if, once renamed (no one can open it or
link it by its old name any more), it has no other name (`andrea branch` hard-links the checkpoint it starts
from) and no other open file or mapping refers to it: Linux grants a write lease exactly then (fcntl(2)
F_SETLEASE). An operator's `rsync` or `andrea export` of an old checkpoint, running as retention releases it,
keeps its bytes. Leases see this machine's processes only; a filesystem that cannot tell (no leases: NFS and
other network filesystems) never keeps a spare, and every commit writes a fresh file, as without recycling. The lease is only a question: it is released
as soon as it is granted, and a break in that instant is signalled with SIGURG (ignored by default), never the
SIGIO that would end the process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import stat
from pathlib import Path

from andrea.rundir import regular
from andrea.rundir.names import SPARE_NAME


def spare_path(run_dir: Path) -> Path:
    return Path(run_dir) / SPARE_NAME


def retire(path: Path) -> bool:
    """Retention's removal of the checkpoint at `path`: it becomes the spare when it has no other name and no
    one else has it open, else it is unlinked. True when it became the spare. Missing: nothing to do (False)."""
    spare = spare_path(path.parent)
    if blocked(path.parent) is not None:  # not ours to replace: the released checkpoint is only unlinked
        path.unlink(missing_ok=True)
        return False
    try:
        os.rename(path, spare)
    except FileNotFoundError:
        return False
    st = os.lstat(spare)  # a symbolic link someone put in place of a checkpoint is only unlinked
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and _unshared(spare):
        return True
    spare.unlink(missing_ok=True)
    return False


def claim(tmp: Path) -> bool:
    """Rename the run directory's spare onto `tmp`, the temporary file a commit is about to write; False when
    there is none, or when `spare.ckpt` is not a regular file (a symbolic link to some other file, a directory:
    not andrea's, left alone). The writer must open `tmp` without O_TRUNC and write every byte of the checkpoint."""
    spare = spare_path(tmp.parent)
    try:
        st = os.lstat(spare)
        if not stat.S_ISREG(st.st_mode):  # only a file retire made: never through a link
            return False
        if st.st_nlink > 1:  # another name shares its blocks (`cp -al RUN COPY`): writing would change that file
            spare.unlink()
            return False
        os.rename(spare, tmp)
    except FileNotFoundError:
        return False
    return True


def blocked(run_dir: Path) -> str | None:
    """Why `spare.ckpt` cannot be used, in words (something that is not a regular file is there: a directory,
    a link; left alone, never removed), or None."""
    try:
        st = os.lstat(spare_path(run_dir))
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) \
        else "not a regular file"
    return f"{spare_path(run_dir)} is {kind}, not andrea's spare: left alone; released checkpoints are deleted"


def _unshared(path: Path) -> bool:
    """True when no open file description but ours refers to `path`'s inode: a write lease is granted only
    then (readers' descriptors and mappings count). EAGAIN: someone has it open; EINVAL, ENOLCK and the
    like: this filesystem cannot tell, so the answer is no."""
    fd = regular.open_fd(path)
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)  # a lease break in the instant we hold it: ignored
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EINVAL, errno.ENOLCK, errno.EACCES, errno.ENOSYS, errno.EPERM):
            raise
        return False
    finally:
        os.close(fd)  # releases the lease
    return True
