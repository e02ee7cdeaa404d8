"""`log.wandb = true`: W&B's history equals the ledger's settled history through a resume and a rollback.

W&B runs in offline mode (no network here) and its files are read back: `RUN_DIR/wandb/offline-run-*/run-ID.wandb`
is W&B's transaction log, LevelDB's log format (32 KiB blocks of records: a 7-byte header — CRC32C, length,
type FULL / FIRST / MIDDLE / LAST — then the payload) after a 7-byte file header (":W&B", 0xBEE1, version), each
record a `wandb_internal_pb2.Record` protobuf. The SDK no longer ships a Python reader of it, so `records` below
reads it with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import struct

import pytest

from andrea.control.observe.wandb_log import Rows
from andrea.rundir.ledger import history, marker, read_ledger
from tests.runs import seed_data, train

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

QUIET = [a for k in ("loss_sigmas", "loss_margin", "grad_sigmas", "grad_margin") for a in ("--set", f"guard.{k}=1e9")]
FLAGS = ["--checkpoint-every", "20", "--set", "train.eval_every=20", "--set", "log.wandb=true",
         "--set", "guard.confirm_steps=10", *QUIET]
# Offline as a cluster without internet sets it: in W&B's own environment, which run.toml's empty
# log.wandb_mode leaves in force (issue 46; control/observe/wandb_log.py init_settings). Online, these runs would find no
# server and leave no offline files.
OFFLINE = {"WANDB_MODE": "offline"}


def records(path):
    """The protobuf records of one .wandb file, in order (module docstring)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            yield record


def offline_runs(run_dir):
    """[(run id, start time, [history rows])] of every process's offline run, in start order."""
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, start, rows = None, None, []
        for r in records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id, start = r.run.run_id, r.run.start_time.ToMicroseconds()
            elif kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        out.append((run_id, start, rows))
    return sorted(out, key=lambda run: run[1])


def entry(step, loss=1.0):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8 * step, "time": float(step)}


def test_a_step_is_released_once_nothing_can_supersede_it_and_its_markers_have_come():
    rows = Rows(logged_through=-1, log_every=10)
    rows.add([marker("start", 0)] + [entry(s) for s in range(1, 21)])
    assert [s for s, _ in rows.settle(20)] == list(range(1, 20))  # 20's eval may still come
    rows.add([marker("eval", 20, val_loss=3.5, arms={"a": 3.5}),
              marker("tasks", 20, acc=0.5, acc_norm=0.75, acc_norm_chars=0.7, examples=4, tasks="t.jsonl"),
              entry(21)])
    released = dict(rows.settle(20))
    assert list(released) == [20] and released[20]["val/loss"] == 3.5 and released[20]["val/a"] == 3.5
    assert (released[20]["tasks/acc"], released[20]["tasks/acc_norm"]) == (0.5, 0.75)
    assert rows.settle(21, final=True)[0][0] == 21  # the process ends: nothing more comes at 21


def test_a_rollback_or_resume_drops_what_it_supersedes_before_it_is_released():
    rows = Rows(logged_through=-1, log_every=10)
    rows.add([entry(s, loss=1.0) for s in range(1, 31)])
    assert [s for s, _ in rows.settle(10)] == list(range(1, 11))
    rows.add([marker("incident", 27, loss=9.0), marker("rollback", 20, **{"from": 27})]
             + [entry(s, loss=2.0) for s in range(21, 26)])
    released = dict(rows.settle(25, final=True))
    assert list(released) == list(range(11, 26))
    assert all(released[s]["train/loss"] == (1.0 if s <= 20 else 2.0) for s in released)
    # the incident and the rollback go with the first step the rollback trained (27 is superseded)
    assert (released[21]["event/rollback"], released[21]["event/rollback_from"]) == (20, 27)
    assert released[21]["event/incident"] == 27 and released[21]["event/incident_loss"] == 9.0


def test_a_restart_backfills_after_what_was_logged_and_says_when_it_resumed_below_it():
    earlier = [marker("start", 0)] + [entry(s) for s in range(1, 13)] + [marker("resume", 5)] + \
        [entry(s) for s in range(6, 31)]
    rows = Rows(logged_through=20, log_every=10)
    rows.add(earlier, live=False)
    assert sorted(rows.rows) == list(range(21, 31)) and rows.carry == {}  # history's markers are not re-sent
    assert rows.rewound_below is None
    rows.add([marker("resume", 20), entry(21, loss=2.0)])  # the usual restart, at the step last logged
    assert rows.rows == {21: rows.rows[21]} and rows.rows[21]["train/loss"] == 2.0  # 21..30 were superseded
    assert rows.rows[21]["event/resume"] == 20 and rows.rewound_below is None
    rows.add([marker("resume", 15)])  # a checkpoint newer than 15 failed verification: W&B holds 16..20
    assert rows.rewound_below == (20, 15) and not rows.rows


