"""`log.tensorboard = true`: RUN_DIR/tb/ holds the ledger's records as scalars, superseded points hidden on resume."""

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from andrea.rundir.ledger import history, read_ledger
from tests.runs import seed_data, train

# The guard off: the rerun's lower lr moves the gradient norm, and whether the guard then gates step 40 depends on
# the trajectory (the CPU, the data); this test is about what reaches TensorBoard, not about the guard.
# A peak of 0.01 TFLOP/s per device (train.peak_tflops): MFU on a CPU, which has none of its own.
FLAGS = ["--checkpoint-every", "20", "--set", "log.tensorboard=true", "--set", "train.eval_every=20",
         "--set", "guard.enabled=false", "--set", "train.peak_tflops=0.01"]


def scalars(run) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert steps == sorted(set(steps)), f"{tag}: duplicate or unordered steps {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def test_tensorboard_scalars_equal_the_ledger_across_a_resume(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    assert train(run, "--steps", "40", *FLAGS).returncode == 0
    # The newest checkpoint is lost (as after a crash mid-commit): the next start resumes from step 20 and
    # supersedes steps 21..40. A different lr makes the rerun's values differ from the superseded ones.
    (run / "step_000040.bin").unlink()
    (run / "step_000040.state.json").unlink()
    resumed = train(run, "--steps", "60", *FLAGS, "--set", "train.lr=0.001")
    assert resumed.returncode == 0, resumed.stderr

    entries = read_ledger(run / ".loss.json").entries
    steps = history(entries)
    resume = next(i for i, e in enumerate(entries) if e.get("event") == "resume")
    assert entries[resume]["step"] == 20
    first_run = {e["step"]: e["loss"] for e in entries[:resume] if "event" not in e}
    assert any(first_run[e["step"]] != e["loss"] for e in steps if 20 < e["step"] <= 40)  # really superseded
    tb = scalars(run)
    arms = ["stdlib-docstrings", "stdlib-code", "pydoc-topics"]
    expected_tags = {"train/loss", "train/lr", "train/grad_norm", "train/mfu", "train/tokens_per_s", "val/loss",
                     "val/target_loss", "checkpoint/stall_s", "checkpoint/commit_s"}
    expected_tags |= {f"val/{a}" for a in arms} | {f"data/share/{a}" for a in arms}
    assert set(tb) == expected_tags

    for key in ("loss", "lr", "grad_norm"):  # TensorBoard stores float32: the ledger's values, rounded once
        assert tb[f"train/{key}"] == {e["step"]: float(np.float32(e[key])) for e in steps}
    last_eval = {e["step"]: e for e in entries if e.get("event") == "eval"}  # the rerun's eval at 40 wins
    assert sorted(last_eval) == [20, 40, 60]
    assert tb["val/loss"] == {s: float(np.float32(e["val_loss"])) for s, e in last_eval.items()}
    assert tb["val/target_loss"] == {s: float(np.float32(e["target_loss"])) for s, e in last_eval.items()}
    for a in arms:
        assert tb[f"val/{a}"] == {s: float(np.float32(e["arms"][a])) for s, e in last_eval.items()}
    assert set(tb["checkpoint/commit_s"]) == set(tb["data/share/stdlib-code"]) == {20, 40, 60}
    assert all(v > 0 for v in tb["checkpoint/commit_s"].values())
    assert abs(sum(tb[f"data/share/{a}"][60] for a in arms) - 1) < 1e-6
    assert tb["train/tokens_per_s"] and all(v > 0 for v in tb["train/tokens_per_s"].values())
    # MFU: in every step entry once a process has two steps to measure over, against the configured peak
    assert tb["train/mfu"] == {e["step"]: float(np.float32(e["mfu"])) for e in steps if "mfu" in e}
    assert {e["step"] for e in steps if "mfu" not in e} == {1, 21}  # each process's first step
    starts = [e for e in entries if e.get("event") in ("start", "resume")]
    assert [e["peak"] for e in starts] == ["train.peak_tflops=0.01 x 1"] * 2 and starts[0]["peak_flops"] == 1e10
    assert all(0 < e["mfu"] < 10 for e in steps if "mfu" in e)
    assert set(tb["train/tokens_per_s"]) <= set(range(10, 61, 10))


def test_a_rollback_marker_hides_the_steps_it_supersedes(tmp_path):
    from andrea.control.observe.tensorboard import TensorBoardLog
    from andrea.rundir.ledger import marker

    def entry(step, loss):
        return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512 * step, "time": step / 10}

    tb = TensorBoardLog(tmp_path, 0, flush_secs=30.0, log_every=10)
    tb.add_records([marker("start", 0)] + [entry(s, 5.0) for s in range(1, 31)])
    tb.add_records([marker("rollback", 20, **{"from": 30})] + [entry(s, 4.0) for s in range(21, 41)])
    tb.close()
    assert not tb.failed
    loss = scalars(tmp_path)["train/loss"]
    assert loss == {s: 5.0 if s <= 20 else 4.0 for s in range(1, 41)}
