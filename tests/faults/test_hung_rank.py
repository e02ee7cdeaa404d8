"""A rank that hangs while its peer already waits on it (issue 55, hole 6), under real torchrun: two ranks of the
tiny preset, rank 1's training thread hung after step 25 (ANDREA_TEST_HANG=train@25@1), steps as short as they come.
Rank 0 starts waiting in the step boundary's collective before rank 1 hangs, so its watchdog's clock may start
first and fire first; it is a witness (control/parallel/stall_notes.py: WITNESS_GRACE_S), and the record must name
the rank that hung, once: one `stall` marker with `rank` 1, one `stall` notice, sent by rank 1.

About 40 s on the 2-core development machine (torchrun's start, 25 steps, the watchdog's 4 s floor and the
witness's grace): `make faults` runs it (marked slow), `make test` does not.
"""

from __future__ import annotations

import re

import pytest

from tests.notices import Inbox
from tests.runs import Launched, launcher_argv, ledger, seed_data

FLOOR = 4.0
FAST_DOG = ["--set", f"watchdog.floor_s={FLOOR}", "--set", "watchdog.factor=2"]


@pytest.mark.slow
def test_the_rank_that_hung_is_the_rank_named_once_on_the_record_and_in_one_notice(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    inbox = Inbox()
    t = Launched(launcher_argv(run, "--steps", "40", "--checkpoint-every", "10", *FAST_DOG,
                               "--set", f'notify.url="{inbox.url}"'),
                 extra_env={"ANDREA_TEST_HANG": "train@25@1"})
    try:
        t.wait_for(lambda line: "ANDREA_TEST_HANG" in line and "hangs now" in line, timeout=240)
        rc = t.wait_exit(120)  # every worker has ended, so every notice a worker sends is in the inbox
        out = t.output()
        assert rc != 0, out[-4000:]
        assert re.search(r"andrea\.watchdog\[1\]: watchdog: the training thread made no progress", out), out[-4000:]
        stalls = [e for e in ledger(run) if e.get("event") == "stall"]
        assert len(stalls) == 1 and stalls[0]["rank"] == 1 and stalls[0]["component"] == "train", \
            (stalls, out[-4000:])
        notices = [e for e in inbox.events if e["event"] == "stall"]
        assert len(notices) == 1 and notices[0]["rank"] == 1 and notices[0]["component"] == "train", \
            (notices, out[-4000:])
    finally:
        t.kill()
        inbox.close()
