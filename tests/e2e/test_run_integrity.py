"""The rest of the run directory, checked rather than trusted: the ledger against what the checkpoints recorded,
the run's identity against its first start, start-up touching only andrea's own leftovers, a ledger fsync error
treated as a loss, and `ctl stop` idempotent with every failure one line.

The process tests use one tiny run trained to step 40 (checkpoints at 20 and 40), copied per case.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from andrea import cli
from andrea.commands.operate import process_state
from andrea.control.run import resume
from andrea.rundir import checkpoint as ckpt, ledger as L, names
from tests.runs import ROOT, env, header, seed_data, train, wait_until


def entry(step):
    return {"step": step, "loss": 1.0}


def test_an_fsync_error_on_the_ledger_is_a_loss_and_the_lines_are_written_again(tmp_path, monkeypatch):
    path = tmp_path / names.LEDGER_NAME
    led = L.LossLedger(path)
    led.append([entry(1)])
    led.sync()
    durable = path.stat().st_size
    led.append([entry(2), entry(3)])
    expected = path.read_bytes()

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(L.os, "fsync", eio)
    with pytest.raises(OSError):
        led.sync()  # what a checkpoint's commit calls first: it fails, nothing commits on these lines
    # After a write-back error the kernel may have dropped the pages: the disk holds what it held before.
    with open(path, "r+b") as f:
        f.seek(durable)
        f.write(b"\0" * (len(expected) - durable))
    monkeypatch.undo()
    led.sync()
    led.close()
    assert path.read_bytes() == expected
    assert [e["step"] for e in L.read_ledger(path).entries] == [1, 2, 3]


def test_start_up_removes_only_andreas_own_temporary_files(tmp_path):
    (tmp_path / names.DATA_DIR).mkdir()
    own = [tmp_path / "step_000100.bin.tmp", tmp_path / "step_000100.state.json.tmp", tmp_path / ".state.json.tmp",
           tmp_path / "run.toml.tmp", tmp_path / "data" / "manifest.json.tmp", tmp_path / "data" / "prose.plan.json.tmp"]
    users = [tmp_path / "notes.tmp", tmp_path / "data" / "mine.tmp", tmp_path / "step_000100.bin.tmp.keep"]
    for p in own + users:
        p.write_text("x")
    (tmp_path / "step_000250.bin.tmp").mkdir()  # not a file: not andrea's
    removed = ckpt.remove_stale_tmp(tmp_path)
    assert sorted(removed) == sorted(own)
    assert all(p.exists() for p in users) and (tmp_path / "step_000250.bin.tmp").is_dir()


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    run = seed_data(prepared, tmp_path_factory.mktemp("trained") / "run")
    result = train(run, "--steps", "40", "--checkpoint-every", "20")
    assert result.returncode == 0, result.stderr
    return run


def copy_of(trained, tmp_path, name="run"):
    return shutil.copytree(trained, tmp_path / name)


def next_start_markers(run) -> list[dict]:
    """What the ledger check every start runs first (control/run/resume.py) does on the next start from the newest
    checkpoint: raises LedgerError for a refusal, returns the markers it would append ([]: a clean start)."""
    step, path = ckpt.list_checkpoints(run)[-1]
    return resume.check_ledger(run, ckpt.CheckpointInfo(path, step, header(path)[1]), accept_gap=False)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("andrea: error:")]


def test_another_runs_checkpoint_copied_in_is_refused_by_train_verify_and_accept_ledger_gap(trained, prepared,
                                                                                            tmp_path):
    """Issue 55, hole 3: another seed's complete step_000050.* set copied into a run whose newest is 40. Its
    `.bin`, checksum and ledger record agree with each other, so `verify` said ok, `train` blamed `.loss.json`
    ("cut short", try --accept-ledger-gap) and the flag then resumed from the foreign weights. Its checksum names
    its run: every reader says it is another run's, and every start (with the flag too) sets it aside and resumes
    from 40, as if it had never been copied in."""
    other = seed_data(prepared, tmp_path / "other")
    assert train(other, "--steps", "50", "--checkpoint-every", "50", "--seed", "7").returncode == 0
    reference = copy_of(trained, tmp_path, "reference")
    assert train(reference, "--steps", "60").returncode == 0
    for flags in ((), ("--accept-ledger-gap",)):
        run = copy_of(trained, tmp_path, f"run{len(flags)}")
        for f in other.glob("step_000050.*"):
            shutil.copy(f, run / f.name)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            assert cli.main(["verify", str(run)]) == 1
        [bad] = [line for line in out.getvalue().splitlines() if line.startswith("bad ")]
        assert "step_000050.bin" in bad and "another run's checkpoint" in bad and "--init-from" in bad
        r = train(run, "--steps", "60", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        said = [line for line in r.stderr.splitlines() if "step_000050.bin" in line]
        assert any("another run's checkpoint" in line for line in said), r.stderr[-3000:]
        assert not any("cut short" in line or "--accept-ledger-gap" in line for line in said)
        assert (run / names.QUARANTINE_DIR / "step_000050.bin").exists()
        markers = [e for e in L.read_ledger(run / names.LEDGER_NAME).entries if "event" in e]
        assert [m["from"] for m in markers if m["event"] == "resume"][-1] == "step_000040.bin"
        assert not [m for m in markers if m["event"] == "gap"]
        assert (run / "step_000060.bin").read_bytes() == (reference / "step_000060.bin").read_bytes()


@pytest.mark.parametrize("damage", ["cut", "cut mid-line", "garbage"])
def test_a_damaged_ledger_is_refused_untouched_then_continued_past_with_a_gap_marker(trained, tmp_path, damage):
    run = copy_of(trained, tmp_path)
    ledger = run / names.LEDGER_NAME
    lines = ledger.read_bytes().split(b"\n")
    if damage == "cut":
        ledger.write_bytes(b"\n".join(lines[:12]) + b"\n")
    elif damage == "cut mid-line":  # looks like a crash's torn tail, but the checkpoint vouches for more
        ledger.write_bytes(b"\n".join(lines[:12]) + b"\n" + lines[12][:20])
    else:
        lines[15] = b"\0" * len(lines[15])  # what a crashed filesystem leaves
        ledger.write_bytes(b"\n".join(lines))
    before = ledger.read_bytes()
    refused = train(run, "--steps", "60")
    [line] = error_lines(refused)
    assert refused.returncode == 1 and str(ledger) in line and "--accept-ledger-gap" in line
    assert ("cut short" in line) == (damage != "garbage")
    assert ledger.read_bytes() == before  # a refused start changed nothing
    if damage == "garbage":
        assert cli.main(["status", str(run)]) == 1  # every reader agrees: damaged until accepted
    accepted = train(run, "--steps", "60", "--accept-ledger-gap")
    assert accepted.returncode == 0, accepted.stderr
    entries = L.read_ledger(ledger).entries  # every reader reads it again
    [gap] = [e for e in entries if e.get("event") == "gap"]
    assert gap["step"] == 40 and (gap["unreadable_lines"] == [16]) == (damage == "garbage")
    assert L.history(entries)[-1]["step"] == 60
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["status", str(run)]) == 0
    assert next_start_markers(run) == []  # and the next start is clean: nothing refused, nothing to mark
    if damage == "garbage":  # the one with an unreadable line that every reader must skip: a real next start
        assert train(run, "--steps", "80").returncode == 0


@pytest.mark.parametrize("flip", ["breaks its line", "changes its identity"])
def test_a_bit_flipped_in_the_start_marker_keeps_the_runs_id_and_identity_past_the_gap(trained, tmp_path, flip):
    """Campaign seed 201: a bit flipped in the ledger's start marker, inside the history the newest checkpoint
    vouches for. Where it broke the line (`:` to `;`), `--accept-ledger-gap` went on, but the checkpoints written from
    there named no run (the id was the unreadable marker's), and after a `restore` the run was refused by its own
    replica as another run. Where the line still parsed (`2` to `6`: model.n_layer), the start with the flag refused
    the run's own configuration as a change of model.n_layer. Now the run keeps the id its checkpoint vouches for,
    and a changed ledger's start marker is no evidence of the identity: run.toml's is, and every later start
    (the `gap` marker on the record) agrees."""
    run = copy_of(trained, tmp_path)
    ledger = run / names.LEDGER_NAME
    data = bytearray(ledger.read_bytes())
    at = data.index(b'"model.n_layer":2') + len(b'"model.n_layer"') + (0 if flip == "breaks its line" else 1)
    data[at] ^= 0b1 if flip == "breaks its line" else 0b100  # 0x3a ':' -> 0x3b ';', 0x32 '2' -> 0x36 '6'
    ledger.write_bytes(bytes(data))
    run_id = json.loads((run / "step_000040.sum.json").read_text())["run"]
    refused = train(run, "--steps", "60")
    [line] = error_lines(refused)
    assert refused.returncode == 1 and "changed inside the history" in line and "--accept-ledger-gap" in line
    accepted = train(run, "--steps", "60", "--accept-ledger-gap")
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert json.loads((run / "step_000060.sum.json").read_text())["run"] == run_id
    assert json.loads((run / "step_000060.ledger.json").read_text())["run"] == run_id
    again = train(run, "--steps", "80")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / "step_000080.sum.json").read_text())["run"] == run_id
    changed = train(run, "--steps", "100", "--set", "model.n_layer=3")  # a real change is still refused
    assert changed.returncode == 2 and "model.n_layer from 2 to 3" in error_lines(changed)[0]


def test_junk_after_the_last_checkpoint_is_cut_in_one_line_and_never_vouched_for(trained, tmp_path):
    run, junk = copy_of(trained, tmp_path), b"\0" * 64 + b"\n"  # a crash's NUL-filled line (`echo junk >>`: unit)
    ledger = run / names.LEDGER_NAME
    with open(ledger, "ab") as f:
        f.write(junk)
    result = train(run, "--steps", "60")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "no ledger entries" in line]
    assert len(said) == 1 and "step_000040.bin" in said[0] and not error_lines(result)
    entries = L.read_ledger(ledger).entries  # every reader reads it, and step_000060 vouches for no junk
    assert [e["event"] for e in entries if e.get("event") == "cut_tail"] == ["cut_tail"]
    assert L.history(entries)[-1]["step"] == 60 and junk not in ledger.read_bytes()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["status", str(run)]) == 0


def test_accept_ledger_gap_unblocks_every_reader_of_junk_a_checkpoint_vouched_for(trained, tmp_path):
    run = copy_of(trained, tmp_path)
    ledger = run / names.LEDGER_NAME
    with open(ledger, "ab") as f:  # what the old start kept, and step 40 then vouched for
        f.write(b"junk\n")
    led = L.LossLedger(ledger)
    seal = led.seal()
    names.companion_path(run, 40, "ledger").write_bytes(led.record_bytes())
    led.close()
    recorded = json.loads(names.companion_path(run, 40, "sum").read_text())
    names.companion_path(run, 40, "sum").write_text(json.dumps({**recorded, "ledger": seal["xxh3_128"]}))
    # Refused by the ledger check a start runs first (a real refused start, its one line and exit 1, and nothing
    # written: the damaged-ledger test above)
    with pytest.raises(L.LedgerError) as refused:
        next_start_markers(run)
    assert "vouches for it" in str(refused.value) and "--accept-ledger-gap" in str(refused.value)
    accepted = train(run, "--steps", "60", "--accept-ledger-gap")
    assert accepted.returncode == 0, accepted.stderr
    [gap] = [e for e in L.read_ledger(ledger).entries if e.get("event") == "gap"]
    assert gap["step"] == 40 and len(gap["unreadable_lines"]) == 1
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["status", str(run)]) == 0


def test_a_torn_tail_after_the_last_checkpoint_is_still_silent_and_harmless(trained, tmp_path):
    run = copy_of(trained, tmp_path)
    with open(run / names.LEDGER_NAME, "ab") as f:
        f.write(b'{"step": 41, "lo')
    result = train(run, "--steps", "60")
    assert result.returncode == 0 and not error_lines(result), result.stderr


@pytest.mark.parametrize("change, field", [(("--set", "model.n_head=4"), "model.n_head from 2 to 4"),
                                           (("--seed", "7"), "train.seed from 1337 to 7"),
                                           (("--set", "train.optimizer=muon"),
                                            "train.optimizer from 'adamw' to 'muon'")])
def test_a_resume_that_would_change_the_runs_identity_is_refused_naming_the_field(trained, tmp_path, change, field):
    run = copy_of(trained, tmp_path)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
    result = train(run, "--steps", "60", *change)
    [line] = error_lines(result)
    assert result.returncode == 2 and field in line, result.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before


def test_a_lost_run_toml_is_refused_and_a_preset_run_toml_overrides_is_said(trained, tmp_path):
    run = copy_of(trained, tmp_path)
    (run / names.CONFIG_NAME).unlink()
    result = train(run, "--steps", "60")
    [line] = error_lines(result)
    assert result.returncode == 2 and "run.toml: missing" in line
    run = copy_of(trained, tmp_path, "again")
    result = subprocess.run([sys.executable, "-m", "andrea", "train", "--preset", "andrea-12m", "--run-dir",
                             str(run), "--steps", "40"], capture_output=True, text=True, env=env(), cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "--preset andrea-12m" in line]
    assert len(said) == 1 and "keeps its own" in said[0] and "model.n_layer" in said[0]
    refused = subprocess.run([sys.executable, "-m", "andrea", "train", "--preset", "andrea-12m", "--run-dir",
                              str(run), "--set", "train.optimizer='muon'"], capture_output=True, text=True, env=env(),
                             cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr  # no note first
    assert "train.optimizer from 'adamw' to 'muon'" in refused.stderr


def test_ctl_stop_is_idempotent_and_a_stopped_trainer_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / names.CONFIG_NAME).write_text("")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ctl", str(run), "stop"]) == 0  # nothing running: already stopped
    assert "already stopped" in out.getvalue()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from andrea.rundir.runlock import RunLock\nRunLock(Path(sys.argv[1])).acquire()\n"
                               "print('ready', flush=True)\ntime.sleep(120)\n", str(run)],
                              stdout=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "ready"
        for bad in ("-1", "nan"):  # refused before any signal: SIGUSR1 would end the holder
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                assert cli.main(["ctl", str(run), "checkpoint", "--timeout", bad]) == 2
            assert err.getvalue().strip().splitlines() == [f"andrea: error: --timeout {bad}: must be >= 0 seconds "
                                                           "(0: do not wait)"]
        assert holder.poll() is None
        os.kill(holder.pid, signal.SIGSTOP)
        # Stopped only once the holder runs to take the signal: a SIGTERM arriving before that is dequeued first
        # (the lower number) and ends it, which is a trainer that stopped, not one that is stopped.
        wait_until(lambda: process_state(holder.pid) == "T", 30, "the holder stopped by SIGSTOP")
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.main(["ctl", str(run), "stop", "--timeout", "1"])
        lines = err.getvalue().splitlines()
        assert code == 1 and len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "SIGSTOP" in lines[0]
    finally:
        holder.kill()
        holder.wait(30)


def test_verify_checks_the_prepared_tokens_and_the_tokenizer_against_the_manifest(trained, tmp_path):
    def verify(run):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["verify", str(run)])
        return code, out.getvalue(), err.getvalue()

    code, out, err = verify(trained)
    token_files = sorted((trained / names.DATA_DIR).glob("*.train.u16"))
    assert code == 0 and token_files and not err
    for f in token_files:
        assert f"ok {f}:" in out
    assert f"ok {trained / names.TOKENIZER_NAME}:" in out
    run = copy_of(trained, tmp_path)
    victim = sorted((run / names.DATA_DIR).glob("*.train.u16"))[0]
    tokens = np.fromfile(victim, dtype="<u2")
    tokens[::32] ^= 1  # every 32nd token another id: same size, valid ids
    tokens.tofile(victim)
    (run / names.TOKENIZER_NAME).write_text((run / names.TOKENIZER_NAME).read_text().replace('"', '"', 1) + " ")
    code, out, err = verify(run)
    assert code == 1
    assert f"bad {victim}: its tokens changed after preparation" in err
    assert f"bad {run / names.TOKENIZER_NAME}: sha256" in err
