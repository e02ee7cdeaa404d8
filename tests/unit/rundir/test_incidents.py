"""Incidents on the record (rundir/incidents.py): the markers of a start below the newest checkpoint, the last of
each kind for `andrea status`, and their notices (control/observe/notify.py `from_marker`)."""

from andrea.config.keepers import NOTIFY_EVENTS
from andrea.control.observe.notify import from_marker
from andrea.rundir.incidents import KINDS, last_of_each, regions_named, resume_markers


def test_a_start_below_the_newest_names_each_quarantined_file_its_region_and_why():
    skipped = ["/runs/a/step_000040.bin: checksum mismatch in weights, m: the bytes changed after the commit (...)",
               "/runs/a/step_000030.bin: truncated: 12 bytes, shorter than the 8-byte header"]
    lines = resume_markers(20, skipped, ["step_000030.bin", "step_000040.bin"], "quarantine")
    assert [e["event"] for e in lines] == ["quarantine", "quarantine", "resume_below"]
    q30, q40, below = lines
    assert (q30["step"], q30["file"], q30["regions"], q30["to"]) == (20, "step_000030.bin", [], "quarantine/")
    assert q30["reason"].startswith("step_000030.bin: truncated")  # the file's name, not the machine's path
    assert (q40["file"], q40["regions"]) == ("step_000040.bin", ["weights", "m"])
    assert (below["step"], below["newest"], below["skipped"]) == (20, 40, ["step_000030.bin", "step_000040.bin"])
    assert below["reason"].startswith("step_000040.bin: checksum mismatch in weights, m")
    assert resume_markers(40, [], [], "quarantine") == []  # resumed from the newest: nothing to say


def test_regions_are_read_from_the_validation_line():
    assert regions_named("x: checksum mismatch in v: the bytes changed") == ["v"]
    assert regions_named("x: weights[3] is not finite (nan)") == []


def test_status_shows_the_newest_marker_of_each_kind():
    entries = [{"event": "replica_down", "step": 5, "error": "a"}, {"step": 6, "loss": 1.0},
               {"event": "replica_back", "step": 9, "down_s": 3.0}, {"event": "replica_down", "step": 12, "error": "b"},
               {"event": "quarantine", "step": 20, "file": "step_000040.bin"}]
    last = last_of_each(entries)
    assert set(last) == set(KINDS)
    assert last["replica_down"]["error"] == "b" and last["replica_back"]["step"] == 9
    assert last["quarantine"]["file"] == "step_000040.bin" and last["stall"] is None


def test_every_new_marker_is_a_notice_with_a_message():
    lines = [{"event": "quarantine", "step": 20, "file": "step_000040.bin", "to": "quarantine/", "reason": "r"},
             {"event": "resume_below", "step": 20, "newest": 40, "reason": "r"},
             {"event": "replica_down", "step": 7, "uri": "s3://b/p", "error": "cannot be reached"},
             {"event": "replica_back", "step": 9, "uri": "s3://b/p", "down_s": 9.2, "replica_step": 5}]
    for line in lines:
        kind, message = from_marker(line)
        assert kind == line["event"] and kind in NOTIFY_EVENTS and message
    assert "step_000040.bin" in from_marker(lines[0])[1] and "step 40" in from_marker(lines[1])[1]
    assert "9.2 s" in from_marker(lines[3])[1]
