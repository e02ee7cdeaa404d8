"""bench/campaign.py's oracle on tracebacks (seed 13: a SIGTERM to the torchrun launcher): torchrun's own report is
expected exactly where torchrun prints it, and every other traceback is andrea's. Plain logs, no process."""

from __future__ import annotations

from types import SimpleNamespace

from bench import campaign
from bench.campaign_procs import Proc
from bench.campaign_run import Record

SIGNALLED = """[rank0]: stopped at step 22 (SIGTERM)
Traceback (most recent call last):
  File "torch/distributed/run.py", line 940, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 7586 got signal: 15
"""
ANDREAS = """Traceback (most recent call last):
  File "andrea/control/run/runtime.py", line 1, in start
RuntimeError: cannot schedule new futures after shutdown
"""


def proc(tmp_path, text: str, torchrun: bool = True, signals=("SIGTERM",), rc: int = 1):
    log = tmp_path / f"{len(list(tmp_path.iterdir()))}.log"
    log.write_text(text)
    p = Proc(log, ["python", "-m", "torch.distributed.run"], popen=SimpleNamespace(pid=1), group=torchrun)
    p.signals, p.rc = list(signals), rc
    return p


def failures(*procs) -> list[str]:
    return campaign.traceback_failures(Record(procs=list(procs)))


def test_torchruns_report_of_the_signal_it_was_sent_is_its_own_not_andreas(tmp_path):
    assert failures(proc(tmp_path, SIGNALLED)) == []  # seed 13: SIGTERM to the launcher, workers stopped cleanly
    assert failures(proc(tmp_path, SIGNALLED, signals=())) != []  # nobody signalled it: unexplained
    assert failures(proc(tmp_path, SIGNALLED, torchrun=False)) != []  # an andrea process never raises torchrun's
    failed = "Traceback (most recent call last):\n  File x\ntorch.distributed.elastic.multiprocessing.errors." \
             "ChildFailedError: \n"
    assert failures(proc(tmp_path, failed, signals=(), rc=75)) == []  # a worker's exit 75 (a stall), reported
    assert failures(proc(tmp_path, failed, signals=(), rc=0)) != []


def test_a_workers_traceback_beside_torchruns_report_is_andreas(tmp_path):
    (found,) = failures(proc(tmp_path, ANDREAS + SIGNALLED))
    assert found == "traceback in `torchrun`: RuntimeError: cannot schedule new futures after shutdown"
