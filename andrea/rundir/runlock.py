"""One trainer per run directory: an flock on `RUN_DIR/train.lock` and the pid in `RUN_DIR/train.pid`.

The lock is held for the process's life and released by the kernel when it dies (even by SIGKILL), so a
stale `train.pid` never blocks a restart. `train.pid` holds the trainer's pid as decimal text and a newline.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from andrea.errors import UserError
from andrea.rundir import regular
from andrea.rundir.names import LOCK_NAME, PID_NAME, tmp_path


class RunLockedError(UserError, RuntimeError):
    pass


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.pid_path = run_dir / PID_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = regular.open_fd(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = read_pid(self.run_dir)
            for _ in range(40):  # the holder writes train.pid just after its flock: name it, not "pid None"
                if other is not None:
                    break
                time.sleep(0.05)
                other = read_pid(self.run_dir)
            raise RunLockedError(f"{self.run_dir}: another trainer (pid {other}) is running on this run "
                                 "directory") from None
        self._fd = fd
        tmp = tmp_path(self.pid_path)
        tmp.write_text(f"{os.getpid()}\n")
        os.rename(tmp, self.pid_path)

    def release(self) -> None:
        if self._fd is not None:
            self.pid_path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def is_locked(run_dir: Path) -> bool:
    path = run_dir / LOCK_NAME
    if not path.exists():
        return False
    fd = regular.open_fd(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def read_pid(run_dir: Path) -> int | None:
    try:
        return int(regular.read_text(run_dir / PID_NAME).strip())
    except (OSError, ValueError):
        return None
