"""The divergence guard: what the detector's verdicts mean for the run: keep a known-good point, decide the remedy.

Pure decisions over plain data (no files, no tensors, no clock): the runtime feeds it each step record's
(step, loss, grad_norm) in step order, asks it whether a checkpoint may be committed, and carries out the
rollback it plans. Every rank of a data-parallel run that sees the same global records takes the same
decisions. Its whole state is JSON (`Guard.to_state`), saved beside every checkpoint as the companion
`step_NNNNNN.guard.json` (written by control/run/boundary.py with each checkpoint and control/guard/rollback.py at
a rollback; deleted with its checkpoint by the writer):

    {"version": 2, "step": S,                       the checkpoint this describes (1: from before the seal)
     "detector": {"losses": [...], "grads": [...],  the healthy baseline: newest `window` healthy values
                  "flags": [false, ...]},           anomaly flags of the last `persist_window` records
     "good": {"step": G, "path": "step_000040.bin" | "/abs/file.bin" | null,   newest known-good point
              "detector": {...}},                   (null path: the initial state, re-created from the seed)
     "tentative": [{"step": C, "seen": n, "detector": {...}}],   committed, not yet confirmed good
     "remedy": {"attempts": a, "since": T | null,   rollbacks in the open incident series (opened at step T)
                "data_offset": o, "lr_scale": s},   in force: batch t draws stream key t + o; lr = lr_at(t)·s
                                                    (the trajectory's, not the known-good pointer's: a start
                                                    whose known-good checkpoint is gone keeps them, `repoint`)
     "checksum": "<32 hex digits>"}                 the seal, added by the file side (control/guard/rollback.py,
                                                    rundir/sidecars.py's `seal`): the xxh3-128 of the rest

Detection: control/guard/detector.py (robust bands over the recent healthy values, k-of-m persistence, the
warm-up grace of the gradient norm); this module decides what the detector's verdicts mean for the run.

The final step: a checkpoint the gate holds back at the step target would leave the run short of its target for
good (every restart replays the same steps into the same gate). `hold_target` turns it into an incident, resolved
as any other: a rollback to the known-good point with the remedy, trained again up to the target; after
`max_attempts` the bounded stop names the checkpoint to resume from.

Known-good: a checkpoint is committed only while no incident is pending and the detector is not one anomaly
short of one (`may_commit`); it stays *tentative* until `confirm_steps` later records
have passed without an incident and the detector is quiet again — a divergence is detected a few steps after
it starts, so the checkpoint just before the detection may already be on its way out. Then it becomes the
known-good point (the older one is released to retention). The initial state (or the --init-from /
resumed checkpoint when no guard state exists) is known-good from the start. Retention keeps every tentative
checkpoint, so they are thinned (`thin`) to about TENTATIVE_PER_WINDOW per `confirm_steps`: at a checkpoint every
step, 50 of them would otherwise stay on disk beside keep_last (73 GB at ANDREA-120M). The known-good point then
lags the run by at most confirm_steps + confirm_steps / TENTATIVE_PER_WINDOW steps instead of confirm_steps +
checkpoint.every; a cadence of at least that spacing keeps them all, as before.

Remedy (escalation, as PaLM's and OPT's operators did by hand): every rollback returns to the known-good
point, drops the tentative checkpoints after it and moves the data stream past the batches that led into
the incident (data_offset += T - G, so step G now draws what step T would have drawn). From the second
rollback of one series on, the learning-rate scale is also multiplied by `lr_factor`; the scale stays in
force afterwards (the lower rate is what got the run through). After `max_attempts` rollbacks the next
incident of the series gives up. A series closes when a checkpoint past its incident step is confirmed
good: the attempt count starts again, so a run that heals and diverges weeks later begins with a data skip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from andrea.config.keepers import GuardConfig
# the verdicts are the guard's words too (control/run/boundary.py reads them here)
from andrea.control.guard.detector import HEALTHY, INCIDENT, SUSPECT, Detector, GuardStateError
from andrea.rundir.ledger import live_markers

VERSION = 2  # sealed: its companion carries the checksum of its content (version 1, from before it, has none)
LEGACY_VERSION = 1  # from before the seal (rundir/sidecars.py's UNSEALED_VERSION)
TENTATIVE_PER_WINDOW = 8  # tentative checkpoints kept per confirm_steps (`thin`)


def spacing(confirm_steps: int) -> int:
    """The fewest steps between two kept tentative checkpoints (but the newest two): ~TENTATIVE_PER_WINDOW per
    confirmation window."""
    return max(1, math.ceil(confirm_steps / TENTATIVE_PER_WINDOW))


def thin(tentative: list[dict[str, Any]], gap: int) -> list[dict[str, Any]]:
    """The tentative checkpoints (oldest first) to keep after the newest was added: the newest always (a restart
    resumes from it), the oldest always (the next to be confirmed), and the one before the newest only if it is
    at least `gap` steps past the one before that. Applied at each addition, the kept ones are `gap` apart but the
    newest two."""
    kept = list(tentative)
    while len(kept) >= 3 and kept[-2]["step"] - kept[-3]["step"] < gap:
        del kept[-2]
    return kept


def most_tentative(confirm_steps: int, every: int) -> int:
    """An upper bound on the tentative checkpoints on disk at once, at a checkpoint every `every` steps, for
    sizing a disk (bench/chaos_setup.py): a quiet run's lie within confirm_steps + every of its step."""
    window = confirm_steps + every
    return window // max(every, spacing(confirm_steps)) + 2


