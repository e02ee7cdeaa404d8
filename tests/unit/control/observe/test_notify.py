"""Notices (control/observe/notify.py): the rate limit with an injected clock, the format, delivery to a loopback server,
and failures that are one warning line, never the run's."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.keepers import NOTIFY_EVENTS, NotifyConfig
from andrea.control.observe.notify import HOUR, Notifier, admit, chain, event, from_marker
from tests.notices import Inbox
from tests.runs import andrea


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def inbox():
    box = Inbox()
    yield box
    box.close()


def test_the_rate_limit_admits_a_few_per_hour_of_each_kind_and_always_the_last_words():
    sent = [0.0, 10.0, 20.0]
    assert admit(sent, 30.0, 4, "incident") and not admit(sent + [25.0], 30.0, 4, "incident")
    assert admit(sent + [25.0], 25.0 + HOUR, 4, "incident")  # the oldest left the window
    assert all(admit([0.0] * 100, 1.0, 1, kind) for kind in ("finished", "stopped", "failed", "stall"))


def test_the_event_carries_what_an_operator_needs(tmp_path):
    doc = event("rollback", 40, run_dir=tmp_path, rank=0, now=12.3456, message="m", suppressed=2, checkpoint="x")
    assert {k: doc[k] for k in ("event", "step", "time", "run_dir", "rank", "message", "suppressed", "checkpoint")} \
        == {"event": "rollback", "step": 40, "time": 12.346, "run_dir": str(tmp_path), "rank": 0, "message": "m",
            "suppressed": 2, "checkpoint": "x"}
    assert "suppressed" not in event("stall", 1, run_dir=tmp_path, rank=1, now=0, message="m")
    json.dumps(doc)


def test_only_the_markers_an_operator_acts_on_are_notices():
    assert from_marker({"event": "incident", "step": 5, "reason": "loss nan"})[0] == "incident"
    assert from_marker({"event": "guard_stop", "step": 8, "attempts": 1, "resume_from": None})[0] == "guard_stop"
    assert from_marker({"event": "eval", "step": 50}) is None and from_marker({"step": 3, "loss": 1.0}) is None


def test_a_burst_is_rate_limited_and_the_next_notice_counts_what_was_dropped(inbox, tmp_path):
    clock = Clock()
    n = Notifier(NotifyConfig(url=inbox.url, max_per_hour=3), tmp_path, clock=clock)
    for step in range(10):
        n.send("incident", step, message="x")
    clock.now += HOUR
    n.send("incident", 99, message="x")
    n.send("finished", 100, message="done")
    n.close(30)
    assert [e["step"] for e in inbox.events] == [0, 1, 2, 99, 100]
    assert inbox.events[3]["suppressed"] == 7 and "suppressed" not in inbox.events[4]


def test_events_not_chosen_and_other_ranks_are_silent(inbox, tmp_path):
    quiet = Notifier(NotifyConfig(url=inbox.url, events=["stall"]), tmp_path)
    quiet.send("finished", 1, message="x")
    quiet.send("stall", 2, message="x")
    quiet.close(30)
    follower = Notifier(NotifyConfig(url=inbox.url), tmp_path, rank=1)
    follower.send("rollback", 3, message="x")  # rank 0 speaks for the run...
    follower.send("stall", 4, message="x")  # ...but a hung rank speaks for itself
    follower.close(30)
    assert [(e["event"], e["step"], e["rank"]) for e in inbox.events] == [("stall", 2, 0), ("stall", 4, 1)]


def test_a_command_gets_the_json_on_stdin(tmp_path):
    out = tmp_path / "got.json"
    cmd = shlex.join([sys.executable, "-c", f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"])
    n = Notifier(NotifyConfig(command=cmd), tmp_path)
    n.send("pivot", 7, message="pivot", phase=1)
    n.close(30)
    doc = json.loads(out.read_text())
    assert (doc["event"], doc["step"], doc["phase"]) == ("pivot", 7, 1)


def test_send_returns_while_the_command_still_runs(tmp_path):
    """The command waits for a file the test creates only after send() returned: a send that waited for the
    command would never return."""
    release, out = tmp_path / "release", tmp_path / "got.json"
    cmd = shlex.join([sys.executable, "-c", "import os, sys, time\ndoc = sys.stdin.read()\n"
                      f"while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
                      f"open({str(out)!r}, 'w').write(doc)"])
    n = Notifier(NotifyConfig(command=cmd, timeout_s=60), tmp_path)
    n.send("incident", 1, message="x")
    n.send("rollback", 1, message="x")  # queued behind the first
    assert not out.exists()
    release.touch()
    n.close(60)
    assert json.loads(out.read_text())["event"] == "rollback"


def test_failures_and_timeouts_are_one_warning_each(tmp_path, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/"
    failing = shlex.join([sys.executable, "-c", "import sys; sys.stdin.read(); print('boom', file=sys.stderr); "
                                                "sys.exit(3)"])
    slow = shlex.join([sys.executable, "-c", "import time; time.sleep(60)"])
    with caplog.at_level(logging.WARNING, logger="andrea.notify"):
        n = Notifier(NotifyConfig(command=failing, url=dead), tmp_path)
        n.send("failed", 1, message="x")
        n.close(30)
        s = Notifier(NotifyConfig(command=slow, timeout_s=0.5), tmp_path)
        s.send("stall", 2, message="x")
        s.close(30)
    lines = [r.getMessage() for r in caplog.records]
    assert any("notify.command: the failed notice exited 3 boom" in line for line in lines), lines
    assert any(line.startswith("notify.url: the failed notice was not delivered") for line in lines), lines
    assert any("notify.command: the stall notice took longer than 0.5 s" in line for line in lines), lines
    assert len(lines) == 3


def test_a_trickling_url_is_abandoned_at_its_deadline_and_the_next_notice_still_goes(tmp_path, caplog):
    """The server answers a byte every 0.1 s, forever: each read is quick, so a per-read timeout never fires.
    A deadline over the whole exchange ends each POST, and the thread goes on to the next notice."""
    slow = Inbox(trickle_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="andrea.notify"):
            n = Notifier(NotifyConfig(url=slow.url, timeout_s=0.5), tmp_path)
            n.send("incident", 1, message="x")
            n.send("rollback", 2, message="x")
            slow.wait_until(lambda box: len(box.events) == 2 and box.hung == 0)  # both sent, both cut off
            n.close(30)
    finally:
        slow.close()
    assert [e["event"] for e in slow.events] == ["incident", "rollback"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"notify.url: the {kind} notice took longer than 0.5 s (the whole exchange); abandoned"
                     for kind in ("incident", "rollback")]


def test_a_command_that_floods_its_output_costs_the_trainer_bounded_memory(tmp_path):
    """A command writing 400 MB to stderr (and as much to stdout) before it fails: the notifier's process keeps
    a few kB of it, quotes the last line, and its peak memory does not grow by the flood."""
    flood = shlex.join([sys.executable, "-c", "import os, sys\nchunk = b'x' * (1 << 20)\nfor _ in range(400):\n"
                        "    os.write(1, chunk); os.write(2, chunk)\nsys.stderr.write('\\nlast words\\n'); "
                        "sys.exit(3)"])
    probe = ("import json, logging, resource, sys\nfrom pathlib import Path\n"
             "from andrea.config.keepers import NotifyConfig\nfrom andrea.control.observe.notify import Notifier\n"
             "logging.basicConfig(stream=sys.stdout, format='%(message)s')\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             f"n = Notifier(NotifyConfig(command={flood!r}, timeout_s=120), Path({str(tmp_path)!r}))\n"
             "n.send('failed', 1, message='x')\nn.close(120)\n"
             "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    said, grown_kb = r.stdout.strip().splitlines()[:-1], json.loads(r.stdout.strip().splitlines()[-1])
    assert said == ["notify.command: the failed notice exited 3 last words"]
    assert grown_kb < 50 * 1024  # ru_maxrss is in kB on Linux: < 50 MB against a 400 MB flood


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_command_is_ended_with_everything_it_started(tmp_path, caplog):
    """`sh` starts a `sleep 1000` and waits for it: at the deadline the whole process group ends, the sleep
    included (killing the shell alone would leave the sleep running, orphaned)."""
    pidfile = tmp_path / "sleep.pid"
    cmd = shlex.join(["sh", "-c", f"sleep 1000 & echo $! > {shlex.quote(str(pidfile))}; wait"])
    with caplog.at_level(logging.WARNING, logger="andrea.notify"):
        n = Notifier(NotifyConfig(command=cmd, timeout_s=1), tmp_path)
        n.send("stall", 1, message="x")
        n.close(30)
    pid = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 10  # SIGKILL is delivered at once; init reaps the orphan shortly after
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"the command's sleep (pid {pid}) outlived the notice"
    finally:
        if alive(pid):
            os.kill(pid, 9)
    assert [r.getMessage() for r in caplog.records] == [
        "notify.command: the stall notice took longer than 1 s; abandoned (its process group ended)"]


def test_chain_calls_every_handler():
    seen: list = []
    assert chain(None, None) is None
    chain(seen.append, None, lambda lines: seen.append(len(lines)))([1, 2])
    assert seen == [[1, 2], 2]


@pytest.mark.parametrize("item, message", [
    ('notify.url="ftp://example.com/x"', "notify.url='ftp://example.com/x' must be an http:// or https:// URL"),
    ('notify.url="http:///nohost"', "notify.url='http:///nohost' must be an http"),
    ('notify.url="http://host:port/"', "notify.url='http://host:port/': bad port"),
    ("notify.command=\"'unbalanced\"", "notify.command=\"'unbalanced\": No closing quotation"),
    ('notify.events=["incident", "lunch"]', "notify.events: unknown event 'lunch'"),
])
def test_a_broken_notify_setting_is_one_line_naming_the_key(item, message):
    with pytest.raises(ConfigError) as err:
        configload.load(preset="andrea-tiny", overrides=[item])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_notify_command_whose_program_is_missing_is_refused_before_the_run_starts(tmp_path):
    run = tmp_path / "run"
    r = andrea("train", "--preset", "andrea-tiny", "--run-dir", str(run), "--set",
               'notify.command="no-such-program-andrea-test --page"')
    assert r.returncode == 2 and not run.exists()
    assert r.stderr.strip().splitlines() == [
        "andrea: error: notify.command='no-such-program-andrea-test --page': no program "
        "'no-such-program-andrea-test' found"]


def test_every_event_kind_is_a_row_of_the_generated_table_and_named_by_the_refusal():
    from andrea import notices
    table = notices.table()
    assert all(f"| `{kind}` |" in table for kind in NOTIFY_EVENTS)
    with pytest.raises(ConfigError) as err:
        NotifyConfig(events=["incident", "lion"])
    assert "'lion'" in str(err.value) and all(kind in str(err.value) for kind in ("all", *NOTIFY_EVENTS))


def test_all_sends_a_kind_added_after_the_run_toml_was_written_and_a_list_does_not(inbox, tmp_path, monkeypatch):
    from andrea import notices
    monkeypatch.setitem(notices.NOTICE_KINDS, "plateau_test", notices.Kind("plateau_test", "a kind of a later version"))
    every = Notifier(NotifyConfig(url=inbox.url), tmp_path)  # the default: ["all"]
    listed = Notifier(NotifyConfig(url=inbox.url, events=list(NOTIFY_EVENTS)), tmp_path)
    for n in (every, listed):
        n.send("plateau_test", 5, message="x")
        n.send("incident", 6, message="x")
        n.close(30)
    assert NotifyConfig().events == ["all"]
    assert [(e["event"], e["step"]) for e in inbox.events] == [("plateau_test", 5), ("incident", 6), ("incident", 6)]


def test_every_marker_with_a_message_is_a_notice_kind_and_every_last_word_is_a_kind():
    from andrea.control.observe.notify import LAST_WORDS
    from andrea.rundir.markers import MARKERS
    with_message = [m.name for m in MARKERS.values() if m.notice is not None]
    assert with_message and all(name in NOTIFY_EVENTS for name in with_message)
    assert set(LAST_WORDS) == {"finished", "stopped", "failed", "stall"}
def test_a_reply_that_drips_its_body_on_a_closing_connection_ends_at_the_one_deadline():
    """`HTTP/1.0 200`, `Content-Length: 60`, the body a byte every 0.2 s: http.client gives the socket to the reply
    and forgets it, so a cut through the connection found nothing to shut and the POST lasted the 12 s of the body.
    The deadline (1 s) holds over the whole exchange however the server answers."""
    from andrea.control.observe import delivery
    drip = Inbox(drip_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(delivery.Expired):
            delivery.post(drip.url, b'{"event": "incident"}', 1.0, {"Content-Type": "application/json"})
        took = time.monotonic() - t0
        drip.wait_until(lambda box: box.hung == 0, timeout=10)  # its socket was shut: the server saw it go
    finally:
        drip.close()
    assert 1.0 <= took < 1.8, took


@pytest.mark.parametrize("server", ["drip", "silent"])
def test_every_notice_after_a_hostile_reply_is_sent_or_named_in_a_warning_before_exit(tmp_path, caplog, server):
    """incident, rollback, finished to a server that drips its reply (each exchange cut at notify.timeout_s, the
    next notice then sent) or never answers; `close` at exit waits a bounded time and names every notice still
    queued or in flight. Each notice is accounted for: received by the server and abandoned in a warning, or
    named as not delivered; and close returns within its bound."""
    box = Inbox(drip_s=0.2) if server == "drip" else Inbox(silent=True)
    kinds = ["incident", "rollback", "finished"]
    try:
        with caplog.at_level(logging.WARNING, logger="andrea.notify"):
            n = Notifier(NotifyConfig(url=box.url, timeout_s=1.0), tmp_path)
            for step, kind in enumerate(kinds):
                n.send(kind, step, message="x")
            t0 = time.monotonic()
            n.close(4.0 if server == "drip" else 0.3)
            took = time.monotonic() - t0
    finally:
        box.close()
    lines = [r.getMessage() for r in caplog.records]
    abandoned = [k for k in kinds if f"notify.url: the {k} notice took longer than 1 s (the whole exchange); "
                                     "abandoned" in lines]
    dropped = [line for line in lines if line.startswith("notify: ") and "not delivered before exit" in line]
    assert took < 4.5 if server == "drip" else took < 1.0, took
    assert len(dropped) <= 1, lines
    unnamed = [k for k in kinds if k not in abandoned and not (dropped and k in dropped[0])]
    assert unnamed == [], lines
    if server == "drip":  # 3 exchanges of at most 1 s each fit in the 4 s close waits
        assert box.kinds() == kinds and abandoned == kinds and dropped == [], (box.kinds(), lines)
    else:
        assert "finished" in dropped[0], lines
