"""The task audit (evals/audit.py `TaskAudit`) under the watchdog (control/observe/watchdog.py): an audit that takes longer
than watchdog.floor_s in all, but whose every forward is quick, is a run that is moving, not a hang. The audit runs
as one job of a real WatchedExecutor; each forward costs the watchdog's (fake) clock 6 s against a 10 s floor, and
the watchdog's tracker polls after each."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from andrea.config.load import load
from andrea.evals.audit import TaskAudit
from andrea.control.observe.watchdog import Beats, Tracker, WatchedExecutor, heartbeat

FLOOR = 10.0
FORWARD_S = 6.0  # each forward of the audit, on the watchdog's clock: ten of them take 60 s


class Bytes:
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class ClockedModel(torch.nn.Module):
    """Logits of zeros; each forward moves the fake clock on and lets the watchdog's tracker poll."""

    def __init__(self, beats: Beats, tracker: Tracker, stalls: list):
        super().__init__()
        self.beats, self.tracker, self.stalls, self.now = beats, tracker, stalls, 0.0

    def forward(self, idx):
        self.now += FORWARD_S
        self.stalls += self.tracker.observe(self.now, self.beats.snapshot())
        return torch.zeros(*idx.shape, 256), None  # (B, T, V)


def audit_under_watchdog(tmp_path, beat) -> tuple[list, dict]:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"ctx": f"context {i}", "endings": ["a", "b"], "label": 0}) + "\n"
                            for i in range(10)))
    cfg = load(preset="andrea-tiny", overrides=["eval.batch_rows=2"])  # one example per forward: ten forwards
    audit = TaskAudit(path, Bytes(), cfg)
    beats, stalls = Beats(), []
    tracker = Tracker(FLOOR, factor=2.0, max_tick=1e9)  # the limit: max(10 s, 2 x the slowest wait, 6 s)
    model = ClockedModel(beats, tracker, stalls)
    tracker.observe(0.0, beats.snapshot())
    trainer = SimpleNamespace(model=model, device=torch.device("cpu"), autocast=None)
    pool = WatchedExecutor(beats, "train", thread_name_prefix="test-train")
    try:
        score = pool.submit(lambda: audit(trainer, beat=beat) if beat else audit(trainer)).result(60)
    finally:
        pool.shutdown()
    return stalls, score


def test_a_task_audit_longer_than_the_floor_is_moving_while_each_forward_returns(tmp_path):
    stalls, score = audit_under_watchdog(tmp_path, heartbeat)
    assert stalls == [] and score["examples"] == 10  # 60 s of audit against a 10 s floor: no stall, a score


def test_without_its_heartbeat_the_same_audit_would_be_a_stall(tmp_path):
    """The contrast that shows the fake clock can see a hang: one job of 60 s with no progress inside it."""
    stalls, _ = audit_under_watchdog(tmp_path, None)
    assert stalls and stalls[0].component == "train" and stalls[0].seconds > FLOOR
