"""The seeded campaign's decisions (bench/campaign.py), as pure functions over plain data: no process, file or clock.

- `draw(seed)`: a run configuration and a sequence of events, a pure function of the seed
  (numpy `default_rng(seed)`): the same seed draws the same campaign on every machine, so a seed alone replays it.
  The configuration: arch (gpt2 | modern), optimizer (adamw | muon), checkpoint cadence, `keep_last`,
  `keep_every`, the guard on or off and its windows, micro-batches, a replica (a real S3 server) or none, 1 or 2
  ranks under torchrun, the step target; then, drawn after the events (so a seed keeps the configuration and
  events it drew before this dimension existed; `draw(seed, recipe=False)` is that draw), the 2026 recipe:
  NorMuon in place of a drawn Muon, the modern model's four parts (value embeddings, lambdas, smear, backout), a
  wsd schedule whose warmdown (steps 25 to 40) the run enters. The events, ordered by the step they strike at
  (`at`):
      sigkill, sigterm  the trainer killed / stopped when the run reaches step `at` (or `delay` s after its spawn)
      outage            the S3 server down `seconds` while the trainer trains (a replica only)
      disk              the run directory's filesystem filled to the last byte, then freed (root: a tmpfs)
      poison            step `at` reads loss = NaN (ANDREA_TEST_POISON_STEPS) until a start has met it
      flip, cut         one bit flipped in / the tail cut off a checkpoint file or companion, or the ledger
      delete            a checkpoint deleted (its whole set, or its `.bin` alone)
      pivot             `andrea pivot` with a new policy (a command: the perfect run pivots at the same step)
      branch            `andrea branch` of a retained checkpoint; the run goes on in the branch
      init_from         a fresh directory started with `--init-from` a retained checkpoint; the run goes on there
      restore           the run directory deleted, `andrea restore` from the replica (a replica only)
  An offline event (flip ... restore) strikes a stopped run: the campaign first trains with `--steps at`.
  Choices that depend on what the disk holds then (which checkpoint, which bit) are drawn as fractions `u` in
  [0, 1) and resolved against the listing by `pick`.
- `perfect_commands`, `perfect_key`: what the perfect run (the same commands, no fault) does and depends on: the
  configuration, the poisoned steps, the pivots and the stops before offline events; the campaign runs it once per
  key.
- `ddmin`: the shortest sub-sequence of events that still fails (delta debugging, Zeller 2002), the
  configuration fixed.
- `parse_seeds`: `0-199`, `17`, `3,5,10-12`.
- `summary`: the campaign's table.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

ONLINE = ("sigkill", "sigterm", "outage", "disk")            # strike a trainer that trains
OFFLINE = ("flip", "cut", "delete", "pivot", "branch", "init_from", "restore")  # strike a stopped run
KINDS = ("sigkill", "sigterm", "poison", *ONLINE[2:], *OFFLINE)
NEEDS_REPLICA = ("outage", "restore")
COMMANDS = ("pivot", "poison")  # part of the command: the perfect run does them too
# Relative weights of the kinds drawn (the kills most often: they are what a long run meets most)
WEIGHTS = {"sigkill": 4, "sigterm": 3, "poison": 2, "outage": 1, "disk": 1, "flip": 3, "cut": 2, "delete": 1,
           "pivot": 1, "branch": 1, "init_from": 1, "restore": 1}
FILES = ("bin", "sum.json", "ledger.json", "guard.json", "state.json", ".loss.json")  # what flip/cut may strike
ARMS = ("stdlib-docstrings", "stdlib-code", "pydoc-topics")


@dataclass(frozen=True)
class RunConfig:
    arch: str
    optimizer: str
    every: int            # checkpoint.every
    steps: int            # the step target
    keep_last: int
    keep_every: int
    guard: bool
    window: int           # guard.window
    confirm: int          # guard.confirm_steps
    persist: int          # guard.persist (of guard.persist_window = persist + 2)
    micro: int            # train.micro_batch_size (0: whole batches)
    replica: bool
    ranks: int
    parts: bool = False   # model.value_embeds, resid_lambdas, smear, backout (a modern model only)
    wsd: bool = False     # train.schedule = "wsd": lr held from the warmup's end (20), warmdown 25 to 40

    def sets(self) -> list[str]:
        """The `--set` overrides of every start (and of the perfect run)."""
        out = {"model.arch": f'"{self.arch}"', "train.optimizer": f'"{self.optimizer}"',
               "checkpoint.keep_last": self.keep_last, "checkpoint.keep_every": self.keep_every,
               "guard.enabled": str(self.guard).lower(), "guard.window": self.window,
               "guard.confirm_steps": self.confirm, "guard.persist": self.persist,
               "guard.persist_window": self.persist + 2, "train.micro_batch_size": self.micro,
               "sample.every": 1000000, "train.eval_every": 1000000}
        if self.parts:
            out.update({f"model.{k}": "true" for k in ("value_embeds", "resid_lambdas", "smear", "backout")})
        if self.wsd:
            out.update({"train.schedule": '"wsd"', "train.lr_decay_steps": 40, "train.warmdown_steps": 15})
        return [a for k, v in out.items() for a in ("--set", f"{k}={v}")]


@dataclass(frozen=True)
class Event:
    kind: str
    at: int                            # the step it strikes at (online: reached; offline: `--steps at` first)
    args: tuple[tuple[str, Any], ...] = ()  # kind-specific, sorted (name, value) pairs

    def arg(self, name: str, default: Any = None) -> Any:
        return dict(self.args).get(name, default)

    def label(self) -> str:
        shown = ",".join(f"{k}={_short(v)}" for k, v in self.args)
        return f"{self.kind}@{self.at}" + (f"({shown})" if shown else "")


@dataclass(frozen=True)
class Draw:
    seed: int
    config: RunConfig
    events: tuple[Event, ...]

    def describe(self, events: tuple[Event, ...] | None = None) -> str:
        return " -> ".join(e.label() for e in (self.events if events is None else events)) or "(no event)"


def _short(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else json.dumps(v, separators=(",", ":")) if isinstance(v, dict) \
        else str(v)


def draw_config(rng: np.random.Generator) -> RunConfig:
    every = int(rng.choice([2, 3, 4, 5, 6, 8]))
    return RunConfig(
        arch=str(rng.choice(["gpt2", "modern"])),
        optimizer=str(rng.choice(["adamw", "muon"])),
        every=every,
        steps=int(rng.integers(16, 37)),
        keep_last=int(rng.choice([1, 2, 3, 5])),
        keep_every=int(rng.choice([0, 0, 10, 12, 16])),
        guard=bool(rng.random() < 0.75),
        window=int(rng.choice([8, 16, 50])),
        confirm=int(rng.choice([6, 8, 16, 50])),  # >= persist_window (config/check.py)
        persist=int(rng.choice([2, 3])),
        micro=int(rng.choice([0, 0, 2, 4])),
        replica=bool(rng.random() < 0.4),
        ranks=2 if rng.random() < 0.05 else 1,
    )


def draw_event(rng: np.random.Generator, kind: str, cfg: RunConfig) -> Event:
    at = int(rng.integers(1, cfg.steps))
    args: dict[str, Any] = {}
    if kind in ("sigkill", "sigterm"):
        if rng.random() < 0.2:  # at a random moment of the start itself (imports, checks, the first step)
            args["delay"] = round(float(rng.uniform(0.0, 3.0)), 2)
        else:
            args["jitter"] = round(float(rng.random()), 2)  # a fraction of one step after step `at`
    elif kind == "outage":
        args["seconds"] = round(float(rng.uniform(0.5, 4.0)), 2)
    elif kind == "disk":
        args["seconds"] = round(float(rng.uniform(0.5, 3.0)), 2)
    elif kind == "poison":
        at = int(rng.integers(2, cfg.steps))
    elif kind in ("flip", "cut"):
        args["file"] = str(rng.choice(FILES))
        args["which"] = round(float(rng.random()), 3)  # which checkpoint (0: the newest ... 1: the oldest)
        args["u"] = round(float(rng.random()), 6)      # which bit / where the cut falls
    elif kind == "delete":
        args["which"] = round(float(rng.random()), 3)
        args["bin_only"] = bool(rng.random() < 0.5)
    elif kind in ("branch", "init_from"):
        args["which"] = round(float(rng.random()), 3)
    elif kind == "pivot":
        arm = str(rng.choice(ARMS))
        args["policy"] = {"caps": {arm: 0.5}} if rng.random() < 0.5 else {"floors": {arm: 0.3}}
    return Event(kind, at, tuple(sorted(args.items())))


def draw_recipe(rng: np.random.Generator, cfg: RunConfig) -> RunConfig:
    """The 2026 recipe's choices on a drawn configuration: NorMuon for most drawn Muons, the parts for most modern
    models, wsd for a third of the runs."""
    normuon = cfg.optimizer == "muon" and bool(rng.random() < 0.6)
    parts = cfg.arch == "modern" and bool(rng.random() < 0.6)
    return replace(cfg, optimizer="normuon" if normuon else cfg.optimizer, parts=parts, wsd=bool(rng.random() < 0.3))


def draw(seed: int, recipe: bool = True) -> Draw:
    """The configuration and the event sequence of `seed`: a pure function of it. recipe=False: without the 2026
    recipe's choices (the draw of campaigns before them, which the replays of seeds found then name)."""
    rng = np.random.default_rng(seed)
    cfg = draw_config(rng)
    kinds = [k for k in KINDS if cfg.replica or k not in NEEDS_REPLICA]
    p = np.array([WEIGHTS[k] for k in kinds], dtype=float)
    n = int(rng.integers(1, 4))
    chosen = [str(k) for k in rng.choice(kinds, size=n, p=p / p.sum())]
    events = [draw_event(rng, k, cfg) for k in chosen]
    events.sort(key=lambda e: e.at)  # stable: equal steps keep their drawing order
    if recipe:
        cfg = draw_recipe(rng, cfg)
    return Draw(seed, cfg, tuple(events))


