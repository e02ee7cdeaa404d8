"""The watchdog's decisions over plain data (control/observe/watchdog.py): a fake clock, no threads hung, no sleeping."""

import threading

import pytest

from andrea.config.check import ConfigError
from andrea.config.keepers import WatchdogConfig
from andrea.control.observe.watchdog import Beats, Tracker, WatchedExecutor, limit


def tracker(floor=10.0, factor=10.0, max_tick=1.0) -> Tracker:
    return Tracker(floor, factor, max_tick)


def run(t: Tracker, polls):
    """Feed (now, snapshot) polls; return the first stall and the time it was declared, or None."""
    for now, snap in polls:
        stalls = t.observe(now, snap)
        if stalls:
            return now, stalls[0]
    return None


def test_the_limit_is_the_floor_or_a_multiple_of_the_slowest_wait():
    assert limit(900, 10, 0.0) == 900
    assert limit(900, 10, 30.0) == 900
    assert limit(900, 10, 120.0) == 1200


def test_a_busy_component_without_progress_stalls_just_past_its_limit():
    t = tracker(floor=10)
    polls = [(0.5 * i, {"train": (True, 7), "io": (False, 3)}) for i in range(100)]
    now, stall = run(t, polls)
    assert stall.component == "train" and stall.limit == 10 and 10 < stall.seconds <= 10.5 and now == 10.5


def test_an_idle_component_never_stalls():
    t = tracker(floor=1)
    assert run(t, [(float(i), {"train": (False, 1), "io": (False, 1), "boundary": (False, 2)})
                   for i in range(1000)]) is None


def test_a_slow_disk_that_keeps_moving_is_not_a_hang():
    """One commit that takes 20 limits, its write calls returning every 0.9 limit: never a stall."""
    t = tracker(floor=10)
    polls, count = [], 0
    for i in range(400):  # 0.5 s polls over 200 s; a write call returns every 9 s
        now = 0.5 * i
        if i % 18 == 0:
            count += 1
        polls.append((now, {"io": (True, count), "boundary": (True, count)}))
    assert run(t, polls) is None


def test_a_disk_that_stops_moving_is_a_hang_of_the_io_thread_not_the_boundary():
    t = tracker(floor=10)
    polls = [(0.5 * i, {"train": (False, 50), "io": (True, 9), "boundary": (True, 59)}) for i in range(60)]
    _, stall = run(t, polls)
    assert stall.component == "io"  # the most specific is named, though the boundary waits as long


def test_the_limit_grows_with_the_slowest_wait_seen():
    """Steps of 30 s raise the limit from the 40 s floor to 300 s: a 40 s step is then not a hang."""
    polls, now, count = [], 0.0, 0
    for _ in range(3):  # three 30 s steps, polled every 5 s
        for _ in range(6):
            now += 5
            polls.append((now, {"train": (True, count)}))
        count += 2
    t2 = tracker(floor=40, max_tick=5)
    assert run(t2, polls) is None and t2.slowest["train"] == 30 and t2.limit("train") == 300
    more = [(now + 5 * i, {"train": (True, count)}) for i in range(1, 9)]  # a 40 s step
    assert run(t2, more) is None


def test_sigstop_then_sigcont_is_not_a_hang():
    """A process stopped for an hour: the clock jumps by 3600 s between two polls, which counts as one tick."""
    t = tracker(floor=10, max_tick=1.0)
    polls = [(0.5 * i, {"train": (True, 4)}) for i in range(10)]  # 4.5 s busy
    polls += [(3600 + 0.5 * i, {"train": (True, 4)}) for i in range(5)]  # resumed: 1 s + 2 s more
    polls += [(3603.0, {"train": (True, 5)})]  # the step returns
    assert run(t, polls) is None
    assert t.slowest["train"] < 10


def test_the_boundary_is_moving_while_what_it_waits_on_moves():
    beats = Beats()
    beats.begin("boundary")
    before = beats.snapshot()["boundary"]
    beats.begin("train")
    beats.end("train")
    after = beats.snapshot()["boundary"]
    assert before[0] and after[0] and after[1] != before[1]


def test_a_watched_executor_counts_its_jobs_as_busy_time_and_progress():
    beats = Beats()
    pool = WatchedExecutor(beats, "io", thread_name_prefix="test-io")
    inside, release = threading.Event(), threading.Event()
    try:
        fut = pool.submit(lambda: (inside.set(), release.wait(30), 42)[-1])
        assert inside.wait(30)
        busy, count = beats.snapshot()["io"]
        assert busy and beats.io_tid is not None
        release.set()
        assert fut.result(30) == 42
        assert beats.snapshot()["io"][0] is False and beats.parts["io"].count == 2
    finally:
        release.set()
        pool.shutdown()


@pytest.mark.parametrize("key, value", [("floor_s", 0.0), ("factor", 1.5), ("poll_s", -1.0), ("poll_s", 1000.0)])
def test_bad_watchdog_settings_are_one_line_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^watchdog\.{key}="):
        WatchdogConfig(**{key: value})


