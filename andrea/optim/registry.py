"""The optimizers, one table: a name (`train.optimizer`) → its update, what m and v hold for it, the keys it reads.

Plain data, no torch: the schema (andrea/config/schema.py) checks train.optimizer against `OPTIMIZERS` and words its
error from it, docs/formats.md's m/v table is generated from it (`mv_table`; `python -m andrea.optim.registry
--write` rewrites the block between its markers, `--check` says whether it differs: tests/unit/optim/
test_registry.py), and the trainer (andrea/control/run/trainer.py `update_fn`) and ZeRO-1
(andrea/control/parallel/zero.py) build the update through `Optimizer.build`, a "module:callable" imported only
then. A new optimizer is one module (its update, called as `update(w, g, m, v, hp)` below) and one entry here.

`Hyper` is what every update gets per step, one value instead of AdamW's eleven keyword arguments copied into each
optimizer: the header step the update produces, the learning rate (the schedule's times the guard's scale), the
AdamW keys and the clip. Reads and writes nothing (`--write` aside).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hyper:
    """One step's hyper-parameters, as the trainer hands them to an update."""

    step: int  # the header step the update produces (AdamW's bias correction uses it)
    lr: float  # train.lr's schedule at the step times the guard's lr scale
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float | None  # None: no clipping
    progress: float = 0.0  # how far the schedule's decay has gone, 0 to 1 (andrea/optim/schedule.py)

    def adamw(self, **changes) -> dict:
        """The keyword arguments of adamw_reference / adamw_step (andrea/kernels/adamw.py), with `changes`."""
        out = {k: v for k, v in asdict(self).items() if k != "progress"}
        out.update(changes)
        return out


@dataclass(frozen=True)
class Holds:
    """One row of the m/v table: for these parameters, what m and v hold."""

    parameters: str
    m: str
    v: str


@dataclass(frozen=True)
class Optimizer:
    name: str
    build: str  # "module:callable", called (layout, train config, adamw function, kernels, device, lo, hi)
    holds: tuple[Holds, ...]
    keys: tuple[str, ...]  # the train.* keys it reads besides lr's schedule and grad_clip
    whole_matrices: str = ""  # "module:function" (layout -> [(offset, numel)]) ZeRO-1 must not cut; "": none
    workspace: str = ""  # "module:function" (layout, device) -> bytes beyond the state (`info`); "": in place
    default: bool = False


ADAMW_KEYS = ("beta1", "beta2", "eps", "weight_decay")
MATRICES = ("the 2-D matrices inside the blocks (`h.i.…`: the GPT's c_attn, c_proj, c_fc, mlp.c_proj; the modern "
            "model's q/k/v/o_proj, gate/up/down_proj and, with model.value_embeds, attn.ve_gate)")
ADAMW_REST = Holds("every other one: embeddings, head, biases, norm gains", "AdamW's first moment",
                   "AdamW's second moment")
MUON_KEYS = ("muon_lr", "muon_momentum", "muon_nesterov", "muon_weight_decay", "muon_ns_steps")
NORMUON_KEYS = ("embed_lr", "head_lr", "lr_width", "embed_beta1", "embed_beta2", "head_beta1", "head_beta2",
                "group_eps", "embed_weight_decay", "head_weight_decay", "normuon_beta2", "muon_momentum_start",
                "muon_momentum_warmup", "muon_momentum_end", "value_embed_lr", "value_embed_weight_decay",
                "resid_lr", "resid_beta1", "resid_beta2", "resid_weight_decay", "x0_lr", "x0_beta1", "x0_beta2",
                "x0_weight_decay", "smear_lr", "smear_beta1", "smear_beta2", "smear_weight_decay")

OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", "andrea.optim.adamw_update:AdamW",
              (Holds("every one", "AdamW's first moment", "AdamW's second moment"),), ADAMW_KEYS, default=True),
    Optimizer("muon", "andrea.optim.muon:MuonAdamW",
              (Holds(MATRICES, "Muon's momentum (β = `train.muon_momentum`)", "0 (Muon keeps nothing else per element)"),
               ADAMW_REST), ADAMW_KEYS + MUON_KEYS,
              whole_matrices="andrea.optim.muon:matrix_spans", workspace="andrea.optim.muon:workspace_bytes"),
    Optimizer("normuon", "andrea.optim.normuon:NorMuon",
              (Holds(MATRICES, "Muon's momentum (β scheduled: `train.muon_momentum_start` → `muon_momentum` → "
                     "`muon_momentum_end`)",
                     "NorMuon's second moment (β = `train.normuon_beta2`) in its first max(rows, cols) elements, one per "
                     "index of the long side (per row of a square matrix; each part's, of a fused one); 0 after"),
               Holds("the embeddings (wte, a gpt2's wpe) and the head", "AdamW's first moment (their own β1)",
                     "AdamW's second moment (their own β2)"),
               Holds("the modern model's parts: value_embeds.i, lambdas.resid, lambdas.x0, smear.*, backout.lam",
                     "AdamW's first moment (their group's β1: `train.resid_beta1`, `x0_beta1`, `smear_beta1`; the "
                     "value embeddings', `embed_beta1`)", "AdamW's second moment (their group's β2)"),
               Holds("every other one: biases, norm gains", "AdamW's first moment", "AdamW's second moment")),
              ADAMW_KEYS + MUON_KEYS + NORMUON_KEYS,
              whole_matrices="andrea.optim.muon:matrix_spans", workspace="andrea.optim.muon:workspace_bytes"),
)}


def get(name: str) -> Optimizer:
    return OPTIMIZERS[name]


def problem(name: str) -> str | None:
    """The one-line error for a train.optimizer that is not registered, else None."""
    if name in OPTIMIZERS:
        return None
    names = list(OPTIMIZERS)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"train.optimizer={name!r} must be {listed}"


def resolve(path: str):
    """"module:attr" → the object (imported now: the optimizers' modules need torch, this one does not)."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def build(name: str, layout, tc, adamw, kernels: str, device, lo: int = 0, hi: int | None = None):
    """The update of the flat range [lo, hi) for optimizer `name`, called as `update(w, g, m, v, hp)`."""
    return resolve(get(name).build)(layout, tc, adamw, kernels, device, lo, hi)


def spans(name: str, layout) -> list[tuple[int, int]] | None:
    """(offset, numel) of the blocks a ZeRO-1 shard boundary must not cut, or None when any cut will do."""
    path = get(name).whole_matrices
    return resolve(path)(layout) if path else None


def workspace(name: str, layout, device: str) -> int:
    """Device bytes the update holds beyond the state at its peak; 0 for an update in place."""
    path = get(name).workspace
    return resolve(path)(layout, device) if path else 0


# --- docs/formats.md's table ----------------------------------------------------------------------------------------

BEGIN = "<!-- optimizer-table: generated by `python -m andrea.optim.registry --write` from andrea/optim/registry.py -->"
END = "<!-- end of optimizer-table -->"
FORMATS = Path(__file__).resolve().parents[2] / "docs" / "formats.md"


def mv_table() -> str:
    """The Markdown table of what m and v hold, one row per (optimizer, parameters)."""
    lines = ["| `train.optimizer` | parameters | m | v |", "|---|---|---|---|"]
    for o in OPTIMIZERS.values():
        label = f"`{o.name}`" + (" (default)" if o.default else "")
        lines += [f"| {label} | {h.parameters} | {h.m} | {h.v} |" for h in o.holds]
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (docs/formats.md) with the block between BEGIN and END replaced by `mv_table()`."""
    head, sep, rest = text.partition(BEGIN + "\n")
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    return head + BEGIN + "\n" + mv_table() + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m andrea.optim.registry", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/formats.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/formats.md's table differs")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print(mv_table())
        return 0
    text = FORMATS.read_text()
    new = with_table(text)
    if args.check:
        return 0 if new == text else 1
    FORMATS.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