def test_the_offline_run_equals_the_ledgers_history_through_a_rollback_and_a_resume(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    # Step 45's record reads NaN: an incident, and a rollback to the known-good checkpoint (20: 40 is not yet
    # confirmed, 10 steps after it), superseding steps 21..45 in the ledger.
    first = train(run, "--steps", "60", *FLAGS, extra_env={**OFFLINE, "ANDREA_TEST_POISON_STEPS": "45"})
    assert first.returncode == 0, first.stderr
    # The newest checkpoint lost, as after a crash mid-commit: the next start resumes from 40 and supersedes
    # 41..60; its lower lr makes the steps it runs again differ from the superseded ones.
    for leftover in run.glob("step_000060.*"):
        leftover.unlink()
    second = train(run, "--steps", "80", *FLAGS, "--set", "train.lr=0.001", extra_env=OFFLINE)
    assert second.returncode == 0, second.stderr

    entries = read_ledger(run / ".loss.json").entries
    rollback = next(e for e in entries if e.get("event") == "rollback")
    assert (rollback["step"], rollback["from"]) == (20, 45)
    assert [e["step"] for e in entries if e.get("event") == "resume"] == [40]
    effective = {e["step"]: e for e in history(entries)}
    superseded = [e for e in entries if "event" not in e and e is not effective.get(e["step"])]
    assert {e["step"] for e in superseded} >= set(range(21, 45)) | set(range(41, 61))

    runs = offline_runs(run)
    state = json.loads((run / ".wandb.json").read_text())
    assert len(runs) == 2 and {run_id for run_id, _, _ in runs} == {state["id"]}  # one W&B run, two processes
    rows = [row for _, _, rs in runs for row in rs]
    steps = [row["_step"] for row in rows]
    # Never a step twice, never out of order, none missing up to the newest settled one; the guard's tentative
    # tail after the last confirmed checkpoint (70 is not confirmed by 80) waits for a later start.
    assert steps == list(range(1, state["logged_through"] + 1))
    assert state["logged_through"] == 60
    for row in rows:  # the ledger's own numbers, the superseded ones nowhere
        e = effective[row["_step"]]
        assert (row["train/loss"], row["train/lr"], row["train/grad_norm"]) == (e["loss"], e["lr"], e["grad_norm"])
    evals = {e["step"]: e["val_loss"] for e in entries if e.get("event") == "eval" and e["step"] <= 60}
    last_eval = {}
    for e in entries:  # the eval that survives at each step: the last one written (the rerun's)
        if e.get("event") == "eval" and e["step"] in evals:
            last_eval[e["step"]] = e["val_loss"]
    assert {row["_step"]: row["val/loss"] for row in rows if "val/loss" in row} == last_eval
    marked = {k: row[k] for row in rows for k in row if k.startswith("event/")}
    assert marked["event/rollback"] == 20 and marked["event/rollback_from"] == 45
    assert marked["event/incident"] == 45 and marked["event/resume"] == 40 and marked["event/start"] == 0
    assert {row["_step"] for row in rows if "checkpoint/commit_s" in row} == {20, 40, 60}
    # A CPU has no peak: no MFU anywhere, and the start marker says why
    assert not any("mfu" in e for e in entries) and not any("train/mfu" in row for row in rows)
    assert next(e for e in entries if e.get("event") == "start")["peak"].startswith("cpu: no peak")


def view_config(**kw):
    from andrea.config.outputs import LogConfig
    return LogConfig(wandb=True, wandb_timeout_s=kw.pop("timeout", 5.0), **kw)


def test_without_the_sdk_the_run_goes_on_with_one_line(tmp_path, monkeypatch, caplog):
    from andrea.control.observe.wandb_log import WandbLog
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # `import wandb` raises ImportError
    view = WandbLog(view_config(), tmp_path, {}, log_every=10)
    view.add_records([marker("start", 0)] + [entry(s) for s in range(1, 12)])
    for step in (5, 10):
        view.settle(step)
    view.close(10)
    said = [r.getMessage() for r in caplog.records if r.name == "andrea.wandb"]
    assert len(said) == 1 and "pip install -e '.[wandb]'" in said[0]
    assert not (tmp_path / ".wandb.json").exists()
    assert not view.rows.rows  # nothing held for a W&B that will not come


def test_rows_held_for_an_unreachable_wandb_are_bounded_and_left_to_the_next_start(tmp_path, monkeypatch, caplog):
    from andrea.control.observe.wandb_log import WandbLog
    monkeypatch.setattr(WandbLog, "MAX_PENDING", 5)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    view = WandbLog(view_config(wandb_mode="online", timeout=3.0), tmp_path, {}, log_every=10)
    view.add_records([entry(s) for s in range(1, 12)])  # 11 rows held: past the bound
    view.settle(10)
    view.add_records([entry(s) for s in range(12, 40)])
    view.settle(30)
    view.close(30)
    said = [r.getMessage() for r in caplog.records if r.name == "andrea.wandb"]
    assert len(said) == 1 and "11 steps" in said[0] and "next start" in said[0], said
    assert not view.rows.rows and view.rows.logged == -1  # nothing held, nothing claimed as sent
    assert not (tmp_path / ".wandb.json").exists()  # the next start backfills every step from the ledger


def test_an_unreachable_server_costs_no_step_and_the_rows_wait(tmp_path, monkeypatch, caplog):
    """Online mode against a port nothing listens on: the rows stay queued, none is claimed as logged, and `close`
    gives up after log.wandb_timeout_s (its join is bounded: a hang would fail the generous bound below)."""
    import time

    from andrea.control.observe.wandb_log import WandbLog
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    view = WandbLog(view_config(wandb_mode="online", timeout=3.0), tmp_path, {}, log_every=10)
    view.add_records([entry(s) for s in range(1, 12)])
    t0 = time.monotonic()
    view.settle(10)
    view.close(10)
    assert time.monotonic() - t0 < 60
    assert view.rows.logged == -1 and sorted(view.rows.rows) == list(range(1, 12))  # nothing claimed as sent
    assert any("W&B" in r.getMessage() for r in caplog.records if r.name == "andrea.wandb")