def test_the_defaults_wait_longer_than_a_slow_disks_checkpoint():
    cfg = WatchdogConfig()
    assert cfg.enabled and cfg.floor_s >= 600 and cfg.poll <= 5 and cfg.collective_timeout_s >= cfg.floor_s


def test_the_peers_a_hung_rank_ends_are_the_other_ranks_on_its_host():
    from andrea.control.observe.watchdog import local_peers
    ranks = [("gpu7", 100), ("gpu7", 101), ("gpu8", 100), ("gpu7", 103)]
    assert local_peers(ranks, "gpu7", 101) == [100, 103]  # never itself, never a pid of another host
    assert local_peers([("gpu7", 100)], "gpu7", 100) == []  # one process: nobody to end


def test_a_peer_is_asked_for_its_stacks_then_ended(tmp_path):
    """end_peers on a real process: SIGUSR2 has its faulthandler write every thread's stack, then SIGKILL ends it
    (a stopped process too: SIGKILL needs no cooperation)."""
    import signal
    import subprocess
    import sys

    from andrea.control.observe.watchdog import end_peers
    from tests.runs import env
    err = tmp_path / "stderr"
    script = ("import sys, time\nfrom andrea.control.observe.watchdog import arm_stack_dump\narm_stack_dump()\n"
              "def waiting_for_a_collective():\n    print('armed', flush=True)\n    time.sleep(600)\n"
              "waiting_for_a_collective()\n")
    with open(err, "wb") as stderr:
        peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=env())
        try:
            assert peer.stdout.readline().strip() == "armed"
            end_peers([peer.pid])
            assert peer.wait(30) == -signal.SIGKILL
        finally:
            peer.kill()
    assert "in waiting_for_a_collective" in err.read_text()


def _peer(tmp_path, script: str):
    import subprocess
    import sys

    from tests.runs import env
    err = open(tmp_path / "stderr", "wb")
    body = "import sys, time\nfrom andrea.control.observe.watchdog import arm_stack_dump\narm_stack_dump()\n" + script
    return subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, stderr=err, text=True, env=env())


def test_a_peer_that_ends_on_the_note_within_the_grace_is_left_to_end(tmp_path):
    """The stall note ends a live peer by itself (its stacks, exit 75): end_peers waits for that rather than
    SIGKILL it mid-marker."""
    from andrea.control.observe.watchdog import end_peers
    peer = _peer(tmp_path, "print('armed', flush=True)\ntime.sleep(1.0)\nsys.exit(75)\n")
    try:
        assert peer.stdout.readline().strip() == "armed"
        end_peers([peer.pid], grace=60)
        assert peer.wait(30) == 75
    finally:
        peer.kill()
    assert "Current thread" not in (tmp_path / "stderr").read_text()  # never asked for its stacks


def test_a_frozen_peer_is_ended_without_waiting_out_the_grace(tmp_path):
    """A stopped rank cannot end on any note: it is asked for its stacks and SIGKILLed at once, not after the
    grace (the thread running end_peers is joined well before the grace would have run out)."""
    import signal

    from andrea.control.observe.watchdog import end_peers
    peer = _peer(tmp_path, "print('armed', flush=True)\ntime.sleep(600)\n")
    try:
        assert peer.stdout.readline().strip() == "armed"
        peer.send_signal(signal.SIGSTOP)
        ender = threading.Thread(target=end_peers, args=([peer.pid], 600.0), daemon=True)
        ender.start()
        ender.join(60)
        assert not ender.is_alive(), "end_peers waited on a frozen peer"
        assert peer.wait(30) == -signal.SIGKILL
    finally:
        peer.kill()


def test_an_error_on_the_way_out_still_ends_the_hung_run_with_75(tmp_path):
    """A notice hook that raises (or any other error while the watchdog acts) must not leave the hung process
    waiting for good: the error is logged and the exit code is the watchdog's all the same."""
    import subprocess
    import sys

    from andrea.config.keepers import STALL_EXIT_CODE
    from tests.runs import env
    script = ("from andrea.control.observe.watchdog import end_hung_run\n"
              "from andrea.control.parallel.stall_notes import Note\n"
              "def notify(*a, **k):\n    raise TypeError('a broken notice')\n"
              "end_hung_run(Note(0, 1, 'h', 19, 'train', 5.0, 4.0), append_marker=None, io=None, notify=notify,\n"
              "             close_notices=lambda t: None)\n"
              "print('returned')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == STALL_EXIT_CODE and "returned" not in r.stdout, r.stderr[-2000:]
    assert "a broken notice" in r.stderr


def test_a_process_whose_state_cannot_be_read_counts_as_there(monkeypatch):
    """Without /proc (another Unix) a live peer must still be waited for and ended, never skipped as gone; a pid
    that does not exist is gone either way."""
    import builtins
    import os

    from andrea.control.observe import watchdog
    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", no_proc)
    assert watchdog.proc_state(os.getpid()) not in watchdog.GONE
    assert watchdog.proc_state(2 ** 22 + 12345) is None  # above pid_max's default: no such process