@dataclass(frozen=True)
class Plan:
    """What to do about a pending incident: roll back (with a remedy) or give up."""

    give_up: bool
    incident_step: int  # T: the step the incident was detected at (the step left)
    to_step: int  # G: the known-good step to resume from
    to_path: str | None  # its checkpoint (name in the run dir, or an absolute path); None = the initial state
    attempt: int  # 1-based number of this rollback in the series (for give_up: rollbacks already tried)
    remedy: str  # "skip_data" | "skip_data+lr_scale" | "give_up"
    data_offset: int
    lr_scale: float
    reason: str

    def message(self, resume_from: str, advice: str) -> str:
        """The one line of the bounded stop; `advice`: what to change first (`advice` below, for the run's
        optimizer)."""
        tried = f"{self.attempt} rollback{'s' if self.attempt != 1 else ''}"
        return (f"step {self.incident_step}: the run diverged again after {tried} to step {self.to_step} "
                f"(data skipped each time, learning-rate scale now {self.lr_scale:g}): {self.reason}; "
                f"resume from {resume_from} after {advice}")


def advice(optimizer: str, grad_clip: float) -> str:
    """What the bounded stop tells the operator to change, for the optimizer that diverged: the keys that set its
    step sizes (the guard's lr scale multiplies each of them: control/run/trainer.py), and clipping only where it is
    off. Muon's hidden matrices step by train.muon_lr (andrea/optim/muon.py: its orthogonalised update has a fixed
    size, so clipping the gradient does not bound it); train.lr is AdamW's, on every parameter of an AdamW run and on
    the embeddings, head and gains of a Muon run."""
    if optimizer == "muon":
        keys = "lowering train.muon_lr (Muon's hidden matrices) or train.lr (AdamW's embeddings, head and gains)"
    else:
        keys = "lowering train.lr"
    return keys + (" or enabling train.grad_clip" if not grad_clip else "")


