"""The code that only runs on CUDA, tested on a CPU: torch.cuda's per-thread state replaced by a fake.

What a GPU would show and the CPU suite cannot (issue #27): CUDA keeps the *current device* per host thread, and a
new thread starts on device 0. Triton's launcher asks torch.cuda.current_device() (and that device's current stream)
at every launch; an event recorded without a stream lands on the current device's current stream; a copy_ runs on
the current stream of its CUDA tensor's device, whatever the thread's current device is. `FakeCuda` keeps exactly
that state (a thread-local current device, one stream per device) and logs who asked what from which thread, so a
rank-1-of-2 process can be played on a CPU: every thread that launches, copies or records must see device 1.

Also here: the blocking events used as fences (a waiting host sleeps instead of spinning a core), the sharded
writer's O_DIRECT fallback on EFAULT, and the CUDA staging buffers page-locked at their exact size.
"""

from __future__ import annotations

import errno
import gc
import logging
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from andrea.config import load as configload
from andrea.control.run import records as records_mod
from andrea.control.commit import writer as writer_mod
from andrea.control.run.runtime import TrainingRun
from andrea.control.commit.shard_layout import ShardImage
from andrea.control.parallel.distributed import World
from andrea.rundir import names
from andrea.rundir.checkpoint_write import DIRECT_ALIGN, commit_checkpoint, image_bytes
from andrea.control.run.trainer import Trainer
from tests.runs import ROOT, env
from tests.disks import Disk, refusal_lines
from tests.sharding import commit_with_threads


class FakeStream:
    def __init__(self, device: int):
        self.device = torch.device("cuda", device)
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def wait_stream(self, stream) -> None:
        self.waited.append(stream)

    def __repr__(self) -> str:
        return f"FakeStream(cuda:{self.device.index})"


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", blocking: bool = False, **_):
        self.cuda, self.blocking, self.stream = cuda, blocking, None

    def record(self, stream: FakeStream | None = None) -> None:
        # CUDA semantics: no stream = the current stream of the calling thread's current device
        self.stream = stream if stream is not None else self.cuda.current_stream()
        self.cuda.log("record", self.stream.device.index)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """torch.cuda's thread-local current device and per-device current streams, with a log of every use."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.local = threading.local()
        self.streams: dict[int, FakeStream] = {}
        self.calls: list[tuple[str, str, int]] = []  # (what, thread name, device it acted on)
        self._lock = threading.Lock()
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(self, **kw))
        monkeypatch.setattr(torch.cuda, "stream", self.stream_context)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    def log(self, what: str, device: int) -> None:
        with self._lock:
            self.calls.append((what, threading.current_thread().name, device))

    def set_device(self, device) -> None:
        self.local.device = device.index if isinstance(device, torch.device) else int(device)

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)  # a new thread starts on device 0

    def current_stream(self, device=None) -> FakeStream:
        index = self.current_device() if device is None else (
            device.index if isinstance(device, torch.device) and device.index is not None else
            self.current_device() if isinstance(device, torch.device) else int(device))
        return self.streams.setdefault(index, FakeStream(index))

    @contextmanager
    def stream_context(self, stream: FakeStream):
        yield stream

    def launch(self) -> int:
        """What Triton's launcher does at each kernel launch: the current device, and its current stream."""
        device = torch.cuda.current_device()
        torch.cuda.current_stream(device)
        self.log("launch", device)
        return device


class CudaTensor:
    """A CUDA tensor as copy_ sees it: on its device, copied on that device's current stream."""

    is_cuda = True

    def __init__(self, cuda: FakeCuda, index: int):
        self.cuda, self.device = cuda, torch.device("cuda", index)


class HostSlot:
    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def copy_(self, src: CudaTensor, non_blocking: bool = False) -> None:
        assert non_blocking
        self.copy_stream = self.cuda.current_stream(src.device)  # ATen: a device guard on src's device
        self.cuda.log("copy", src.device.index)


