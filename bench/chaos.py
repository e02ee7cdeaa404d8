"""The chaos run (`make chaos`): one andrea run meets every fault, under a supervisor loop as systemd would run it.

The run trains `--preset` to `--steps` with a checkpoint every `--checkpoint-every` steps, replicated to a real S3
server (SeaweedFS, tests/s3server.py) and sending its notices to a loopback webhook (tests/notices.py). A
supervisor starts `andrea train`, starts it again while it exits non-zero, and runs `andrea restore` when the run
directory is gone (bench/chaos_plan.py `decide`). Meanwhile one fault strikes every `--every` seconds, in this
order (`--faults` picks and orders them; bench/chaos_plan.py `FAULTS` says what each does to the bytes):

    sigterm   SIGTERM to the trainer (a preemption; the supervisor starts it again)
    poison    the next start poisons step r + 1.5 K (ANDREA_TEST_POISON_STEPS): the guard rolls back
    sigkill   SIGKILL
    hang      the next start is a torchrun job of 2 CPU ranks whose rank 1 hangs one step after the resume
              (ANDREA_TEST_HANG); the watchdog ends it and the supervisor starts one process again
    bitflip   SIGKILL, then one mantissa bit of a weight flipped in the newest checkpoint (no value check sees it)
    outage    the S3 server killed for `--outage` seconds, then started again on the same ports
    disk      the run directory's filesystem (a tmpfs in this process's own mount namespace: `unshare -m`)
              filled to the last byte until a checkpoint write fails, then freed
    loss      SIGKILL, then the run directory deleted: the supervisor restores it from the replica

`poison` and `hang` strike at the start after the fault before them (they are set in the start's environment);
the others at their time. A fault waits until the run has recovered from the one before it (a new step); the loss
of the machine also waits until the replica holds a checkpoint past a poisoned step (chaos_plan.loss_may_strike).
Then the same command trains a fresh directory on a perfect machine (the poisoned step included: it is part of
the command), and bench/chaos_report.py prints the report: the final checkpoint's sha256 and the ledger's settled
entries against that run's, every ledger marker and notice and the fault it belongs to, per fault the steps lost and
the seconds from the exit to the first new step, where each restart's seconds go, and the goodput (steps kept /
(wall time x the fault-free steps/s)).

Writes only a temporary directory (its path is printed; `--keep` keeps it). Timings describe this machine.

    python bench/chaos.py                                   # andrea-12m, one fault a minute, every fault
    python bench/chaos.py --preset andrea-tiny --every 5 --steps 600 --checkpoint-every 20
    python bench/chaos.py --faults sigkill,bitflip,loss --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andrea.control.replica import remote  # noqa: E402
from andrea.rundir.ledger import last_step  # noqa: E402
from bench import chaos_plan as plan  # noqa: E402
from bench import chaos_setup as setup  # noqa: E402
from bench.chaos_report import report  # noqa: E402
from tests.disks import fill_to_the_last_byte  # noqa: E402
from tests.notices import Inbox  # noqa: E402
from tests.runs import Launched, andrea, seed_data  # noqa: E402
from tests.s3server import BUCKET, S3Server  # noqa: E402

IN_NAMESPACE = "ANDREA_CHAOS_NAMESPACE"  # set once this process runs in its own mount namespace
ATTACHED = ("poison", "hang")            # set in the environment of the next start
MAX_STARTS = 200


class Segment(Launched):
    """One supervised process (train, a torchrun job, restore): its output lines, each with its arrival time."""

    def __init__(self, kind: str, argv: list[str], extra_env: dict, log: Path):
        self.kind, self.spawned, self.stamped = kind, time.time(), []
        self.log = open(log, "w")
        super().__init__(argv, extra_env)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            self.stamped.append((now, line.rstrip("\n")))
            self.log.write(f"{now:.3f} {line}")
            self.log.flush()
            self._q.put(line.rstrip("\n"))
        self.log.close()

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.stamped if text in line), None)


class Chaos:
    def __init__(self, args, work: Path, run: Path, server: S3Server, inbox: Inbox, uri: str, disk: Path | None):
        self.args, self.work, self.run, self.server, self.inbox, self.uri = args, work, run, server, inbox, uri
        self.disk = disk
        self.lock = threading.Lock()
        self.current: Segment | None = None
        self.segments: list[dict] = []
        self.injected: list[plan.Injected] = []
        self.attach: tuple[str, plan.Injected] | None = None  # (kind, its record) for the next start
        self.offline = None       # what to do to the disk once the process has exited (bitflip, loss)
        self.ending: plan.Injected | None = None  # the fault whose signal is ending the current process
        self.stop_requested = False
        self.aborted = False
        self.finished = threading.Event()
        self.outcome = ""
        self.poison_step: int | None = None
        self.skipped: list[str] = []
        self.seen: dict[str, None] = {}  # every ledger line read, in the order first read
        self.hang_segment: Segment | None = None  # the torchrun job of the hang
        self.t0 = time.time()  # the first step's time: the faults' clock starts there
        self.records = [plan.Injected(k, at=0.0) for k in args.faults]
        if args.faults and args.faults[0] in ATTACHED:
            self.attach = (args.faults[0], self.records[0])  # the first start carries it

    def ledger(self) -> list[dict]:
        """The run's ledger now; every line ever read is also kept in `seen` (the loss of the machine takes the
        lines its replica had not received: the report still knows what happened before)."""
        lines = setup.ledger_lines(self.run)
        for line in lines:
            self.seen.setdefault(line, None)
        return [json.loads(line) for line in lines]

    def observed(self) -> list[dict]:
        self.ledger()
        return [json.loads(line) for line in self.seen]

    # --- the supervisor -------------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        a = self.args
        return ["train", "--preset", a.preset, "--run-dir", str(self.run), "--device", "cpu", "--steps",
                str(a.steps), "--checkpoint-every", str(a.checkpoint_every), *train_flags(a, self.uri, self.inbox)]

    def start(self, n: int) -> Segment:
        env = {**self.server.env()}
        kind, argv = "train", [sys.executable, "-m", "andrea", *self.command()]
        with self.lock:
            attached, self.attach = self.attach, None
        resume = setup.newest_checkpoint(self.run) or 0
        if attached and attached[0] == "poison":
            self.poison_step = resume + math.ceil(1.5 * self.args.checkpoint_every)
            env["ANDREA_TEST_POISON_STEPS"] = str(self.poison_step)
            attached[1].notes.append(f"step {self.poison_step} poisoned in start {n}")
        elif attached and attached[0] == "hang":
            kind = "torchrun"
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "andrea", *self.command()]
            env["ANDREA_TEST_HANG"] = f"train@{resume + 1}@1"
            attached[1].notes.append(f"rank 1 hangs after step {resume + 1}")
        seg = Segment(kind, argv, env, self.work / f"start-{n:03d}.{kind}.log")
        seg.attached = attached[1] if attached else None
        if kind == "torchrun":
            self.hang_segment = seg
        return seg

    def supervise(self) -> None:
        try:
            for n in range(MAX_STARTS):
                if self.aborted:
                    self.outcome = "interrupted"
                    return
                seg = self.start(n)
                with self.lock:
                    self.current = seg
                rc = seg.wait_exit(None)
                exit_at = time.time()
                with self.lock:
                    self.current = None
                    reached = last_step(self.ledger())
                    ended = self.ending or (seg.attached if seg.kind == "torchrun" else None)
                    if ended is not None:
                        ended.exit_at, ended.reached = exit_at, reached
                    self.ending = None
                    if self.offline:
                        self.offline()
                        self.offline = None
                    requested, self.stop_requested = self.stop_requested, False
                self.segments.append(segment_record(seg, rc, exit_at))
                action = plan.decide(rc, setup.dir_state(self.run), self.args.steps, requested)
                self.segments[-1]["action"] = action
                if action == plan.RESTORE:
                    r = Segment("restore", [sys.executable, "-m", "andrea", "restore", self.uri, "--run-dir",
                                            str(self.run)], self.server.env(), self.work / f"start-{n:03d}.restore.log")
                    rrc = r.wait_exit(None)
                    self.segments.append({**segment_record(r, rrc, time.time()), "action": "restored"})
                elif action in (plan.DONE, plan.SHORT, plan.REFUSED):
                    self.outcome = action
                    return
            self.outcome = f"gave up after {MAX_STARTS} starts"
        finally:
            self.finished.set()

    # --- the faults -----------------------------------------------------------------------------------------------
    def recovered_since(self, t: float) -> bool:
        return plan.first_step_after(self.ledger(), t) is not None

    def wait(self, condition, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.finished.is_set():
                return False
            if condition():
                return True
            time.sleep(0.1)
        return False

    def record(self, f: plan.Injected) -> None:
        """A fault that struck, in time order (the report attributes markers and notices by time)."""
        self.injected.append(f)
        self.injected.sort(key=lambda x: x.at)

    def replica_step(self) -> int | None:
        """The newest step the replica holds, as the replicator last recorded it (`.replica.json`)."""
        status = remote.read_status(self.run)
        return status.get("step") if isinstance(status, dict) else None

    def stepped(self) -> bool:
        """The current process has recorded a step of its own (a fault strikes a run that trains)."""
        seg = self.current
        return seg is not None and plan.first_step_after(self.ledger(), seg.spawned) is not None

    def inject_all(self) -> None:
        faults = self.args.faults
        records = self.records
        self.wait(lambda: self.stepped(), 3600)
        first = plan.first_step_after(self.ledger(), 0)
        self.t0 = first["time"] if first else time.time()
        for i, (kind, f) in enumerate(zip(faults, records)):
            nxt = records[i + 1] if i + 1 < len(faults) and faults[i + 1] in ATTACHED else None
            due = self.t0 + (i + 1) * self.args.every
            if kind in ATTACHED:
                if i > 0 and not plan.FAULTS[faults[i - 1]].exits:  # no restart to ride on: make one
                    if not self.wait(lambda: time.time() >= due and self.stepped(), 3600):
                        break
                    with self.lock:
                        self.attach = (kind, f)
                        f.notes.append("the trainer was stopped with SIGTERM to reach a start")
                        self.stop_requested = True
                        self.current.proc.send_signal(signal.SIGTERM)
                done = self.hang_resolved if kind == "hang" else self.poison_resolved
                if not self.wait(lambda: done(f), 3600):
                    break
                continue
            if not self.wait(lambda: time.time() >= due and self.stepped(), 3600):
                break
            if kind == "loss" and not self.wait(lambda: plan.loss_may_strike(self.replica_step(), self.poison_step),
                                                3600):
                break
            self.strike(f, nxt)
            if plan.FAULTS[kind].exits:
                self.wait(lambda: f.exit_at is not None and self.recovered_since(f.exit_at), 3600)
        else:
            return
        self.skipped = [k for k, f in zip(faults, records) if f not in self.injected]

    def hang_resolved(self, f: plan.Injected) -> bool:
        seg = self.hang_segment
        if f.exit_at is None or seg is None:
            return False
        f.at = seg.first("hangs now") or seg.spawned
        if f not in self.injected:
            self.record(f)
        return self.recovered_since(f.exit_at)

    def poison_resolved(self, f: plan.Injected) -> bool:
        if self.poison_step is None:
            return False
        led = self.ledger()
        incident = next((e for e in led if e.get("event") == "incident" and e["step"] == self.poison_step), None)
        rolled = any(e.get("event") == "rollback" and e.get("from", 0) >= self.poison_step for e in led)
        if incident is None or not rolled:
            return False
        if f not in self.injected:
            f.at = incident["time"]
            self.record(f)
        return (setup.newest_checkpoint(self.run) or 0) > self.poison_step

    def strike(self, f: plan.Injected, attach: plan.Injected | None) -> None:
        """Inject fault `f` now; `attach`: the fault the next start carries (poison, hang), set before the exit."""
        with self.lock:
            seg = self.current
            f.at = time.time()
            self.record(f)
            if attach is not None and plan.FAULTS[f.kind].exits:
                self.attach = (attach.kind, attach)
            if f.kind in ("sigterm", "sigkill", "bitflip", "loss"):
                self.ending = f
            if f.kind == "sigterm":
                self.stop_requested = True
                seg.proc.send_signal(signal.SIGTERM)
            elif f.kind == "sigkill":
                seg.proc.kill()
            elif f.kind == "bitflip":
                self.offline = lambda: f.notes.append(setup.flip_mantissa_bit(
                    self.run / f"step_{setup.newest_checkpoint(self.run):06d}.bin"))
                seg.proc.kill()
            elif f.kind == "loss":
                self.offline = lambda: shutil.rmtree(self.run)
                seg.proc.kill()
        if f.kind == "outage":
            self.server.kill()
            time.sleep(self.args.outage)  # the outage itself: the store stays down this long
            self.server.start()
            f.notes.append(f"store down {time.time() - f.at:.1f} s")
            # recovered when the replica has caught up (control/replica/plan.py says so once): the next fault waits for it
            self.settle(seg, lambda l: "replica reachable again" in l, f, "the replica caught up")
        elif f.kind == "disk":
            if self.disk is None:
                f.notes.append("skipped: no private mount namespace (needs root and unshare)")
                return
            filler = fill_to_the_last_byte(self.disk)
            self.settle(seg, lambda l: "checkpoint write failed" in l, f, "a checkpoint write failed")
            filler.unlink()
            f.notes.append(f"disk full {time.time() - f.at:.1f} s")
            self.settle(seg, lambda l: "committed" in l, f, "a checkpoint committed again")


    def settle(self, seg: Segment, done, f: plan.Injected, what: str) -> None:
        """Wait (bounded) until the trainer logs, from now on, a line for which done(line) holds: a fault without an
        exit has recovered then. A trainer that exits first, or a line that never comes, is noted, not fatal."""
        since = time.time()
        def hit() -> bool:
            return any(t >= since and done(line) for t, line in seg.stamped)
        self.wait(lambda: seg.proc.poll() is not None or hit(), max(60.0, 10 * self.args.every))
        f.notes.append(f"{what} after {time.time() - f.at:.1f} s" if hit() else f"{what}: not seen")


def train_flags(a, uri: str, inbox: Inbox) -> list[str]:
    return ["--set", f'checkpoint.replica="{uri}"', "--set", f'notify.url="{inbox.url}"',
            "--set", f"watchdog.floor_s={a.watchdog}", "--set", "watchdog.factor=2",
            "--set", "sample.every=1000000", "--set", "train.eval_every=1000000"]


def segment_record(seg: Segment, rc: int, exit_at: float) -> dict:
    return {"kind": seg.kind, "rc": rc, "spawned": seg.spawned, "exit": exit_at,
            "first_line": seg.stamped[0][0] if seg.stamped else None, "ready": seg.first("ready pid="),
            "log": seg.log.name, "tail": [line for _, line in seg.stamped[-6:]]}


def in_own_namespace() -> bool:
    """Whether this process is the re-run of the script in a mount namespace of its own (the full disk's tmpfs)."""
    return os.environ.get(IN_NAMESPACE) == "1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="andrea-12m")
    p.add_argument("--steps", type=int, default=0,
                   help="the run's target step; 0: enough for every fault at --every (from a short timed run)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--faults", default=",".join(plan.ORDER), help="comma-separated, in order")
    p.add_argument("--outage", type=float, default=10.0, help="seconds the store stays down")
    p.add_argument("--watchdog", type=float, default=30.0,
                   help="watchdog.floor_s of the run: a hang is found this long after it (above a step and a start)")
    p.add_argument("--template", type=Path, default=None, help="a prepared run directory to copy data from")
    p.add_argument("--json", type=Path, default=None, help="also write the report's figures as JSON here")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directory, the chaos run copied out of its tmpfs into it (kept-run/)")
    p.add_argument("--import-probes", type=int, default=3, help="times `import torch` is timed alone (0: never)")
    args = p.parse_args()
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in plan.FAULTS]
    if unknown:
        p.error(f"unknown faults {unknown}; known: {', '.join(plan.ORDER)}")
    if "disk" in args.faults and not in_own_namespace() and os.geteuid() == 0 and shutil.which("unshare"):
        return subprocess.call(["unshare", "-m", "--propagation", "private", sys.executable, *sys.argv],
                               env={**os.environ, IN_NAMESPACE: "1"})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still stops its server and trainer
    work = Path(tempfile.mkdtemp(prefix="andrea-chaos-"))
    print(f"work directory: {work}", file=sys.stderr)
    try:
        return run_chaos(args, work)
    finally:
        if args.keep:  # the chaos run lives on the tmpfs, which the unmount below takes with it
            print(f"kept: {keep_run(work)}", file=sys.stderr)
        if in_own_namespace():  # the full disk's tmpfs: a mount point is not removed while mounted
            subprocess.run(["umount", "-l", str(work / "disk")], capture_output=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def keep_run(work: Path) -> Path:
    """The chaos run's directory copied to `work`/kept-run before its tmpfs goes (a run not on one: it is there
    already, `work`/run); the path to investigate it at (docs/benchmarks.md)."""
    on_disk = work / "disk" / "run"
    if not on_disk.is_dir():
        return work / "run"
    kept = work / "kept-run"
    shutil.copytree(on_disk, kept, symlinks=True, dirs_exist_ok=True)
    return kept


def run_chaos(args, work: Path) -> int:
    template = args.template or setup.prepare_template(args.preset, work / "template")
    if args.steps <= 0:
        args.steps = setup.calibrate(args, work, template)
    disk = setup.mount_disk(work / "disk", template, args) if in_own_namespace() else None
    run = (disk or work) / "run"
    seed_data(template, run)
    server = S3Server(work / "s3", nice=10).start()
    inbox = Inbox()
    chaos = Chaos(args, work, run, server, inbox, f"s3://{BUCKET}/chaos", disk)
    try:
        supervisor = threading.Thread(target=chaos.supervise, name="supervisor", daemon=True)
        supervisor.start()
        chaos.inject_all()
        supervisor.join()
        reference = setup.reference_run(args, work, template, server, chaos.poison_step, train_flags)
        chaos.torch_import_s = setup.torch_import_seconds(args.import_probes)
    finally:
        chaos.aborted = True  # an interrupted bench: no more starts
        if chaos.current is not None:
            chaos.current.kill()
        inbox.close()
        server.stop()
    figures = report(args, chaos, reference, setup.read_ledger(run), chaos.observed(), setup.newest_checkpoint(run),
                     list(inbox.events), sys.stdout)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0 if figures["verdict"]["target_reached"] else 1


if __name__ == "__main__":
    sys.exit(main())