class Guard:
    def __init__(self, cfg: GuardConfig, *, good_step: int = 0, good_path: str | None = None,
                 init_from: str | None = None, warmup_steps: int = 0):
        self.cfg = cfg
        self.grace_until = warmup_steps + cfg.window  # header steps up to this one: no grad-norm anomaly
        self.detector = Detector(cfg)
        self.remedy: dict[str, Any] = {"attempts": 0, "since": None, "data_offset": 0, "lr_scale": 1.0}
        self.good: dict[str, Any] = {"step": good_step, "path": good_path, "detector": self.detector.to_state(),
                                     "remedy": dict(self.remedy)}
        if init_from is not None:  # the initial state holds weights imported by --init-from (re-read at a rollback)
            self.good["init_from"] = init_from
        self.tentative: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # an incident awaiting its rollback (never saved: no
        self.last_reason = ""  # checkpoint is taken while one is pending)
        self.recovered: list[int] = []  # steps of confirmations that closed a series, for ledger markers
        self.last_record: tuple[int, float, float] | None = None  # (step, loss, grad norm) last observed

    # --- records -------------------------------------------------------------------------------------------
    def observe(self, step: int, loss: float, grad_norm: float) -> str:
        """Feed the record of header step `step`; returns healthy | suspect | incident."""
        if not self.cfg.enabled:
            return HEALTHY
        if self.pending is not None:
            return INCIDENT  # records after a detected incident belong to the abandoned timeline
        verdict, reason = self.detector.feed(loss, grad_norm, judge_grad=step > self.grace_until)
        self.last_reason = reason or self.last_reason  # the newest anomaly's, for the gate's log line
        self.last_record = (step, loss, grad_norm)
        if verdict == INCIDENT:
            self.pending = {"step": step, "reason": reason, "loss": loss, "grad_norm": grad_norm}
            return verdict
        for t in self.tentative:
            if t["step"] < step:
                t["seen"] += 1
        ready = [t for t in self.tentative if t["seen"] >= self.cfg.confirm_steps]
        if ready and self.detector.quiet:
            newest = ready[-1]
            self.good = {"step": newest["step"], "path": newest["path"], "detector": newest["detector"],
                         "remedy": newest["remedy"]}
            self.tentative = [t for t in self.tentative if t["step"] > newest["step"]]
            since = self.remedy["since"]
            if since is not None and newest["step"] > since:
                self.remedy = {**self.remedy, "attempts": 0, "since": None}
                self.recovered.append(newest["step"])
        return verdict

    # --- checkpoints ---------------------------------------------------------------------------------------
    def may_commit(self) -> bool:
        """The gate: shut while an incident is pending or one more anomaly would make one (with the defaults:
        2 of the last 5 steps). A single anomaly is the noise of one batch — a healthy run has one every few
        hundred steps — and a checkpoint taken then is only tentative anyway: it becomes known-good only after
        `confirm_steps` quiet steps, so a divergence that follows sends the rollback past it."""
        if not self.cfg.enabled:
            return True
        return self.pending is None and sum(self.detector.flags) < max(1, self.cfg.persist - 1)

    def hold_target(self, step: int) -> None:
        """The gate held back the checkpoint of the step target `step`: an incident, rolled back like any other
        (a stop short of the target would be replayed into the same gate by every restart)."""
        self.declare(step, f"the checkpoint of the step target {step} is held back: {self.last_reason}")

    def declare(self, step: int, reason: str) -> None:
        """An incident found outside the records (a held-back target, ranks that disagree on the weights:
        control/parallel/agreement.py): pending at `step`, rolled back as any other. No-op while one is pending or the
        guard is off."""
        if not self.cfg.enabled or self.pending is not None:
            return
        _, loss, grad_norm = self.last_record or (step, math.nan, math.nan)
        self.pending = {"step": step, "reason": reason, "loss": loss, "grad_norm": grad_norm}

    def where_good(self, newest: str | None) -> str:
        """Where the run stands, for the line that says a checkpoint was held back: the known-good point, and the
        newest checkpoint `newest` (the one a restart resumes from) when that is a newer, tentative one."""
        good = self.good["path"]
        said = f"{good}, on disk" if good else "the initial state, which a rollback re-creates"
        if newest is None or newest == good:
            return f"the last good state is {said}"
        return (f"the newest checkpoint is {newest} (a restart resumes from it; tentative until "
                f"{self.cfg.confirm_steps} quiet steps confirm it) and the guard's known-good point {said}")

    def on_checkpoint(self, step: int, path: str) -> dict[str, Any]:
        """A checkpoint of `step` is being committed (the gate was open): track it, return the companion."""
        if self.cfg.enabled and step > self.good["step"]:
            self.tentative = [t for t in self.tentative if t["step"] < step]
            self.tentative.append({"step": step, "path": path, "seen": 0, "detector": self.detector.to_state(),
                                   "remedy": dict(self.remedy)})
            self.tentative = thin(self.tentative, spacing(self.cfg.confirm_steps))
        return self.to_state(step)

    def on_commit_failed(self, step: int) -> None:
        """The commit of `step` failed: that checkpoint is not on disk, so it must never become the known-good
        point (retention would then release the older one a rollback needs)."""
        self.tentative = [t for t in self.tentative if t["step"] != step]

    def protected(self) -> set[int]:
        """Steps retention must keep: the newest known-good point and the tentative ones, each of which may
        become it (with keep_last = 1 retention would otherwise delete a candidate before its confirmation)."""
        steps = {t["step"] for t in self.tentative}
        return steps | {self.good["step"]} if self.good.get("path") is not None else steps

    # --- the remedy ----------------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The decision for the pending incident (pure: the state changes only in `apply`)."""
        assert self.pending is not None, "plan() without a pending incident"
        t, g = self.pending["step"], self.good["step"]
        attempts = self.remedy["attempts"]
        if attempts >= self.cfg.max_attempts:
            return Plan(True, t, g, self.good["path"], attempts, "give_up", self.remedy["data_offset"],
                        self.remedy["lr_scale"], self.pending["reason"])
        attempt = attempts + 1
        scale = self.remedy["lr_scale"] * (self.cfg.lr_factor if attempt >= 2 else 1.0)
        return Plan(False, t, g, self.good["path"], attempt, "skip_data" if attempt == 1 else "skip_data+lr_scale",
                    self.remedy["data_offset"] + max(0, t - g), scale, self.pending["reason"])

    def apply(self, plan: Plan) -> None:
        """The rollback happened: the detector as it was at the good point, the tentative ones gone."""
        self.detector = Detector.from_state(self.cfg, self.good["detector"])
        self.tentative = []
        self.pending = None
        self.remedy = {"attempts": plan.attempt, "since": plan.incident_step if self.remedy["since"] is None
                       else max(self.remedy["since"], plan.incident_step),
                       "data_offset": plan.data_offset, "lr_scale": plan.lr_scale}

    def settle(self, path: str) -> None:
        """The good point now has a checkpoint in the run directory at `path` (the initial state was written)."""
        self.good = {**self.good, "path": path}

    def state_after_give_up(self) -> dict[str, Any]:
        """The companion the good point keeps after the bounded stop: its own state as it was committed, so
        a restart (with a lower learning rate, say) begins a fresh series of attempts from there."""
        return {"version": VERSION, "step": self.good["step"], "detector": dict(self.good["detector"]),
                "good": {k: v for k, v in self.good.items()}, "tentative": [], "remedy": dict(self.good["remedy"])}

    def repoint(self, step: int, path: str) -> None:
        """The known-good checkpoint is gone (control/guard/rollback.py's `load_guard`, which has dropped the
        tentative ones that are gone too): the oldest tentative checkpoint before `step` becomes the known-good
        point, with the detector and the remedy it was committed with; it is the one the run would have confirmed
        first, so the run rolls back where it would have once that happened (campaign seed 400: the good point
        step 6 gone, the tentative 12 on disk, a start from 18 rolled back to 18 where the run that never lost 6
        rolled back to 12). Without one, the checkpoint of `step` resumed from, at `path`, with the detector and
        the remedy as they are. The remedy's data offset and lr scale belong to the trajectory: a rollback to the
        new point keeps the data and rate the run had there."""
        older = [t for t in self.tentative if t["step"] < step]
        if older:
            t = older[0]
            self.good = {"step": t["step"], "path": t["path"], "detector": t["detector"], "remedy": t["remedy"]}
        else:
            self.good = {"step": step, "path": path, "detector": self.detector.to_state(),
                         "remedy": dict(self.remedy)}
        self.tentative = [t for t in self.tentative if t["step"] > self.good["step"]]

    def pivot(self, step: int, path: str) -> None:
        """A pivot changes the data (and so the loss level) on purpose: learn the new level from scratch, and
        take the pivot's checkpoint (committed while quiet, chosen by the operator) as the known-good point,
        so no rollback ever crosses back over the pivot."""
        self.detector = Detector(self.cfg)
        self.good = {"step": step, "path": path, "detector": self.detector.to_state(), "remedy": dict(self.remedy)}
        self.tentative = [t for t in self.tentative if t["step"] > step]

    # --- state ---------------------------------------------------------------------------------------------
    def to_state(self, step: int) -> dict[str, Any]:
        return {"version": VERSION, "step": step, "detector": self.detector.to_state(),
                "good": {k: v for k, v in self.good.items()}, "tentative": [dict(t) for t in self.tentative],
                "remedy": dict(self.remedy)}

    @classmethod
    def from_state(cls, cfg: GuardConfig, d: Any, step: int, source: str, warmup_steps: int = 0) -> "Guard":
        """Restore the guard saved with the checkpoint of `step`; GuardStateError names `source` and the field."""
        try:
            if not isinstance(d, dict):
                raise GuardStateError("not a JSON object")
            if d.get("version") not in (LEGACY_VERSION, VERSION):
                raise GuardStateError(f"field 'version' is {d.get('version')!r}, expected {VERSION}")
            if d.get("step") != step:
                raise GuardStateError(f"field 'step' is {d.get('step')!r}, expected {step}")
            good, remedy = d.get("good"), d.get("remedy")
            if not isinstance(good, dict) or not isinstance(good.get("step"), int):
                raise GuardStateError("field 'good' missing or without an integer 'step'")
            if not isinstance(remedy, dict):
                raise GuardStateError("field 'remedy' missing or not an object")
            g = cls(cfg, good_step=good["step"], good_path=good.get("path"), warmup_steps=warmup_steps)
            g.detector = Detector.from_state(cfg, d.get("detector"))
            g.good = {"step": good["step"], "path": good.get("path"),
                      "detector": Detector.from_state(cfg, good.get("detector")).to_state(),
                      "remedy": _remedy(good.get("remedy"))}
            if good.get("init_from") is not None:
                g.good["init_from"] = str(good["init_from"])
            g.tentative = []
            for t in d.get("tentative", []):
                g.tentative.append({"step": int(t["step"]), "path": str(t["path"]), "seen": int(t["seen"]),
                                    "detector": Detector.from_state(cfg, t["detector"]).to_state(),
                                    "remedy": _remedy(t["remedy"])})
            g.remedy = _remedy(remedy)
            return g
        except GuardStateError as e:
            raise GuardStateError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise GuardStateError(f"{source}: field {e} missing or malformed") from None


