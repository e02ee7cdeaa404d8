"""RunLock's refusal names the holder's pid even when it arrives in the instant between the holder's flock and its
train.pid (two trainers started together)."""

import fcntl
import os
import threading

import pytest

from andrea.rundir.runlock import RunLock, RunLockedError


def test_a_refusal_in_the_holders_first_instant_still_names_its_pid(tmp_path):
    fd = os.open(tmp_path / "train.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the holder has its lock, not yet its train.pid
    late = threading.Timer(0.3, lambda: (tmp_path / "train.pid").write_text("4242\n"))
    late.start()
    try:
        with pytest.raises(RunLockedError, match=r"another trainer \(pid 4242\) is running"):
            RunLock(tmp_path).acquire()
    finally:
        late.join()
        os.close(fd)
