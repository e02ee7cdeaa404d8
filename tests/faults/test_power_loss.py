"""Power loss: the commit order is right, so a write cut at any stage leaves the old or the new checkpoint.

In-process: `commit_checkpoint` runs with the os calls it makes wrapped, once per crash point and once per write
path (O_DIRECT, and the buffered fallback a filesystem that refuses O_DIRECT gets). At the point the wrapper
copies the run directory as it is at that instant (the "disk image" the machine reboots into), then raises
`PowerCut` so nothing after it runs. What the page cache held is lost with the power: every byte written since
its file's last fsync reads back as garbage (0xFF: NaN in every float) in the image, so a commit that renames a
file it never fsynced leaves a checkpoint that fails validation (a SIGKILL, which keeps the page cache, never
shows that). After the rename and before the directory fsync the rename itself may be lost on a real power cut,
so that point yields two images: rename kept and rename lost. Each image is then started the way the trainer
starts (`remove_stale_tmp`, `newest_valid`). Out of process: a real trainer is SIGKILLed inside the
ANDREA_TEST_COMMIT_DELAY window and restarted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.checkpoint_write import DirectIO, commit_checkpoint
from tests.faults.harness import REPORT, checkpoint_problems, first_line_with, newest_committed, sigkill
from tests.runs import train, wait_until

N = 4096
STAGES = ["before-open", "after-open", "mid-write", "after-write", "after-fsync", "after-rename", "after-dir-fsync"]
BEFORE_RENAME = STAGES[:5]
PATHS = {"O_DIRECT": True, "buffered": False}  # the write path: DirectIO(enabled)


class PowerCut(BaseException):
    """The machine lost power here (BaseException: no `except Exception` may swallow it)."""


def payload(seed: int) -> np.ndarray:
    p = np.random.default_rng(seed).standard_normal(3 * N).astype(np.float32)
    p[2 * N:] = np.abs(p[2 * N:])
    return p


class Journal:
    """Wraps os.open/pwrite/fsync/rename: records what commit_checkpoint does and cuts the power at `stage`;
    `unsynced` holds, per inode, the (offset, length) written since its last fsync: what the power cut loses."""

    def __init__(self, run_dir: Path, images: Path, stage: str | None):
        self.run_dir, self.images, self.stage = run_dir, images, stage
        self.events: list[tuple] = []
        self.paths: dict[int, str] = {}
        self.real = {name: getattr(os, name) for name in ("open", "pwrite", "fsync", "rename")}
        self.taken: list[Path] = []
        self.unsynced: dict[int, list[tuple[int, int]]] = {}
        self.published = False  # the checkpoint's own rename has happened

    def install(self, m: pytest.MonkeyPatch) -> None:
        for name in self.real:
            m.setattr(os, name, getattr(self, name))

    def cut(self, lost_rename: tuple[str, str] | None = None) -> None:
        lost_pages = {p.name: self.unsynced[p.stat().st_ino] for p in self.run_dir.iterdir()
                      if p.is_file() and self.unsynced.get(p.stat().st_ino)}
        image = self.images / f"image{len(self.taken)}"
        shutil.copytree(self.run_dir, image)
        self.taken.append(image)
        _lose_page_cache(image, lost_pages)
        if lost_rename is not None:  # the same instant, had the directory entry not reached the disk
            lost = self.images / f"image{len(self.taken)}"
            shutil.copytree(self.run_dir, lost)
            os.replace(lost / Path(lost_rename[1]).name, lost / Path(lost_rename[0]).name)
            self.taken.append(lost)
            final, tmp = Path(lost_rename[1]).name, Path(lost_rename[0]).name
            _lose_page_cache(lost, {tmp if name == final else name: r for name, r in lost_pages.items()})
        raise PowerCut(self.stage)

    def _written(self, fd: int, offset: int, length: int) -> None:
        self.unsynced.setdefault(os.fstat(fd).st_ino, []).append((offset, length))

    def open(self, path, flags, mode=0o777, *args, **kwargs):
        tmp = str(path).endswith(names.TMP_SUFFIX)
        if tmp and self.stage == "before-open":
            self.cut()
        fd = self.real["open"](path, flags, mode, *args, **kwargs)
        self.paths[fd] = str(path)
        self.events.append(("open", str(path)))
        if tmp and self.stage == "after-open":
            self.cut()
        return fd

    def pwrite(self, fd, data, offset):
        if self.stage == "mid-write" and len(data) > 8:
            half = len(data) // 2
            self._written(fd, offset, self.real["pwrite"](fd, data[:half], offset))
            self.events.append(("write", self.paths.get(fd)))
            self.cut()
        written = self.real["pwrite"](fd, data, offset)
        self._written(fd, offset, written)
        self.events.append(("write", self.paths.get(fd)))
        return written

    def fsync(self, fd):
        path = self.paths.get(fd)
        if self.stage == "after-write" and path and path.endswith(names.TMP_SUFFIX):
            self.cut()
        self.real["fsync"](fd)
        self.unsynced.pop(os.fstat(fd).st_ino, None)  # on the disk now, whatever happens next
        self.events.append(("fsync", path))
        if self.stage == "after-dir-fsync" and path == str(self.run_dir) and self.published:
            self.cut()

    def rename(self, src, dst):
        self.real["rename"](src, dst)
        self.events.append(("rename", str(src), str(dst)))
        # The checkpoint's own rename (its checksum companion's, durable before it, is not the commit point).
        self.published = self.published or str(src).endswith(".bin" + names.TMP_SUFFIX)
        if self.stage == "after-rename" and self.published:
            self.cut(lost_rename=(str(src), str(dst)))

    def before_rename(self) -> None:
        if self.stage == "after-fsync":
            self.cut()


def _lose_page_cache(image: Path, lost: dict[str, list[tuple[int, int]]]) -> None:
    """In the disk image, overwrite every range written since its file's last fsync with 0xFF bytes."""
    for name, ranges in lost.items():
        path = image / name
        if not path.exists():
            continue
        size = path.stat().st_size
        with open(path, "r+b") as f:
            for offset, length in ranges:
                if offset < size:
                    f.seek(offset)
                    f.write(b"\xff" * min(length, size - offset))