# --- item 1: every thread that touches rank 1's GPU runs with it current ---------------------------------------
def test_rank_1_of_2_launches_copies_and_records_on_its_own_gpu_from_every_executor(tmp_path, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    world = World(rank=1, size=2, local_rank=1)
    device = world.device(torch.device("cuda"))  # as cli.cmd_train does, on the main thread
    assert device == torch.device("cuda", 1) and torch.cuda.current_device() == 1
    run = TrainingRun(configload.load(preset="andrea-tiny"), tmp_path, device=device, kernels="triton", world=world)
    try:
        def training_step() -> None:  # the andrea-train thread: kernel launches, then the step record's copy
            cuda.launch()
            slot = HostSlot(cuda)
            event = records_mod.copy_to_host(slot, CudaTensor(cuda, 1))
            assert event.stream is slot.copy_stream, "the event does not fence the copy"

        def commit() -> None:  # the andrea-io thread: waits on the snapshot's event
            cuda.log("io", torch.cuda.current_device())

        run.train.submit(training_step).result(timeout=30)
        run.io.submit(commit).result(timeout=30)
    finally:
        run.train.shutdown()
        run.io.shutdown()
    seen = {(what, thread.rsplit("_", 1)[0]): dev for what, thread, dev in cuda.calls}
    assert seen == {("launch", "andrea-train"): 1, ("copy", "andrea-train"): 1, ("record", "andrea-train"): 1,
                    ("io", "andrea-io"): 1}, cuda.calls


def test_the_thread_initializer_keeps_a_one_process_run_on_the_callers_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    assert World.thread_initializer(torch.device("cpu")) is None
    torch.cuda.set_device(3)  # e.g. a caller that chose its GPU; the trainer got plain "cuda"
    init = World.thread_initializer(torch.device("cuda"))
    seen: list[int] = []

    def thread() -> None:
        init()
        seen.append(torch.cuda.current_device())

    t = threading.Thread(target=thread)
    t.start()
    t.join(10)
    assert seen == [3], cuda.calls


def test_a_step_record_is_fenced_on_its_copys_stream_from_any_thread(monkeypatch):
    """Belt and braces beside the initializer: the event names the stream, so a thread on the wrong device
    (left on device 0) still records it behind the copy on device 1, never on device 0's stream."""
    cuda = FakeCuda(monkeypatch)
    out: dict = {}

    def bare_thread() -> None:
        slot = HostSlot(cuda)
        out["event"], out["copy"] = records_mod.copy_to_host(slot, CudaTensor(cuda, 1)), slot.copy_stream

    t = threading.Thread(target=bare_thread)
    t.start()
    t.join(10)
    assert out["event"].stream is out["copy"] and out["copy"].device.index == 1
    assert out["event"].blocking, "a host waiting on a step record would spin a core"


# --- item 3: the snapshot's fence is a blocking event on the copy stream ------------------------------------------
def test_the_snapshot_fence_is_a_blocking_event_recorded_on_the_copy_stream(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    trainer = Trainer(configload.load(preset="andrea-tiny"), torch.device("cpu"))
    trainer._copier.shutdown()
    trainer._copy_stream = FakeStream(1)  # the CUDA branch of the snapshot, its copies done by the CPU
    staging = torch.empty_like(trainer.state.buffer)
    fence = trainer.snapshot(staging)
    assert isinstance(fence, FakeEvent) and fence.stream is trainer._copy_stream
    assert fence.blocking, "the writer's synchronize() would busy-wait a core for a forward and backward"
    assert torch.equal(staging, trainer.state.buffer)
    trainer._wait_snapshot()  # the next update waits on the device, not on the host
    assert cuda.current_stream(torch.device("cpu")).waited == [fence]


# --- item 2: the sharded writer falls back on EFAULT as the one-file writer does --------------------------------
def test_the_sharded_writer_falls_back_to_buffered_when_the_first_o_direct_write_gets_efault(tmp_path, monkeypatch,
                                                                                          caplog):
    n, size = 50_001, 2
    payload = np.abs(np.random.default_rng(6).standard_normal(3 * n, dtype=np.float32))
    (tmp_path / "one").mkdir()
    expected = commit_checkpoint(tmp_path / "one", 7, payload).read_bytes()
    Disk(monkeypatch, refuse_write=errno.EFAULT)  # memory the kernel cannot pin for DMA
    (tmp_path / "many").mkdir()
    with caplog.at_level(logging.INFO, logger="andrea"):
        assert commit_with_threads(tmp_path / "many", n, size, payload) == {}
    lines = refusal_lines(caplog)
    assert len(lines) == size and all("first write" in line for line in lines), lines
    assert (tmp_path / "many" / names.checkpoint_name(7)).read_bytes() == expected


# --- item 5: pinned staging is page-locked at its exact size, and released with it ------------------------------
class FakeCudart:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail:
            return 712  # cudaErrorHostMemoryAlreadyRegistered, say
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("make", ["staging_image", "shard_image"])
def test_cuda_staging_is_registered_at_its_exact_size_and_unregistered_when_freed(monkeypatch, make):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pinned_allocations: list = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: pinned_allocations.append(kw) or real_zeros(
        *a, **{k: v for k, v in kw.items() if k != "pin_memory"}))
    n = 10_001
    if make == "staging_image":
        image = writer_mod.staging_image(n, pinned=True)
        size = image_bytes(n)
    else:
        image = ShardImage(n, 2, 1, pinned=True).image
        size = image.numel()
    ptr = image.data_ptr()
    assert cudart.registered == {ptr: size} and size == image.numel(), "not page-locked at exactly its size"
    assert ptr % DIRECT_ALIGN == 0 and not any(kw.get("pin_memory") for kw in pinned_allocations)
    view = image[8:16]
    del image
    gc.collect()
    assert cudart.unregistered == [], "unregistered while a view of the buffer is alive"
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_a_refused_registration_falls_back_to_the_pinned_allocator(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    pinned: list[int] = []
    real_zeros = torch.zeros

    def zeros(*a, pin_memory=False, **kw):
        if pin_memory:
            pinned.append(a[0])
        return real_zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    with caplog.at_level(logging.WARNING, logger="andrea"):
        image = writer_mod.staging_image(1001, pinned=True)
    assert pinned and image.numel() == image_bytes(1001) and image.data_ptr() % DIRECT_ALIGN == 0
    assert any("cudaHostRegister" in r.getMessage() for r in caplog.records)


# --- the GPU side of these checks: prepared, and refusing cleanly here ---------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: bench/gpu_check.sh runs the probe")
def test_the_gpu_probe_refuses_without_a_gpu():
    result = subprocess.run([sys.executable, "bench/cuda_paths.py"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env())
    assert result.returncode == 2 and "no CUDA device" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_gpu_check_script_parses():
    result = subprocess.run(["bash", "-n", "bench/gpu_check.sh"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
