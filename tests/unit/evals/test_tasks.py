"""Reading a tasks file (evals/tasks.py `read_tasks`) as a hostile user writes one: a line of 20 MB, a byte-order
mark, bytes that are not UTF-8 on some line. Each is one TaskFileError naming the file and the line, or read."""

from __future__ import annotations

import codecs
import hashlib
import json

import pytest

from andrea.evals import tasks as ev

GOOD = json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 1}).encode() + b"\n"


def test_a_line_longer_than_the_bound_is_refused_naming_its_line_without_reading_it_whole(tmp_path):
    """A 20 MB example (valid JSON) on line 2: refused at MAX_LINE_BYTES, which is all that is read of it."""
    path = tmp_path / "tasks.jsonl"
    huge = json.dumps({"ctx": "x" * (20 << 20), "endings": ["b", "c"], "label": 0}).encode()
    path.write_bytes(GOOD + huge + b"\n" + GOOD)
    with pytest.raises(ev.TaskFileError) as err:
        ev.read_tasks(path)
    assert str(err.value) == f"{path}:2: longer than 1 MiB (an example is a context and a few endings: a few kB)"


def test_a_line_at_the_bound_is_read(tmp_path):
    path = tmp_path / "tasks.jsonl"
    empty = json.dumps({"ctx": "", "endings": ["b", "c"], "label": 0}).encode()
    ctx = "x" * (ev.MAX_LINE_BYTES - len(empty))
    line = json.dumps({"ctx": ctx, "endings": ["b", "c"], "label": 0}).encode()
    assert len(line) == ev.MAX_LINE_BYTES
    path.write_bytes(line + b"\n" + GOOD)
    assert [t.context for t in ev.read_tasks(path).tasks] == [ctx, "a"]


def test_a_byte_order_mark_at_the_start_is_accepted_and_hashed_with_the_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    data = codecs.BOM_UTF8 + GOOD + GOOD
    path.write_bytes(data)
    f = ev.read_tasks(path)
    assert [(t.line, t.context, t.label) for t in f.tasks] == [(1, "a", 1), (2, "a", 1)]
    assert f.sha256 == hashlib.sha256(data).hexdigest()


def test_bytes_that_are_not_utf8_are_named_by_their_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(GOOD + b"\n" + GOOD.replace(b'"a"', b'"\xff"'))
    with pytest.raises(ev.TaskFileError) as err:
        ev.read_tasks(path)
    assert str(err.value) == f"{path}:3: not UTF-8 text (byte 9 of the line)"
