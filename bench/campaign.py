"""The seeded campaign of random fault sequences (`make campaign`): per seed, a run configuration and a sequence of
faults drawn from the seed alone (bench/campaign_draw.py), driven to the step target (bench/campaign_run.py) and
judged against its oracle:

- the same commands on a perfect machine (no fault; the poisoned steps a start met and the pivots are part of the
  command) end with the same final checkpoint, byte for byte, and the same settled ledger (each settled step's
  loss, lr, grad_norm, tokens, phase); a `gap` marker (`--accept-ledger-gap`: docs/formats.md says it gives up
  ledger lines) waives the ledger check, never the bytes; a pivot must leave its `pivot` marker;
- no process prints a traceback or outlives its bound (a hang), none is refused where a supervisor could not go on;
- no damaged checkpoint is trusted: a checkpoint file the campaign flipped or cut, still there as it was left, is
  never `ok` in `andrea verify`, and `verify` exits 0 exactly when no such file is left.

The perfect run is made once per configuration, poisoned steps and pivots within a campaign. A failing seed is
shrunk (delta debugging over its events, the configuration fixed) and printed with the command that replays it.
At the end, one table: sequences, events of each kind (drawn, struck, skipped), the failures, the time.

    python bench/campaign.py --seeds 0-199             # `make campaign SEEDS=0-199`
    python bench/campaign.py --seed 17                 # replay one seed (its sequence and its shrunk one)
    python bench/campaign.py --seed 17 --events 0,2    # only those events of seed 17's sequence

Runs every command from one warm launcher (tests/zygote.py; torchrun jobs as processes), andrea-tiny on the
CPU (OMP_NUM_THREADS=1), a real S3 server (SeaweedFS) for the seeds with a replica. As root it runs itself in a
mount namespace of its own, where each seed with a full-disk event trains on a tmpfs (otherwise those events are
skipped, and said so). Writes only a temporary directory (`--keep` keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from andrea.control.replica import remote  # noqa: E402
from andrea.rundir.ledger import history, readable_entries  # noqa: E402
from bench.campaign_draw import (Draw, Event, Outcome, ddmin, draw, parse_seeds, perfect_commands, perfect_key,  # noqa: E402
                                 summary)  # noqa: E402
from bench.campaign_procs import Zygote  # noqa: E402
from bench.campaign_run import Record, Sequence, last_line  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

IN_NAMESPACE = "ANDREA_CAMPAIGN_NAMESPACE"
SETTLED = ("step", "loss", "lr", "grad_norm", "tokens", "phase")
CHECKED = ("bin", "sum.json", "ledger.json", "guard.json")  # the files a checkpoint's checksum or seal covers
# (docs/formats.md)


class Campaign:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.zygote = Zygote({"ANDREA_TEST_REPLICA_BACKOFF": "0.2"})
        self.template = self.prepare()
        self.servers: dict[int, S3Server] = {}  # one per worker thread: an outage strikes its own sequence only
        self.perfect: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.key_locks: dict[str, threading.Lock] = {}
        self.root = os.environ.get(IN_NAMESPACE) == "1"
        self.count = 0
        self.kept: list[Path] = []  # the work directories of failing sequences (their logs)

    def next_count(self) -> int:
        with self.lock:
            self.count += 1
            return self.count

    def prepare(self) -> Path:
        if self.args.template is not None:
            return self.args.template
        where = self.work / "template"
        p = self.zygote.spawn(["prepare", "--preset", "andrea-tiny", "--run-dir", str(where)], {},
                              self.work / "prepare.log")
        if p.wait(600) != 0:
            raise SystemExit(f"andrea prepare failed:\n{p.output()[-3000:]}")
        return where

    def s3(self) -> S3Server:
        me = threading.get_ident()
        if me not in self.servers:
            server = S3Server(self.work / f"s3-{len(self.servers)}").start()
            with self.lock:
                self.servers[me] = server
        return self.servers[me]

    def close(self) -> None:
        self.zygote.close()
        for server in self.servers.values():
            server.stop()

    # --- one sequence ---------------------------------------------------------------------------------------------
    def sequence(self, d: Draw, events: tuple[Event, ...]) -> tuple[Record, list[str]]:
        work = self.work / f"seed{d.seed}-{self.next_count()}"
        work.mkdir()
        disk = self.mount(work, d) if any(e.kind == "disk" for e in events) and self.root else None
        failures: list[str] = []
        seq = None
        try:
            try:  # (a store that will not start is the campaign's failure too, not a lost worker)
                seq = Sequence(d, events, work, self.template, self.zygote,
                               server=self.s3() if d.config.replica else None, disk=disk)
                rec = seq.run()
                failures = list(rec.failures) + self.judge(d, events, rec, seq)
            except Exception as e:  # noqa: BLE001 - the campaign's own defect: said as such, the campaign goes on
                import traceback
                (work / "harness-error.txt").write_text(traceback.format_exc())
                rec = seq.rec if seq is not None else Record()
                failures = [f"HARNESS ERROR ({type(e).__name__}: {str(e)[:200]}; {work}/harness-error.txt)"]
                for p in rec.procs:
                    if p.poll() is None:
                        p.kill_all()
        finally:
            if disk is not None:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True)
            if failures and not self.args.keep:  # its logs and directories are the evidence
                self.kept.append(work)
            elif not self.args.keep:
                shutil.rmtree(work, ignore_errors=True)
        return rec, failures

    def mount(self, work: Path, d: Draw) -> Path:
        where = work / "disk"
        where.mkdir()
        data = sum(p.stat().st_size for p in self.template.rglob("*") if p.is_file())
        ckpt = 3 * 4 * 200_000 + 4096  # andrea-tiny's largest: ~170K parameters, w, m and v in float32
        size = 4 * data + (d.config.keep_last + 24) * ckpt + (32 << 20)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"cannot mount a tmpfs for the full disk: {r.stderr.strip()}")
        return where

    def perfect_run(self, d: Draw, events: tuple[Event, ...], poisoned: tuple[int, ...]) -> dict:
        commands = perfect_commands(events, poisoned)
        key = perfect_key(d.config, commands, poisoned)
        with self.lock:
            key_lock = self.key_locks.setdefault(key, threading.Lock())
        with key_lock:
            return self.perfect_once(d, commands, key)

    def perfect_once(self, d: Draw, commands: tuple[Event, ...], key: str) -> dict:
        if key not in self.perfect:
            work = self.work / f"perfect{d.seed}-{self.next_count()}"
            work.mkdir()
            seq = Sequence(d, commands, work, self.template, self.zygote, server=None, perfect=True)
            rec = seq.run()
            final = seq.run_dir / f"step_{d.config.steps:06d}.bin"
            self.perfect[key] = {
                "failures": rec.failures + traceback_failures(rec),
                "sha": sha(final) if final.is_file() else None,
                "settled": settled(readable_entries(seq.run_dir / ".loss.json")),
            }
            shutil.rmtree(work, ignore_errors=True)
        return self.perfect[key]

    # --- the oracle -----------------------------------------------------------------------------------------------
    def judge(self, d: Draw, events: tuple[Event, ...], rec: Record, seq: Sequence) -> list[str]:
        out = traceback_failures(rec)
        if not rec.reached:
            return out
        run = rec.run
        final = run / f"step_{d.config.steps:06d}.bin"
        entries = readable_entries(run / ".loss.json")
        poisoned = tuple(e.at for e in events if e.kind == "poison" and seq.met(e.at))
        ref = self.perfect_run(d, events, poisoned)
        if ref["failures"]:
            return out + [f"the perfect run failed: {'; '.join(ref['failures'])}"]
        if not final.is_file():
            out.append(f"no {final.name} after exit 0 at the target")
        elif sha(final) != ref["sha"]:
            out.append(f"DIFFERENT BYTES: {final.name} differs from the perfect run's")
        marks = [e.get("event") for e in entries if "event" in e]
        if "gap" not in marks:
            mine, theirs = settled(entries), ref["settled"]
            bad = [s for s, v in mine.items() if theirs.get(s) != v]
            missing = [s for s in range(min(mine, default=0), d.config.steps + 1) if s not in mine and s > 0]
            if bad:
                out.append(f"DIFFERENT LEDGER: settled step {bad[0]} differs ({len(bad)} steps)")
            if missing:
                out.append(f"LEDGER HOLE: settled steps {missing[:5]} missing")
        last = {m: max((i for i, x in enumerate(marks) if x == m), default=-1) for m in ("replica_down", "replica_back")}
        holds = (remote.read_status(run) or {}).get("step")
        if last["replica_down"] > last["replica_back"] and holds is not None and holds >= d.config.steps:
            out.append(f"REPLICA DOWN LEFT STANDING: the ledger's last replica marker is replica_down, yet the "
                       f"replica holds step {holds}")
        pivots = sum(1 for k in rec.struck if k == "pivot")  # (a branch or --init-from leaves them behind: all lines)
        seen = [json.loads(line).get("event") for line in rec.seen] + marks
        if seen.count("pivot") < pivots:
            out.append(f"a pivot left no `pivot` marker ({seen.count('pivot')} of {pivots})")
        if rec.damaged or {"delete", "branch", "init_from", "restore"} & set(rec.struck):
            out += self.verify(rec)  # (a run nothing touched on disk: the bytes check above says enough)
        return out

    def verify(self, rec: Record) -> list[str]:
        """No damaged checkpoint is trusted: `verify` never says ok of one, and exits 0 iff none is left."""
        left = [Path(p) for p, h in rec.damaged.items() if Path(p).parent == rec.run and Path(p).is_file()
                and sha(Path(p)) == h and Path(p).name.split(".", 1)[1] in CHECKED]
        p = self.zygote.spawn(["verify", str(rec.run)], {}, rec.run.parent / "verify.log")
        rc = p.wait(120)
        text = p.output()
        if rc is None:
            p.kill_all()
            return ["hang: `verify` still running after 120 s"]
        out = []
        if "Traceback (most recent call last)" in text:
            out.append(f"traceback in verify: {last_line(text)}")
        for path in left:
            ckpt = path.parent / (path.name.split(".", 1)[0] + ".bin")
            trusted = [line for line in text.splitlines() if line.startswith(f"ok {ckpt} ")]
            if trusted:
                out.append(f"TRUSTED DAMAGE: verify says ok of {ckpt.name} beside a damaged {path.name}")
        if left and rc == 0:
            out.append(f"verify exit 0 with damaged {[p.name for p in left]} left")
        if not left and rc != 0:
            out.append(f"verify exit {rc} on a run left whole: {last_line(text)}")
        return out

    # --- a seed -----------------------------------------------------------------------------------------------------
    def seed(self, seed: int, only: list[int] | None = None) -> Outcome:
        t = time.time()
        d = draw(seed, recipe=not self.args.plain_recipe)
        events = d.events if only is None else tuple(d.events[i] for i in only)
        rec, failures = self.sequence(d, events)
        o = Outcome(seed, failures, rec.struck, rec.skipped + ([f"end: refused as documented: {rec.refused}"]
                                                                 if rec.answered else []))
        plain = " --plain-recipe" if self.args.plain_recipe else ""
        o.replay = f"python bench/campaign.py --seed {seed}{plain}" + (
            f" --events {','.join(map(str, only))}" if only else "")
        lines = [f"seed {seed}: {describe(d)} | {d.describe(events)}"]
        if self.args.verbose:
            for p in rec.procs:
                took = f"{p.ended - p.spawned:.1f}" if p.ended else "?"
                lines.append(f"    {' '.join(p.argv[:1])} rc={p.rc} {took} s {' '.join(p.signals)}")
            lines.append(f"    struck {rec.struck} skipped {o.skipped}")
        if failures:
            lines.append(f"  FAIL: {'; '.join(failures)}")
            if self.args.shrink > 0 and events:
                kinds = {f.split(":")[0] for f in failures}

                def fails(sub: tuple) -> bool:
                    _, f = self.sequence(d, sub)
                    lines.append(f"    shrink {d.describe(sub)}: {'; '.join(f) or 'holds'}")
                    return bool({x.split(':')[0] for x in f} & kinds)
                small, trials = ddmin(events, fails, self.args.shrink)
                idx = [events.index(e) for e in small]
                o.shrunk = d.describe(small)
                o.replay = f"python bench/campaign.py --seed {seed}{plain} --events {','.join(map(str, idx)) or 'none'}"
                lines.append(f"  shrunk ({trials} trials): {o.shrunk}")
            lines.append(f"  replay: {o.replay}")
        o.seconds = time.time() - t
        lines.append(f"  {o.seconds:.1f} s")
        with self.lock:
            print("\n".join(lines), flush=True)
        return o


# What torchrun's launcher itself prints, never andrea: torch.distributed.launcher.api.launch_agent re-raises the
# SignalException its handler raises when the launcher is sent SIGTERM/SIGINT (after forwarding the signal to the
# workers, which stop cleanly), and ChildFailedError when a worker exits non-zero; torch.distributed.run's main lets
# either end the interpreter, which prints the traceback. andrea has no launcher of its own to end quietly (an
# operator runs torchrun itself: docs/operating.md). So each is expected exactly there: SignalException only from a
# torchrun job the campaign signalled, ChildFailedError only from one that exited non-zero; anywhere else, and any
# other traceback in a job's output (a worker's), is andrea's.
SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException"
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def launchers_own(p, last: str) -> bool:
    """Whether `last`, the last line of a traceback in `p`'s output, is torchrun's expected report (above)."""
    if not p.group:
        return False
    return (last.startswith(SIGNALLED) and bool(p.signals)) or (last.startswith(CHILD_FAILED) and p.rc not in (0, None))


def traceback_failures(rec: Record) -> list[str]:
    out = []
    for p in rec.procs:
        for block in p.output().split("Traceback (most recent call last)")[1:]:
            lines = [line for line in block.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
            last = next((line for line in lines if not line.startswith(":")), "")
            if launchers_own(p, last):
                continue
            name = "torchrun" if p.group else p.argv[0]
            out.append(f"traceback in `{name}`: {last[:200]}")
            break
    return out


def settled(entries: list[dict]) -> dict[int, tuple]:
    return {e["step"]: tuple(json.dumps(e.get(k)) for k in SETTLED) for e in history(entries)}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(d: Draw) -> str:
    c = d.config
    recipe = ("+parts" if c.parts else "") + (" wsd" if c.wsd else "")
    return (f"{c.arch}/{c.optimizer}{recipe} every={c.every} steps={c.steps} keep_last={c.keep_last} "
            f"keep_every={c.keep_every} guard={'on' if c.guard else 'off'}(window={c.window},confirm={c.confirm},"
            f"persist={c.persist}) micro={c.micro} replica={'s3' if c.replica else 'none'} ranks={c.ranks}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0-9", help="seeds to run: 0-199, 17, 3,5,10-12")
    p.add_argument("--seed", type=int, default=None, help="one seed (a replay)")
    p.add_argument("--events", default=None, help="with --seed: only these events of its sequence (0-based; none)")
    p.add_argument("--shrink", type=int, default=12, help="trials a failing seed's shrinking may take (0: none)")
    p.add_argument("--jobs", type=int, default=1, help="sequences run at once (each its own S3 server)")
    p.add_argument("--plain-recipe", action="store_true",
                   help="draw without the 2026 recipe's choices (NorMuon, the parts, wsd): the draws of campaigns "
                        "before them, which the replays of seeds found then name")
    p.add_argument("--verbose", action="store_true", help="print every process of a sequence")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--template", type=Path, default=None, help="a prepared andrea-tiny run directory to copy data from")
    p.add_argument("--json", type=Path, default=None, help="also write every outcome as JSON here")
    args = p.parse_args()
    if os.geteuid() == 0 and os.environ.get(IN_NAMESPACE) != "1" and shutil.which("unshare"):
        return subprocess.call(["unshare", "-m", "--propagation", "private", sys.executable, *sys.argv],
                               env={**os.environ, IN_NAMESPACE: "1"})
    if os.environ.get(IN_NAMESPACE) != "1":
        print("not root: the full-disk events are skipped (a tmpfs needs a mount namespace of its own)", flush=True)
    seeds = [args.seed] if args.seed is not None else parse_seeds(args.seeds)
    only = None
    if args.events is not None:
        only = [] if args.events == "none" else [int(x) for x in args.events.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="andrea-campaign-"))
    print(f"work directory: {work}", flush=True)
    t0 = time.time()
    outcomes: list[Outcome] = []
    drawn: Counter = Counter()
    campaign = Campaign(args, work)
    todo = list(seeds)

    def worker() -> None:
        while True:
            with campaign.lock:
                if not todo:
                    return
                s = todo.pop(0)
            o = campaign.seed(s, only)
            d = draw(s, recipe=not args.plain_recipe)
            with campaign.lock:
                drawn.update(d.events[i].kind for i in (range(len(d.events)) if only is None else only))
                outcomes.append(o)
                if args.json:
                    args.json.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    try:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, args.jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        campaign.close()
        if not args.keep:
            for p in work.iterdir():
                if p not in campaign.kept:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
            if not campaign.kept:
                shutil.rmtree(work, ignore_errors=True)
    outcomes.sort(key=lambda o: seeds.index(o.seed))
    if campaign.kept:
        print(f"the logs of the failing sequences: {work}", flush=True)
    print("\n".join(["", *summary(outcomes, time.time() - t0, drawn)]), flush=True)
    return 1 if any(o.failures for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
