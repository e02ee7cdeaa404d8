"""control/observe/status_view.py: `andrea status`'s human view and the pace it reads, over plain reports."""

from __future__ import annotations

from andrea.control.observe import status_view


def steps(times: list[float], first: int = 1) -> list[dict]:
    return [{"step": first + i, "loss": 5.0 - i / 100, "tokens": (first + i) * 512, "time": t}
            for i, t in enumerate(times)]


def test_pace_is_the_median_interval_so_a_checkpoint_or_restart_gap_is_not_the_pace():
    times = [1000.0 + 2 * i for i in range(20)]
    times[10:] = [t + 600 for t in times[10:]]  # a restart ten minutes long between steps 10 and 11
    p = status_view.pace(steps(times), target=119)
    assert p["seconds_per_step"] == 2.0 and p["eta_s"] == (119 - 20) * 2.0
    assert p["loss"] == 5.0 - 19 / 100 and p["tokens"] == 20 * 512 and p["target_step"] == 119
    assert p["elapsed_s"] == times[-1] - times[0]
    assert status_view.pace([], 10) is None
    assert status_view.pace(steps([5.0]), None)["eta_s"] is None  # one entry: no interval, no pace


REPORT = {"run_dir": "runs/x", "state": "training", "running": True, "pid": 4242, "step": 1500,
          "newest_checkpoint": "step_001500.bin", "not_whole": [], "loss_ema": 3.21,
          "val_loss": 3.4, "val_step": 1000, "phase": 0,
          "pace": {"loss": 3.1, "tokens": 6_144_000, "target_step": 3000, "seconds_per_step": 0.5,
                   "elapsed_s": 800.0, "eta_s": 90_061.0},
          "mfu": {"value": 0.412}, "guard": {"rollbacks": 1},
          "incidents": {"quarantine": None, "incident": {"event": "incident", "step": 1200, "reason": "loss spike",
                                                         "time": 50.0},
                        "replica_down": {"event": "replica_down", "step": 900, "time": 40.0}},
          "replica": {"uri": "s3://b/x", "step": 1400, "lag_steps": 100, "error": None}}


def test_the_view_says_each_figure_an_operator_watches_for_in_a_dozen_lines():
    lines = status_view.view(REPORT)
    text = "\n".join(lines)
    assert lines[0] == "runs/x: training (running, pid 4242)"
    assert "step      1,500 of 3,000 (50.0 %)" in lines
    assert "loss      3.1000 last, 3.2100 EMA, 3.4000 held-out (step 1,000)" in lines
    assert "pace      0.5 s/step, MFU 41.2 %, 6,144,000 tokens seen" in lines
    assert "time      00:13:20 since the first step, 1d 01:01:01 to the target at this pace" in lines
    assert "saved     step_001500.bin" in lines
    assert "replica   s3://b/x: step 1400, 100 steps behind" in lines
    assert "incident  incident at step 1,200: loss spike (1 rollbacks in all)" in lines  # the newest by time
    assert len(lines) <= 12 and "{" not in text
    cpu = {"value": None, "peak": "cpu: no peak to measure against (set train.peak_tflops)"}  # mfu.py's reason
    assert "pace      0.5 s/step, MFU not measured (set train.peak_tflops), 6,144,000 tokens seen" in \
        status_view.view({**REPORT, "mfu": cpu})  # said, not silently left out
    done = status_view.view({**REPORT, "step": 3000, "pace": {**REPORT["pace"], "eta_s": 0.0}})
    assert "time      00:13:20 since the first step, at its target (`--steps N` trains further)" in done


def test_the_view_of_a_run_before_its_first_step_says_so():
    lines = status_view.view({"run_dir": "runs/y", "state": "prepared", "running": False, "pid": None, "step": None,
                              "newest_checkpoint": None, "not_whole": [], "incidents": {}, "replica": None})
    assert lines[:3] == ["runs/y: prepared (not running)", "no training step yet", "saved     no checkpoint yet"]
