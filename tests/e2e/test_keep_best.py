"""checkpoint.keep_best in a real trainer process (tiny preset): the checkpoint with the best held-out loss of the
run's effective timeline survives keep_last = 1, across a resume (the held-out history is seeded from the ledger)
and while the next process only gets worse (lr = 1.0 without clipping or the guard: issue #11's divergence). It
asserts what holds on any course: the checkpoints left are the newest and the best of the ledger's evals."""

from __future__ import annotations

from andrea.rundir.ledger import live_markers
from tests.runs import ledger, seed_data, train

KEEP = ["--checkpoint-every", "10", "--set", "train.eval_every=10", "--set", "checkpoint.keep_last=1",
        "--set", "checkpoint.keep_every=0", "--set", "checkpoint.keep_best=1",
        "--set", "guard.enabled=false"]  # no known-good or tentative point besides: keep_best alone spares
WORSE = ["--set", "train.lr=1.0", "--set", "train.grad_clip=0"]


def test_keep_best_keeps_the_best_held_out_checkpoint_across_a_resume(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", "20", *KEEP)
    assert r.returncode == 0, r.stderr[-4000:]
    r = train(run, "--steps", "40", *KEEP, *WORSE)
    assert r.returncode == 0, r.stderr[-4000:]
    evals = {e["step"]: e["val_loss"] for e in live_markers(ledger(run), "eval")}
    assert sorted(evals) == [10, 20, 30, 40]
    best = min(evals, key=lambda s: (evals[s], s))
    on_disk = sorted(int(p.name[5:11]) for p in run.glob("step_*.bin"))
    assert on_disk == sorted({best, 40}), (evals, on_disk)