def _run_dir_with_old_checkpoint(tmp_path: Path) -> tuple[Path, bytes]:
    run = tmp_path / "run"
    run.mkdir()
    old = commit_checkpoint(run, 10, payload(10))
    return run, old.read_bytes()


@pytest.mark.parametrize("path", PATHS)
def test_commit_writes_the_tmp_fsyncs_it_renames_it_then_fsyncs_the_directory_in_that_order(tmp_path, monkeypatch,
                                                                                            path):
    run, _ = _run_dir_with_old_checkpoint(tmp_path)
    journal = Journal(run, tmp_path, None)
    with monkeypatch.context() as m:
        journal.install(m)
        commit_checkpoint(run, 20, payload(20), before_rename=journal.before_rename,
                               direct=DirectIO(PATHS[path]))
    final, tmp = str(run / "step_000020.bin"), str(run / "step_000020.bin.tmp")
    ev = journal.events
    last_write = max(i for i, e in enumerate(ev) if e == ("write", tmp))
    fsync_tmp = next(i for i, e in enumerate(ev) if e == ("fsync", tmp))
    rename = ev.index(("rename", tmp, final))
    fsync_dir = next(i for i, e in enumerate(ev) if e == ("fsync", str(run)) and i > rename)
    assert last_write < fsync_tmp < rename < fsync_dir, ev
    assert not [e for e in ev if e[0] in ("open", "write") and e[1] == final], "the final name was written directly"
    assert not journal.unsynced, "bytes of the commit were never fsynced"
    REPORT.note("power loss", f"commit order ({path}): write tmp → fsync tmp → rename → fsync dir (os calls)")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage", STAGES)
def test_power_cut_at_each_commit_stage_leaves_the_old_or_the_new_checkpoint_never_neither(tmp_path, monkeypatch,
                                                                                          stage, path):
    run, old_bytes = _run_dir_with_old_checkpoint(tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    journal = Journal(run, images, stage)
    with monkeypatch.context() as m:
        journal.install(m)
        with pytest.raises(PowerCut):
            commit_checkpoint(run, 20, payload(20), before_rename=journal.before_rename,
                                   direct=DirectIO(PATHS[path]))
    assert journal.taken, f"the power cut at {stage} never happened"
    seen = []
    for image in journal.taken:
        ckpt.remove_stale_tmp(image)  # what the next start does first
        info, skipped = ckpt.newest_valid(image, N)
        assert not skipped and not checkpoint_problems(image, N), (path, stage, skipped)
        assert info is not None, f"power cut {stage}: neither the old nor the new checkpoint survived"
        assert (image / "step_000010.bin").read_bytes() == old_bytes, "the old checkpoint changed"
        seen.append(info.step)
        if stage in BEFORE_RENAME:
            assert info.step == 10 and not (image / "step_000020.bin").exists()
    if stage == "after-dir-fsync":
        assert seen == [20]
    if stage == "after-rename":
        assert seen == [20, 10]  # rename kept / rename lost: the new one or the old one
    # The interrupted process itself (the exception path) leaves no temporary file behind.
    assert not list(run.glob("*.tmp")) or stage not in BEFORE_RENAME
    REPORT.note("power loss", f"cut {stage:<16} ({path:<8}) → resumes from step {' or '.join(map(str, seen))}")


def test_sigkill_in_the_commit_window_keeps_the_old_checkpoint_and_the_next_start_removes_the_tmp(
        trained_copy, launch, n_params):
    old = (trained_copy / "step_000020.bin").read_bytes()
    t = launch(trained_copy, "--steps", "30", extra_env={"ANDREA_TEST_COMMIT_DELAY": "5"})
    tmp = trained_copy / "step_000030.bin.tmp"
    size = ckpt.checkpoint_bytes(n_params)

    def written() -> bool:  # the .tmp appears before its bytes; the O_DIRECT image is cut to size at its end
        try:
            return tmp.stat().st_size == size
        except FileNotFoundError:
            return False

    # inside ANDREA_TEST_COMMIT_DELAY's 5 s: the .tmp complete, the rename not yet done
    wait_until(lambda: written() or t.proc.poll() is not None, 90, "step_000030.bin.tmp written")
    assert sigkill(t.proc), t.output()
    t.wait_exit(30)
    assert tmp.stat().st_size == size  # complete, never renamed
    assert not (trained_copy / "step_000030.bin").exists()
    assert newest_committed(trained_copy) == 20 and (trained_copy / "step_000020.bin").read_bytes() == old
    assert not checkpoint_problems(trained_copy, n_params)
    result = train(trained_copy, "--steps", "30")
    assert result.returncode == 0, result.stderr[-2000:]
    assert first_line_with(result.stderr, "removed step_000030.bin.tmp"), result.stderr[-2000:]
    assert " step=20 " in result.stdout
    assert not tmp.exists() and not checkpoint_problems(trained_copy, n_params)
    assert newest_committed(trained_copy) == 30
    REPORT.note("power loss", "SIGKILL in the commit window: step 20 intact, the complete .tmp removed at the next "
                              "start, step 30 redone")