def parse_seeds(text: str) -> list[int]:
    """`0-199`, `17`, `3,5,10-12` -> the seeds, in order."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def pick(which: float, steps: list[int]) -> int | None:
    """The checkpoint a fraction `which` names among `steps` (0: the newest; a half of the draws the newest, where a
    fault hurts most), or None when there is none."""
    if not steps:
        return None
    ordered = sorted(steps, reverse=True)
    if which < 0.5:
        return ordered[0]
    return ordered[min(int((which - 0.5) * 2 * len(ordered)), len(ordered) - 1)]


def perfect_commands(events: tuple[Event, ...], poisoned: tuple[int, ...]) -> tuple[Event, ...]:
    """What the perfect run of `events` does too: the poisoned steps a start met, the pivots, and a `stop` (`train
    --steps at`, then on) at every other offline event's step. A stop is an operator's command, not a fault, and
    not neutral: a checkpoint the guard's gate holds back at a step target is an incident there
    (docs/operating.md), one step before a run that trains on would declare it (campaign seed 367: a stop at 32,
    suspect since a spike at 31, rolled back from 32 where the run without it rolled back from 33)."""
    out = []
    for e in events:
        if e.kind in COMMANDS and (e.kind != "poison" or e.at in poisoned):
            out.append(e)
        elif e.kind in OFFLINE:
            out.append(Event("stop", e.at))
    return tuple(out)


def perfect_key(cfg: RunConfig, events: tuple[Event, ...], poisoned: tuple[int, ...]) -> str:
    """What the perfect run depends on: the configuration, the poisoned steps a start met, the pivots (their
    steps and policies) and the stops, in order. Retention (keep_last, keep_every) and the replica are left out:
    docs/ promise that neither touches what a step computes (the perfect run keeps every checkpoint and has no
    replica)."""
    pivots = [(e.at, e.arg("policy")) for e in events if e.kind == "pivot"]
    stops = [e.at for e in events if e.kind == "stop"]
    bytes_of = {k: v for k, v in asdict(cfg).items() if k not in ("keep_last", "keep_every", "replica")}
    return json.dumps([bytes_of, sorted(poisoned), pivots, stops], sort_keys=True)


def ddmin(events: tuple, fails: Callable[[tuple], bool], budget: int = 12) -> tuple[tuple, int]:
    """A shortest sub-sequence (order kept) of `events` for which `fails` holds, by delta debugging (ddmin); `fails`
    is known to hold for `events`. The empty sequence is tried first (the configuration alone fails). At most
    `budget` trials: (the smallest failing sequence found, the trials made)."""
    current, n, trials = tuple(events), 2, 0
    if current and budget > 0:
        trials += 1
        if fails(()):
            return (), trials
    while len(current) >= 2:
        chunk = -(-len(current) // n)
        subsets = [current[i:i + chunk] for i in range(0, len(current), chunk)]
        complements = [tuple(x for j, s in enumerate(subsets) if j != i for x in s) for i in range(len(subsets))]
        found = None
        for cand, after in [(s, 2) for s in subsets] + ([(c, max(n - 1, 2)) for c in complements] if n > 2 else []):
            if trials >= budget:
                return current, trials
            trials += 1
            if fails(cand):
                found = (cand, after)
                break
        if found is not None:
            current, n = found
        elif n >= len(current):
            break
        else:
            n = min(len(current), 2 * n)
    return current, trials


@dataclass
class Outcome:
    """One sequence run: what failed (empty: it held), what struck, and what it took."""

    seed: int
    failures: list[str] = field(default_factory=list)
    struck: list[str] = field(default_factory=list)    # kinds that struck
    skipped: list[str] = field(default_factory=list)   # "kind: why" for events that could not strike
    seconds: float = 0.0
    shrunk: str = ""
    replay: str = ""


def summary(outcomes: list[Outcome], seconds: float, drawn: Counter) -> list[str]:
    """The campaign's table (markdown): sequences, events of each kind drawn / struck / skipped, failures."""
    struck = Counter(k for o in outcomes for k in o.struck)
    skipped = Counter(s.split(":")[0] for o in outcomes for s in o.skipped)
    failed = [o for o in outcomes if o.failures]
    lines = [f"## Campaign: {len(outcomes)} sequences, {len(failed)} failing, {seconds:.0f} s "
             f"({seconds / max(len(outcomes), 1):.1f} s per sequence)", "",
             "| event | drawn | struck | skipped |", "|---|---:|---:|---:|"]
    for k in KINDS:
        lines.append(f"| {k} | {drawn[k]} | {struck[k]} | {skipped[k]} |")
    lines.append(f"| all | {sum(drawn.values())} | {sum(struck.values())} | {sum(skipped.values())} |")
    if failed:
        lines += ["", "| seed | failure | shrunk sequence | replay |", "|---|---|---|---|"]
        for o in failed:
            lines.append(f"| {o.seed} | {'; '.join(o.failures)[:300]} | {o.shrunk} | `{o.replay}` |")
    return lines
