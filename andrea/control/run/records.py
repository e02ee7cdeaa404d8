"""Per-step scalars from the device to the host without a sync: a ring of (pinned) host slots.

The training thread never calls `.item()`: after each update `push` stacks [loss, grad_norm, seq_losses...]
on the device and starts a non-blocking copy into a host slot, fenced by a blocking CUDA event recorded on the
stream that runs the copy (`copy_to_host`; on CPU the copy is immediate). The control plane `pop_ready`s
finished slots between steps and turns them into ledger lines and bandit observations. Only when the device
runs `capacity` steps ahead of the host does `make_room` wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from andrea.control.run.trainer import StepOutput


@dataclass
class StepRecord:
    step: int
    lr: float
    loss: float
    grad_norm: float
    seq_losses: np.ndarray  # (B,) float64


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
    """Start the copy of the CUDA tensor `src` into the pinned host tensor `dst`; return the event that fences it.

    copy_ runs on the current stream of src's device, whichever device is current on the calling thread, so the
    event is recorded on that stream, named: an event recorded with no stream lands on the current device's
    stream, and on a thread left on device 0 (rank r > 0) it could complete before the copy on device r has.
    A blocking event: a host that waits on it (pop_ready, the end of a run) sleeps instead of spinning a core.
    """
    stream = torch.cuda.current_stream(src.device)
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


class StepRecords:
    def __init__(self, capacity: int, batch_size: int, device: torch.device):
        pinned = device.type == "cuda"
        self.host = torch.zeros(capacity, 2 + batch_size, dtype=torch.float32, pin_memory=pinned)
        self.pending: list[tuple[int, int, float, torch.cuda.Event | None]] = []  # (slot, step, lr, event)
        self.capacity = capacity
        self._next = 0
        self._lock = threading.Lock()

    def push(self, out: StepOutput) -> None:
        """Training thread: start the copy of one step's scalars. The caller ensured a free slot."""
        assert len(self.pending) < self.capacity, "make_room() must run before push()"
        slot = self._next
        self._next = (self._next + 1) % self.capacity
        row = torch.cat([out.loss.float().view(1), out.grad_norm.float().view(1), out.seq_losses.float()])
        event = None
        if row.is_cuda:
            event = copy_to_host(self.host[slot], row)
        else:
            self.host[slot].copy_(row)
        with self._lock:
            self.pending.append((slot, out.step, out.lr, event))

    def pop_ready(self, wait_until_step: int | None = None) -> list[StepRecord]:
        """Finished records in step order; waits for those at or below `wait_until_step`.

        Safe while the training thread pushes: the lock guards `pending`, never held across a wait.
        """
        ready = []
        while True:
            with self._lock:
                if not self.pending:
                    return ready
                slot, step, lr, event = self.pending[0]
                if event is None or event.query():
                    row = self.host[slot].numpy().astype(np.float64)
                    ready.append(StepRecord(step, lr, float(row[0]), float(row[1]), row[2:].copy()))
                    self.pending.pop(0)
                    continue
            if wait_until_step is None or step > wait_until_step:
                return ready
            event.synchronize()

    def make_room(self) -> list[StepRecord]:
        """Before a push: if every slot is in flight, wait for the oldest (the device is far ahead)."""
        if len(self.pending) < self.capacity:
            return []
        return self.pop_ready(wait_until_step=self.pending[0][1])
