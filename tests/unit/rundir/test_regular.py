"""rundir/regular.py: a run file is opened only when it is a regular file, and refused at once otherwise; and
rundir/inspect.py's `special_files`, the same refusal by name for a whole run directory. Every open here runs on a
daemon thread joined with a timeout, so a regression that waits on a FIFO fails instead of hanging the suite."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from andrea.rundir import regular
from andrea.rundir.inspect import special_files


def within(fn, timeout: float = 10.0):
    """fn()'s result or exception, or a failure when it has not returned within `timeout` seconds."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001
            out.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if not out:
        pytest.fail(f"still blocked after {timeout} s")
    return out[0]


def special(tmp_path, kind: str):
    path = tmp_path / "step_000040.sum.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "device":
        os.symlink("/dev/null", path)  # a link is followed: what counts is the file it ends at
    return path


WORDS = {"fifo": "a FIFO (named pipe)", "dir": "a directory", "socket": "a socket", "device": "a character device"}
OPENS = {"read": regular.read_bytes, "read+write": lambda p: regular.open_file(p, "rb+").close(),
         "append": lambda p: os.close(regular.open_fd(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT))}


@pytest.mark.parametrize("kind", WORDS)
@pytest.mark.parametrize("how", OPENS)
def test_anything_but_a_regular_file_is_refused_at_once_in_one_line_naming_it(tmp_path, kind, how):
    path = special(tmp_path, kind)
    status, e = within(lambda: OPENS[how](path))
    assert status == "raised" and isinstance(e, regular.NotRegularFile), (status, e)
    assert isinstance(e, OSError)  # every reader's `except OSError` sees it
    assert str(e) == f"{path}: is {WORDS[kind]}, not a regular file: nothing read from it; remove or rename it"
    assert "\n" not in str(e)


def test_a_regular_file_reads_as_before_and_a_missing_one_is_still_file_not_found(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"[model]\n")
    assert regular.read_bytes(path) == b"[model]\n" and regular.read_text(path) == "[model]\n"
    with regular.open_file(path) as f:
        assert os.get_blocking(f.fileno())  # O_NONBLOCK cleared before it is handed on
    with pytest.raises(FileNotFoundError):
        regular.read_bytes(tmp_path / "absent")
    fd = regular.open_fd(tmp_path / "new.json", os.O_WRONLY | os.O_CREAT)  # a writer may create it
    os.close(fd)
    assert (tmp_path / "new.json").is_file()


def test_a_run_directory_with_a_special_file_at_one_of_its_names_is_listed_and_others_are_not(tmp_path):
    os.mkfifo(tmp_path / ".loss.json")
    (tmp_path / "step_000040.guard.json").mkdir()
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "manifest.json")
    (tmp_path / "data" / "cache").mkdir()  # a directory inside data/ is no file of it
    os.mkfifo(tmp_path / "notes.fifo")  # not a name of the run's: the user's business
    (tmp_path / "run.toml").write_text("")
    assert [(p.relative_to(tmp_path).as_posix(), kind) for p, kind in special_files(tmp_path)] == [
        (".loss.json", "a FIFO (named pipe)"), ("step_000040.guard.json", "a directory"),
        ("data/manifest.json", "a FIFO (named pipe)")]
