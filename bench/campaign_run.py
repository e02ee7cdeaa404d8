"""One sequence of the campaign (bench/campaign.py): a run driven to its step target through its events, as a
supervisor (systemd's Restart=on-failure plus the operator's runbook) would drive it, and the record it leaves.

`Sequence.run()` trains `--steps at` before each offline event (and to the target after the last one), starting
`andrea train` again after every exit short of it: a kill, a stop, a refusal that names `--accept-ledger-gap`
(the next start adds it, as the line advises; any other exit 2 ends the sequence: refused). The online events
strike the trainer that runs when its ledger reaches their step (or `delay` s after its spawn). A poisoned step
is set in the environment of every start until the ledger shows that a start met it (its incident, or its NaN
loss with the guard off). Every process is bounded (`PROC_TIMEOUT`): one that outlives it is a hang.
What it records (`Record`): every process's argv, exit status and output, the events that struck and those that
could not (and why), the files it damaged (path -> sha256 of the damaged bytes), and the directory the run ends in.
Writes only under its work directory (and the replica's prefixes of the S3 server it is given).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from andrea.control.replica import remote
from andrea.rundir.checkpoint import list_checkpoints
from andrea.rundir.ledger import readable_entries
from bench.campaign_draw import ONLINE, Draw, Event, pick
from bench.campaign_procs import Proc, Zygote, last_entry, launch
from tests.disks import fill_to_the_last_byte
from tests.runs import seed_data
from tests.s3server import BUCKET

PROC_TIMEOUT = 180.0     # seconds any one command may take (andrea-tiny: a few)
STEP_DELAY = 0.02        # ANDREA_TEST_STEP_DELAY: a window for the strikes (sleeps only: the bytes are unchanged)
MAX_STARTS = 12          # per segment: a run that cannot reach its target within this many starts is stuck


@dataclass
class Record:
    procs: list[Proc] = field(default_factory=list)
    struck: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)   # path -> sha256 of what the campaign left there
    failures: list[str] = field(default_factory=list)
    seen: dict[str, None] = field(default_factory=dict)     # every ledger line ever read, in order
    run: Path | None = None
    reached: bool = False
    refused: str = ""          # the line of a start refused twice alike (the sequence ends there)
    answered: bool = False     # ...a refusal the docs promise: no checkpoint left that the campaign did not damage


class Sequence:
    def __init__(self, draw: Draw, events: tuple[Event, ...], work: Path, template: Path, zygote: Zygote,
                 server=None, disk: Path | None = None, perfect: bool = False):
        self.d, self.cfg, self.events, self.work = draw, draw.config, events, work
        self.template, self.zygote, self.server, self.disk, self.perfect = template, zygote, server, disk, perfect
        self.base = disk or work
        self.run_dir = seed_data(template, self.base / "run")
        self.uri = f"s3://{BUCKET}/{work.name}-run" if server is not None else None
        self.rec = Record(run=self.run_dir)
        self.accept_gap = False
        self.init_from: Path | None = None
        self.inherited: Path | None = None  # the parent's [policy], restated for its --init-from run (`offline`)
        self.n = 0
        self.poison = sorted(e.at for e in events if e.kind == "poison")
        self.hit: set[int] = set()  # poisoned steps a start met and stopped at (the guard off: no ledger record)

    # --- processes --------------------------------------------------------------------------------------------
    def andrea(self, *argv: str, extra: dict | None = None) -> Proc:
        self.n += 1
        log = self.work / f"{self.n:03d}-{argv[0]}.log"
        p = self.zygote.spawn(list(argv), {**self.env(), **(extra or {})}, log)
        self.rec.procs.append(p)
        return p

    def env(self) -> dict[str, str]:
        return {"ANDREA_TEST_STEP_DELAY": str(STEP_DELAY), **(self.server.env() if self.server else {})}

    def finish(self, p: Proc) -> int | None:
        rc = p.wait(PROC_TIMEOUT)
        if rc is None:
            self.rec.failures.append(f"hang: `{' '.join(p.argv[:2])}` still running after {PROC_TIMEOUT:.0f} s")
            p.kill_all()
        return rc

    def command(self, *argv: str) -> tuple[int | None, str]:
        p = self.andrea(*argv)
        rc = self.finish(p)
        return rc, p.output()

    def train_argv(self, target: int) -> list[str]:
        c = self.cfg
        argv = ["train", "--preset", "andrea-tiny", "--device", "cpu", "--run-dir", str(self.run_dir),
                "--steps", str(target), "--checkpoint-every", str(c.every), *c.sets()]
        if self.uri:
            argv += ["--set", f'checkpoint.replica="{self.uri}"', "--set", "checkpoint.replica_wait=10"]
        if self.accept_gap:
            argv.append("--accept-ledger-gap")
        if self.init_from is not None and not list_checkpoints(self.run_dir):
            argv += ["--init-from", str(self.init_from)]
            if self.inherited is not None:
                argv += ["--config", str(self.inherited)]
        return argv

    def start(self, target: int) -> Proc:
        extra = {}
        pending = [s for s in self.poison if not self.met(s)]
        if pending:
            extra["ANDREA_TEST_POISON_STEPS"] = ",".join(map(str, pending))
        argv = self.train_argv(target)
        if self.cfg.ranks == 1:
            return self.andrea(*argv, extra=extra)
        self.n += 1
        p = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={self.cfg.ranks}", "-m", "andrea", *argv],
                   {**self.env(), **extra}, self.work / f"{self.n:03d}-torchrun.log")
        self.rec.procs.append(p)
        return p

    def ledger(self) -> list[dict]:
        entries = readable_entries(self.run_dir / ".loss.json")
        for e in entries:
            self.rec.seen.setdefault(json.dumps(e, sort_keys=True), None)
        return entries

    def met(self, step: int) -> bool:
        """A start met the poisoned step: the ledger holds its incident or its non-finite loss, or (the guard off)
        a start stopped there saying so."""
        if step in self.hit:
            return True
        for e in self.ledger():
            if e.get("step") != step:
                continue
            if e.get("event") == "incident" or ("event" not in e and not math.isfinite(e.get("loss", 0.0))):
                return True
        return False

    def all_damaged(self) -> bool:
        """Every checkpoint on disk has a file the campaign damaged (or lost a companion): none can be resumed."""
        steps = [s for s, _ in list_checkpoints(self.run_dir)]
        return bool(steps) and all(
            any(str(self.run_dir / f"step_{s:06d}.{f}") in self.rec.damaged
                for f in ("bin", "sum.json", "ledger.json", "guard.json"))
            or not (self.run_dir / f"step_{s:06d}.sum.json").exists() for s in steps)

    def newest(self) -> int | None:
        return max((s for s, _ in list_checkpoints(self.run_dir)), default=None)

    # --- the supervisor -----------------------------------------------------------------------------------------
    def run(self) -> Record:
        online: list[Event] = []
        for ev in self.events:
            if ev.kind in ONLINE:
                online.append(ev)
            elif ev.kind == "poison":
                continue
            elif not self.train_to(ev.at, online):  # (a perfect run's `stop`: only this)
                return self.rec
            elif ev.kind != "stop":
                self.offline(ev)
                if self.rec.failures:
                    return self.rec
        self.rec.reached = self.train_to(self.cfg.steps, online)
        self.rec.skipped += [f"{e.kind}: the run reached step {e.at} before a start could meet it" for e in online]
        for step in self.poison:
            if self.met(step) or any(f'"step": {step}' in line and '"incident"' in line for line in self.rec.seen):
                self.rec.struck.append("poison")
            else:
                self.rec.skipped.append(f"poison: no start met step {step}")
        self.rec.run = self.run_dir
        return self.rec

    def train_to(self, target: int, online: list[Event]) -> bool:
        """Start train --steps target until one exits 0 with a checkpoint at the target; strike `online` events
        (consumed) as the trainers reach them. False: the sequence failed (recorded) or was refused."""
        previous = None
        for _ in range(MAX_STARTS):
            p = self.start(target)
            stopped = False
            while online and online[0].at <= target and p.poll() is None:
                ev = online[0]
                if not self.wait_strike(p, ev):
                    break
                online.pop(0)
                self.strike(p, ev)
                if ev.kind in ("sigkill", "sigterm"):
                    stopped = True
                    break
            rc = self.finish(p)
            if rc is None:
                return False
            out = p.output()
            self.hit |= {s for s in self.poison if f"step {s}: loss nan" in out}
            if rc == 0 and (self.newest() or 0) >= target:
                return True
            if rc == 0 and stopped:
                continue
            if rc != 0 and "--accept-ledger-gap" in out and not self.accept_gap:
                self.accept_gap = True
                continue
            line = last_line(out)
            if rc == 2 or (rc == 0 and not stopped) or (rc != 0 and line == previous and "error" in line):
                self.rec.refused = f"`train --steps {target}` exit {rc}: {line}"
                self.rec.answered = self.all_damaged() and rc != 0
                if not self.rec.answered:
                    self.rec.failures.append(f"refused: {self.rec.refused}")
                return False
            previous = line
        self.rec.failures.append(f"stuck: {MAX_STARTS} starts did not reach step {target}: {last_line(out)}")
        return False

    def wait_strike(self, p: Proc, ev: Event) -> bool:
        """Wait until `ev` may strike `p` (its step reached by this process, or its delay after the spawn); False
        when p exits first."""
        deadline = time.monotonic() + PROC_TIMEOUT
        delay = ev.arg("delay")
        ledger = self.run_dir / ".loss.json"
        while p.poll() is None and time.monotonic() < deadline:
            if delay is not None:
                if time.time() >= p.spawned + delay:
                    return True
            else:
                e = last_entry(ledger)
                if e is not None and "event" not in e and e.get("step", -1) >= ev.at and e.get("time", 0) >= p.spawned:
                    time.sleep(ev.arg("jitter", 0.0) * STEP_DELAY)
                    return True
            time.sleep(0.005)
        return False

    def strike(self, p: Proc, ev: Event) -> None:
        self.rec.struck.append(ev.kind)
        if ev.kind == "sigkill":
            p.signal(signal.SIGKILL)
        elif ev.kind == "sigterm":
            p.signal(signal.SIGTERM)
        elif ev.kind == "outage":
            self.server.kill()
            time.sleep(ev.arg("seconds"))
            self.server.start()
        elif ev.kind == "disk":
            if self.disk is None:
                self.rec.struck.pop()
                self.rec.skipped.append("disk: no tmpfs of its own (needs root, `unshare -m`)")
                return
            filler = fill_to_the_last_byte(self.disk)
            try:
                p.wait(ev.arg("seconds"))
            finally:
                filler.unlink()

    # --- offline events -----------------------------------------------------------------------------------------
    def offline(self, ev: Event) -> None:
        steps = [s for s, _ in list_checkpoints(self.run_dir)]
        self.ledger()
        k = ev.kind
        if k == "pivot":
            policy = self.work / f"policy-{self.n}.toml"
            policy.write_text("[policy]\n" + "".join(
                f"{table} = {{ {', '.join(f'{a} = {v}' for a, v in vals.items())} }}\n"
                for table, vals in ev.arg("policy").items()))
            rc, out = self.command("pivot", str(self.run_dir), "--policy", str(policy))
            if rc != 0:
                self.rec.failures.append(f"pivot exit {rc}: {last_line(out)}")
            else:
                self.rec.struck.append(k)
            return
        s = pick(ev.arg("which", 0.0), steps)
        if k in ("flip", "cut"):
            name = ".loss.json" if ev.arg("file") == ".loss.json" else f"step_{s:06d}.{ev.arg('file')}"
            path = self.run_dir / name
            if s is None or not path.is_file() or path.stat().st_size == 0:
                self.rec.skipped.append(f"{k}: no {name} on disk")
                return
            data = bytearray(path.read_bytes())
            u = ev.arg("u")
            if k == "flip":
                bit = min(int(u * len(data) * 8), len(data) * 8 - 1)
                data[bit // 8] ^= 1 << (bit % 8)
            else:
                data = data[:min(int(u * len(data)), len(data) - 1)]
            path.write_bytes(bytes(data))
            self.rec.damaged[str(path)] = hashlib.sha256(bytes(data)).hexdigest()
            self.rec.struck.append(k)
        elif k == "delete":
            if s is None:
                self.rec.skipped.append("delete: no checkpoint on disk")
                return
            for f in self.run_dir.glob(f"step_{s:06d}.*"):
                if not ev.arg("bin_only") or f.suffix == ".bin":
                    f.unlink()
            self.rec.struck.append(k)
        elif k in ("branch", "init_from"):
            if s is None:
                self.rec.skipped.append(f"{k}: no checkpoint on disk")
                return
            new = self.base / f"{k}-{self.n}"
            if k == "branch":
                rc, out = self.command("branch", str(self.run_dir), "--step", str(s), "--to", str(new))
                if rc != 0:
                    self.note_refusal(k, rc, out)
                    return
            else:
                seed_data(self.template, new)
                self.init_from = self.run_dir / f"step_{s:06d}.bin"
                # --init-from starts a new run configured by its own command line (docs/operating.md): an operator
                # moving a pivoted run on restates the policy it trains under, as run.toml holds it (a branch copies
                # run.toml). Without it the new run's policy is the preset's, its bandit restarts in a new phase, and
                # it is not the perfect run's continuation (seed 15: pivot@11 -> init_from@15, phase 2 for 1)
                parent = tomllib.loads((self.run_dir / "run.toml").read_text()).get("policy")
                self.inherited = self.work / f"policy-of-{new.name}.toml"
                self.inherited.write_text(tomli_w.dumps({"policy": parent or {}}))
            self.ledger()  # its lines stay on the record of this sequence
            self.run_dir = new
            if self.uri:
                self.uri = f"s3://{BUCKET}/{self.work.name}-{new.name}"
            self.rec.struck.append(k)
        elif k == "restore":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (remote.read_status(self.run_dir) or {}).get("step"):
                time.sleep(0.1)
            if not (remote.read_status(self.run_dir) or {}).get("step"):
                self.rec.skipped.append("restore: the replica held no checkpoint within 30 s")
                return
            self.ledger()
            shutil.rmtree(self.run_dir)
            rc, out = self.command("restore", self.uri, "--run-dir", str(self.run_dir))
            if rc != 0:
                self.rec.failures.append(f"restore exit {rc}: {last_line(out)}")
                return
            self.rec.struck.append(k)

    def note_refusal(self, kind: str, rc: int | None, out: str) -> None:
        """A command that refused: one line and exit 1 or 2 is an answer (skipped, said why); else a failure."""
        if rc in (1, 2) and "Traceback" not in out:
            self.rec.skipped.append(f"{kind}: refused: {last_line(out)}")
        else:
            self.rec.failures.append(f"{kind} exit {rc}: {last_line(out)}")


def last_line(text: str) -> str:
    lines = [l for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()]
    return (errors or lines or [""])[-1]
