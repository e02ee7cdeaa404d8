"""A run's life from the command line: status, ctl, pivot, branch, compare, plot.

    status   RUN_DIR [--json]              a dozen lines (control/observe/status_view.py), or the whole report, trainer pid
    ctl      RUN_DIR checkpoint|stop|status [--timeout S]   a running trainer: SIGUSR1, SIGTERM, or the status
    pivot    RUN_DIR --policy NEW.toml [--anneal N]   new caps/floors (and a warmdown); a running trainer gets it by
                                           SIGHUP (hot pivot)
    branch   RUN_DIR --step S --to NEW_DIR [--config F] [--set k=v]   an audit branch from step_S.bin
    compare  DIR_A DIR_B [--out PNG]       both loss curves from the branch point; which is lower at the end
                                           (the picture: compare.png in the working directory without --out)
    plot     RUN_DIR --out PNG             the loss curve with resumes, pivots and branches marked
Reads and writes run directories as laid out in rundir/names.py (docs/operating.md); appends markers to
`.loss.json`. A path that is not a run directory (rundir/inspect.py, `run_dir_problem`) is one `andrea: error:`
line naming it, before anything is read or written; `status` of a run that has not reached its first step still
answers (its "state": starting, prepared, empty). With --timeout, `ctl checkpoint` waits for a checkpoint newer
than the one present when it was sent and `ctl stop` waits for the process to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import time
from pathlib import Path

from andrea.errors import UserError
from andrea.config import load as configload
from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.control.mixture import pivot
from andrea.control.guard.decisions import ledger_summary
from andrea.control.observe import status_view
from andrea.data.manifest import data_status
from andrea.rundir import checkpoint as ckpt, incidents, inspect, sidecars
from andrea.control.replica import remote as replica
from andrea.rundir.atomic import write_atomic
from andrea.rundir.names import (CONFIG_NAME, DATA_DIR, LEDGER_NAME, NEXT_POLICY_NAME, STATE_NAME, TOKENIZER_NAME,
                                 WANDB_STATE_NAME, checkpoint_name, companions)
from andrea.rundir.ledger import LossLedger, ema, history, live_markers, marker, read_ledger
from andrea.rundir.runlock import RunLock, is_locked, read_pid


def loss_ema(entries: list[dict]) -> list[tuple[int, float]]:
    return list(zip((e["step"] for e in entries), ema([e["loss"] for e in entries])))


def run_status(run_dir: Path) -> dict:
    """The report of `andrea status` and `andrea ctl RUN_DIR status`, built here only: the live part
    (inspect.status: state, trainer pid, step, checkpoints), then the loss EMA, the bandit's phase and shares, and
    the guard's summary and the last incident of each kind. Before the first step (state starting, prepared or
    empty) the later fields are null."""
    st = inspect.status(inspect.require_run_dir(run_dir))
    entries = read_ledger(run_dir / LEDGER_NAME).entries
    steps = history(entries)
    state = sidecars.read_json(run_dir / STATE_NAME) or {}
    ema = loss_ema(steps)
    evals = live_markers(entries, "eval")
    st.update({"loss_ema": ema[-1][1] if ema else None,
               "val_loss": evals[-1].get("val_loss") if evals else None,  # the newest held-out loss, its step
               "val_step": evals[-1]["step"] if evals else None,
               "pace": status_view.pace(steps, target_step(run_dir)),  # last loss, tokens, s/step, elapsed, ETA
               "phase": state.get("phase"),
               "shares": state.get("shares"), "state_step": state.get("step"),
               "target": (state.get("policy") or {}).get("target"), "target_loss": state.get("target_loss"),
               "guard": ledger_summary(entries),  # incidents, rollbacks, the remedy in force (control/guard/decisions.py)
               "incidents": incidents.last_of_each(entries),  # the newest marker of each kind (rundir/incidents.py)
               "data": data_status(run_dir),  # per arm: tokens, source bytes, epochs (andrea/data/manifest.py)
               "replica": replica_status(run_dir, st),  # checkpoint.replica's newest step and lag, or null
               "mfu": mfu_status(entries, steps),
               "tasks": (live_markers(entries, "tasks") or [None])[-1],  # eval.tasks: the newest score
               "wandb": sidecars.read_json(run_dir / WANDB_STATE_NAME)})  # the W&B run's id, its newest step
    return st


def target_step(run_dir: Path) -> int | None:
    """run.toml's train.steps (the target a plain start trains to); None without a readable one."""
    try:
        steps = configload.read_toml(run_dir / CONFIG_NAME).get("train", {}).get("steps")
    except (OSError, ConfigError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def mfu_status(entries: list[dict], steps: list[dict]) -> dict | None:
    """The newest step entry's MFU and what it is measured against (the newest start or resume marker says: the
    FLOPs per token, the peak and where it came from; null `value` with the reason where there is no peak)."""
    measured = next((e for e in reversed(entries) if e.get("event") in ("start", "resume") and "peak" in e), None)
    if measured is None:
        return None
    return {"value": steps[-1].get("mfu") if steps else None, "flops_per_token": measured["flops_per_token"],
            "peak_flops": measured["peak_flops"], "peak": measured["peak"]}


def replica_status(run_dir: Path, st: dict) -> dict | None:
    """What the replicator last recorded (`.replica.json`: its newest step, lag, last error), the lag in steps
    measured again against the newest local checkpoint; None for a run without a replica."""
    rec = replica.read_status(run_dir)
    if rec is None:
        return None
    local = [s for s, _ in ckpt.list_checkpoints(run_dir)]
    if local and (rec.get("step") or 0) < local[-1]:
        rec["lag_steps"] = local[-1] - (rec.get("step") or 0)
    return rec


def print_status(run_dir: Path, as_json: bool = False) -> int:
    report = run_status(run_dir)
    print(json.dumps(report, indent=1) if as_json else "\n".join(status_view.view(report)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    return print_status(Path(args.run_dir), args.json)


def ctl(run_dir: Path, action: str, timeout: float = 0.0, as_json: bool = False) -> int:
    """`andrea ctl`: signal the trainer running on `run_dir` (checkpoint: SIGUSR1, stop: SIGTERM), or print
    the status report. `stop` is idempotent: a run already stopped (or stopping under another `ctl stop`)
    is success. Every failure is one line: no trainer to checkpoint, or a wait that ran out (and why)."""
    if not timeout >= 0:  # NaN too: refused before any signal is sent
        raise ConfigError(f"--timeout {timeout:g}: must be >= 0 seconds (0: do not wait)")
    inspect.require_run_dir(run_dir)
    if action == "status":
        return print_status(run_dir, as_json)
    st = inspect.status(run_dir)
    if not st["running"] or st["pid"] is None:
        if action == "stop":
            print(f"no trainer is running on {run_dir}: already stopped; newest checkpoint "
                  f"{st['newest_checkpoint'] or 'none'}")
            return 0
        raise ProcessLookupError(f"{run_dir}: no trainer is running on this run directory")
    pid, before, sig = st["pid"], st["newest_checkpoint"], signal.SIGUSR1 if action == "checkpoint" else signal.SIGTERM
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it exited between the status and the signal
        if action == "stop":
            print(f"pid {pid} exited meanwhile: already stopped")
            return 0
        raise ProcessLookupError(f"{run_dir}: the trainer (pid {pid}) exited before it got SIGUSR1") from None
    print(f"sent {sig.name} to pid {pid}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = inspect.status(run_dir)
        if action == "stop" and not now["running"]:
            print(f"stopped; newest checkpoint {now['newest_checkpoint']}")
            return 0
        if action == "checkpoint" and now["newest_checkpoint"] != before:
            print(f"checkpoint {now['newest_checkpoint']}")
            return 0
        time.sleep(0.2)
    if timeout == 0:
        return 0
    why = " (it is stopped, e.g. by SIGSTOP: `kill -CONT` resumes it)" if process_state(pid) == "T" else ""
    if action == "stop":
        raise TimeoutError(f"{run_dir}: pid {pid} has not exited {timeout:g} s after SIGTERM{why}")
    raise TimeoutError(f"{run_dir}: no checkpoint newer than {before} {timeout:g} s after SIGUSR1{why}")


def process_state(pid: int) -> str | None:
    """The one-letter state of a process (`ps` STAT's first letter; T: stopped), None when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cmd_ctl(args: argparse.Namespace) -> int:
    return ctl(Path(args.run_dir), args.action, timeout=args.timeout, as_json=args.json)


def cmd_pivot(args: argparse.Namespace) -> int:
    run_dir, policy_file = Path(args.run_dir), Path(args.policy)
    cfg = configload.run_config(run_dir)
    raw, text = configload.read_toml(policy_file), policy_file.read_bytes()
    if args.anneal is not None:  # a polish pivot: the policy file's [anneal] table, added (control/mixture/pivot.py)
        if "anneal" in raw:
            raise ConfigError(f"{policy_file}: holds an [anneal] table already; --anneal would be a second one")
        raw["anneal"] = {"steps": args.anneal}
        text = text.rstrip(b"\n") + f"\n\n[anneal]\nsteps = {args.anneal}\n".encode()
    new_cfg = pivot.parse_policy(raw, cfg, str(policy_file))
    if is_locked(run_dir):
        pid = read_pid(run_dir)
        write_atomic(run_dir / NEXT_POLICY_NAME, text)
        os.kill(pid, signal.SIGHUP)
        print(f"trainer pid {pid} is running: sent SIGHUP for a hot pivot to {policy_file}")
        return 0
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        info, _ = ckpt.newest_valid(run_dir, _n_params(cfg))
        if info is None:
            raise ckpt.CheckpointError(f"{run_dir}: no valid checkpoint to pivot from")
        state = sidecars.read_json(run_dir / STATE_NAME) or {}
        phase = state.get("phase", 0) + 1 if isinstance(state, dict) else 1
        ledger = LossLedger(run_dir / LEDGER_NAME)
        try:
            ledger.append([pivot.apply_pivot(run_dir, pivot.at_step(new_cfg, info.step), info.step, phase)])
        finally:
            ledger.close()
    finally:
        lock.release()
    n = new_cfg.train.anneal_steps if new_cfg.train.anneal_at == pivot.PENDING else 0
    anneal = f", its lr warming down to min_lr by step {info.step + n}" if n else ""
    print(f"pivoted {run_dir} at {info.path.name}: phase {phase}; the next start trains under the new policy{anneal}")
    return 0


def _n_params(cfg: RunConfig) -> int:
    from andrea.model.arch import layout_for
    from andrea.model.gpt import n_params
    return n_params(layout_for(cfg.model))


def cmd_branch(args: argparse.Namespace) -> int:
    parent, dest, step = Path(args.run_dir), Path(args.to), args.step
    parent_cfg = configload.run_config(parent)
    overrides = list(args.set or [])
    if args.anneal is not None:  # after the user's --set: the anneal's keys win (andrea/optim/schedule.py)
        from andrea.optim.schedule import anneal
        try:
            overrides += anneal(step, args.anneal, parent_cfg.train)
        except ValueError as e:
            raise ConfigError(f"branch: {e}") from None
    cfg = configload.load(base=parent_cfg.to_dict(), config_file=args.config, overrides=overrides,
                          base_source=str(parent / CONFIG_NAME))
    if cfg.checkpoint.replica and cfg.checkpoint.replica == parent_cfg.checkpoint.replica:
        cfg.checkpoint.replica = ""  # a branch is another run: never the parent's replica (--set gives it its own)
        print(f"branch: checkpoint.replica not inherited from {parent} (a branch is another run; "
              "--set checkpoint.replica=... gives it its own)")
    from andrea.control.run.identity import check_branch
    check_branch(parent, cfg)
    n = _n_params(parent_cfg)
    if _n_params(cfg) != n:
        raise ConfigError(f"branch: the new configuration has {_n_params(cfg)} parameters, "
                                     f"{checkpoint_name(step)} has {n}: a branch keeps the model")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest}: already exists and is not an empty directory")
    source = parent / checkpoint_name(step)
    ckpt.validate(source, n, deep=True)
    dest.mkdir(parents=True, exist_ok=True)
    _link_or_copy(source, dest / source.name)
    for companion in companions(parent, step):  # the bandit and the guard as of that checkpoint
        shutil.copy(companion, dest / companion.name)
    shutil.copy(parent / TOKENIZER_NAME, dest / TOKENIZER_NAME)
    (dest / DATA_DIR).mkdir()
    for f in sorted((parent / DATA_DIR).iterdir()):  # token files never change: share them
        _link_or_copy(f, dest / DATA_DIR / f.name)
    write_atomic(dest / CONFIG_NAME, cfg.to_toml().encode())
    entries = [e for e in read_ledger(parent / LEDGER_NAME).entries if e["step"] <= step]
    ledger = LossLedger(dest / LEDGER_NAME)
    try:
        ledger.append(entries + [marker("branch", step, parent=str(parent.resolve()),
                                        config=args.config, overrides=overrides)])
    finally:
        ledger.close()
    print(f"branch {dest} from {source} (step {step}); continue it with: python -m andrea train --run-dir {dest}")
    return 0


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy(src, dst)


def branch_point(a: list[dict], b: list[dict]) -> int:
    """The step where two runs' histories split: a branch marker, else the last step they agree on."""
    for entries in (b, a):
        marks = [e["step"] for e in entries if e.get("event") == "branch"]
        if marks:
            return marks[-1]
    same = 0
    for x, y in zip(history(a), history(b)):
        if x["step"] != y["step"] or x["loss"] != y["loss"]:
            break
        same = x["step"]
    return same


class NoTrainingSteps(UserError, FileNotFoundError):
    """A run whose ledger holds no step yet, given to a command that reads its curve (an OSError: exit 1)."""


def trained_entries(run_dir: Path, what: str) -> list[dict]:
    """The ledger of a run that has recorded at least one step; else one line saying there is nothing to `what`."""
    entries = read_ledger(inspect.require_run_dir(run_dir) / LEDGER_NAME).entries
    if not history(entries):
        raise NoTrainingSteps(f"{run_dir}: no training step in {LEDGER_NAME} yet: nothing to {what}")
    return entries


DEFAULT_COMPARE = "compare.png"  # compare's picture without --out: in the working directory


def cmd_compare(args: argparse.Namespace) -> int:
    dirs = [Path(args.dir_a), Path(args.dir_b)]
    out = check_figure_path(args.out or DEFAULT_COMPARE)
    for d in dirs:  # both paths checked before either ledger is read: the line names the one at fault
        inspect.require_run_dir(d)
    raw = [trained_entries(d, "compare") for d in dirs]
    start = branch_point(*raw)
    shared = start > 0 or any(e.get("event") == "branch" for r in raw for e in r)
    curves = [[e for e in history(r) if e["step"] >= start] for r in raw]
    common = min((c[-1]["step"] for c in curves if c), default=start)
    finals = []
    for d, c in zip(dirs, curves):  # each EMA over the steps from the branch point on, so both average alike
        ema = dict(loss_ema(c))
        at = max((s for s in ema if s <= common), default=None)
        finals.append(ema.get(at))
        print(f"{d}: steps {c[0]['step'] if c else '-'}..{c[-1]['step'] if c else '-'}  "
              f"loss EMA from step {start} at step {common}: {ema.get(at, float('nan')):.4f}")
    if None not in finals:
        point = f"branch point: step {start}" if shared else "no common history (they differ from their first step)"
        if finals[0] == finals[1]:
            print(f"{point}; equal loss EMA at step {common}")
        else:
            lower = dirs[0] if finals[0] < finals[1] else dirs[1]
            print(f"{point}; lower loss EMA at step {common}: {lower} (by {abs(finals[0] - finals[1]):.4f})")
    from andrea.control.observe.plots import plot_compare
    plot_compare(dirs, [[e for e in r if e["step"] >= start] for r in raw], curves, start, common, out)
    print(f"wrote {out}")
    return 0


def check_figure_path(out: str) -> Path:
    """--out, checked before any work: a format matplotlib writes (else exit 2), in a directory (else exit 1)."""
    from andrea.control.observe.plots import figure_format_problem
    path = Path(out)
    problem = figure_format_problem(path)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory (--out names the figure's file)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: no such directory {path.parent}")
    return path


def cmd_plot(args: argparse.Namespace) -> int:
    from andrea.control.observe.plots import plot_run
    run_dir, out = Path(args.run_dir), check_figure_path(args.out)
    plot_run(run_dir, trained_entries(run_dir, "plot"), out)
    print(f"wrote {out}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("status", help="a run at a glance: step and target, loss, pace, ETA, checkpoint, replica, "
                                      "incident (--json: the whole report)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--json", action="store_true", help="print the whole report as one JSON object (for scripts)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ctl", help="signal a running trainer or read its state")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory a trainer runs on")
    p.add_argument("action", choices=["checkpoint", "stop", "status"],
                   help="checkpoint: SIGUSR1 (a checkpoint now, training goes on); stop: SIGTERM (a clean stop); "
                        "status: as `andrea status`")
    p.add_argument("--timeout", type=float, default=0.0, metavar="SECONDS",
                   help="checkpoint/stop: wait up to this many seconds for the checkpoint or the exit (0: do not "
                        "wait)")
    p.add_argument("--json", action="store_true", help="status: the whole report as one JSON object")
    p.set_defaults(func=cmd_ctl)

    p = sub.add_parser("pivot", help="switch a run to new caps and floors (SIGHUP if it is running)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--policy", required=True, metavar="NEW.toml", help="a TOML file with one [policy] table")
    p.add_argument("--anneal", type=int, metavar="N", help="a polish pivot: the lr also warms down from its value "
                   "at the pivot's step to min_lr over N steps, recorded in run.toml (default: no anneal)")
    p.set_defaults(func=cmd_pivot)

    p = sub.add_parser("branch", help="start an audit branch from a checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the parent run directory")
    p.add_argument("--step", type=int, required=True, metavar="S", help="the parent's checkpoint to branch from")
    p.add_argument("--to", required=True, metavar="NEW_DIR", help="the branch's run directory (absent or empty)")
    p.add_argument("--config", metavar="FILE.toml", help="a TOML file layered over the parent's run.toml")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one key of the branch (repeatable)")
    p.add_argument("--anneal", type=int, metavar="N", help="a wsd run's finished model: the branch warms its lr down "
                   "to min_lr over N steps from --step and stops there (default: no anneal)")
    p.set_defaults(func=cmd_branch)

    p = sub.add_parser("compare", help="compare two runs' loss curves from their branch point")
    p.add_argument("dir_a", metavar="DIR_A", help="a run directory (e.g. the parent)")
    p.add_argument("dir_b", metavar="DIR_B", help="another (e.g. its branch)")
    p.add_argument("--out", metavar="PNG", help="the picture to write (default: compare.png in the working directory)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plot", help="plot a run's loss curve with its resumes, pivots and branches")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--out", required=True, metavar="PNG", help="the picture to write (.png, .svg, .pdf, ...)")
    p.set_defaults(func=cmd_plot)
