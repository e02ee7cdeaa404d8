"""The held-out history's two readers in real trainer processes (tiny preset): `checkpoint.keep_best` and the
`plateau` notice. The first process trains healthily; the second (a resume) only gets worse: lr = 1.0 without
clipping or the guard (issue #11's divergence). The history is seeded from the ledger at the resume, so the first
process's best still counts. It asserts what holds on any course: the checkpoints left are the newest and the best
of the ledger's evals, and a plateau marker (and notice) follows each eval that brings no new best (N = 1)."""

from __future__ import annotations

from andrea.rundir.ledger import live_markers
from tests.notices import Inbox
from tests.runs import ledger, seed_data, train

KEEP = ["--checkpoint-every", "10", "--set", "train.eval_every=10", "--set", "checkpoint.keep_last=1",
        "--set", "checkpoint.keep_every=0", "--set", "checkpoint.keep_best=1",
        "--set", "guard.enabled=false"]  # no known-good or tentative point besides: keep_best alone spares
WORSE = ["--set", "train.lr=1.0", "--set", "train.grad_clip=0"]


def test_keep_best_and_the_plateau_notice_read_the_effective_held_out_history_across_a_resume(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", "20", *KEEP)
    assert r.returncode == 0, r.stderr[-4000:]
    inbox = Inbox()
    try:
        r = train(run, "--steps", "40", *KEEP, *WORSE, "--set", "notify.plateau_evals=1",
                  "--set", f'notify.url="{inbox.url}"')
        assert r.returncode == 0, r.stderr[-4000:]
        evals = {e["step"]: e["val_loss"] for e in live_markers(ledger(run), "eval")}
        assert sorted(evals) == [10, 20, 30, 40]
        best = min(evals, key=lambda s: (evals[s], s))
        on_disk = sorted(int(p.name[5:11]) for p in run.glob("step_*.bin"))
        assert on_disk == sorted({best, 40}), (evals, on_disk)
        # N = 1: every eval of the second process that is no new best (no lower than every earlier one) is a plateau
        flat = [s for s in (30, 40) if evals[s] >= min(evals[t] for t in evals if t < s)]
        plateaus = [e for e in ledger(run) if e.get("event") == "plateau"]
        assert [e["step"] for e in plateaus] == flat, (evals, plateaus)
        assert all(e["best_step"] == min((t for t in evals if t < e["step"]), key=lambda t: (evals[t], t))
                   for e in plateaus)
        inbox.wait_until(lambda box: [e["step"] for e in box.events if e["event"] == "plateau"] == flat, 30)
    finally:
        inbox.close()