def _remedy(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise GuardStateError("remedy: not an object")
    since = d.get("since")
    scale = float(d["lr_scale"])
    if not (0.0 < scale <= 1.0):
        raise GuardStateError(f"remedy.lr_scale={scale} must be in (0, 1]")
    return {"attempts": int(d["attempts"]), "since": None if since is None else int(since),
            "data_offset": int(d["data_offset"]), "lr_scale": scale}


def named_checkpoints(state: Any) -> list[int]:
    """The steps of the run directory's checkpoints a guard state (`to_state`, as read from a companion) names:
    its known-good one and the tentative ones (either may become the point a rollback reads), oldest first.
    Plain data in, tolerant of a malformed state (what it cannot read names nothing: `from_state` reports it)."""
    if not isinstance(state, dict):
        return []
    named = [state.get("good")] + (state.get("tentative") if isinstance(state.get("tentative"), list) else [])
    return sorted({d["step"] for d in named if isinstance(d, dict) and isinstance(d.get("step"), int)
                   and isinstance(d.get("path"), str) and "/" not in d["path"]})


def remedy_in_force(entries: list[dict[str, Any]], step: float = math.inf) -> dict[str, Any] | None:
    """The data offset and lr scale in force at header step `step` by the ledger's record: the newest `rollback`
    marker at or below it that no later start, resume or rollback superseded (`live_markers`); None when there is
    none. The ledger's copy of what each guard companion records (a rollback is the only thing that sets them)."""
    live = [e for e in live_markers(entries, "rollback") if "event" not in e and "data_offset" in e
            and e["step"] <= step]
    return {"data_offset": int(live[-1]["data_offset"]), "lr_scale": float(live[-1].get("lr_scale", 1.0))} \
        if live else None


def ledger_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """What `andrea status` shows of the guard, from the ledger's markers (control/run/ledger_feed.py)."""
    incidents = [e for e in entries if e.get("event") == "incident"]
    rollbacks = [e for e in entries if e.get("event") == "rollback"]
    stops = [e for e in entries if e.get("event") == "guard_stop"]
    last = rollbacks[-1] if rollbacks else None
    # in force: the newest rollback a later start did not supersede (a resume below it runs with its checkpoint's
    # remedy, recorded before that rollback)
    force = remedy_in_force(entries) or {"data_offset": 0, "lr_scale": 1.0}
    keep = ("step", "from", "checkpoint", "attempt", "remedy", "data_offset", "lr_scale")
    return {"incidents": len(incidents), "rollbacks": len(rollbacks),
            "last_incident": {k: incidents[-1].get(k) for k in ("step", "reason")} if incidents else None,
            "last_rollback": {k: last.get(k) for k in keep} if last else None,
            "lr_scale": force["lr_scale"], "data_offset": force["data_offset"],
            "stopped": {k: stops[-1].get(k) for k in ("step", "attempts", "resume_from")} if stops else None}
