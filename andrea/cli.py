"""`python -m andrea …`: the stable command line (scripts, tests and systemd units depend on it).

    train    train (or resume) a run in a run directory
    info     a preset's size and parameter layout, as JSON
    verify   validate checkpoints (a run directory or one file)
    sample   generate text from a checkpoint
    export   a checkpoint as a Hugging Face GPT-2 directory (model.safetensors, config, tokenizer) or npz
    ctl      talk to a running trainer: checkpoint | stop | status
    status, pivot, branch, compare, plot: a run's life (andrea/ops.py)

Every user error is one line on stderr, `andrea: error: …`, and a non-zero exit: 2 for a bad configuration
or command line, 1 for anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from andrea import checkpoint as ckpt
from andrea import config as config_mod
from andrea import ops
from andrea.config import ConfigError, RunConfig

DEFAULT_PRESET = "andrea-12m"
log = logging.getLogger("andrea")


def error(message: str) -> None:
    """The one `andrea: error: …` line, in ONE write: under torchrun every worker shares the launcher's stderr,
    and a line written in pieces would interleave with another worker's."""
    sys.stderr.write(f"andrea: error: {message}\n")
    sys.stderr.flush()


def user_errors() -> tuple[type[Exception], ...]:
    from andrea.control.bandit import BanditStateError, PolicyError
    from andrea.control.ledger import LedgerError
    from andrea.control.runlock import RunLockedError
    from andrea.control.runtime import RunFailed
    from andrea.control.sidecars import SidecarError
    from andrea.data.sources import DataError
    return (ckpt.CheckpointError, DataError, RunLockedError, BanditStateError, PolicyError, SidecarError,
            LedgerError, RunFailed, OSError)


def resolve_config(args: argparse.Namespace, run_dir: Path | None) -> RunConfig:
    """An existing run's run.toml, then --preset, --config and every override on top (later wins)."""
    overrides = list(getattr(args, "set", None) or [])
    for flag, key in (("steps", "train.steps"), ("checkpoint_every", "checkpoint.every"), ("seed", "train.seed"),
                      ("device", "train.device"), ("kernels", "train.kernels")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    saved = run_dir / "run.toml" if run_dir is not None else None
    base = config_mod.read_toml(saved) if saved is not None and saved.exists() else None
    preset = args.preset or (None if args.config or base else DEFAULT_PRESET)
    return config_mod.load(preset=preset, config_file=args.config, base=base, overrides=overrides,
                           base_source=str(saved))


def cmd_train(args: argparse.Namespace) -> int:
    from andrea.control.signals import EarlySignals
    early = EarlySignals()  # before the slow imports: a SIGTERM from now on ends in a clean stop
    run_dir = Path(args.run_dir)
    cfg = resolve_config(args, run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{run_dir}: cannot create the run directory: {e.strerror}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise OSError(f"{run_dir}: the run directory is not writable")
    import torch

    from andrea.distributed import World, check_batch
    from andrea.trainer import resolve_device, resolve_kernels
    world = World.from_env()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process without them
    check_batch(cfg.train.batch_size, world.size)
    device = world.device(resolve_device(cfg.train.device))
    kernels = resolve_kernels(cfg.train.kernels, device)
    if kernels == "triton" and device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from andrea.control.runtime import TrainingRun
    world.init(device)
    try:
        run = TrainingRun(cfg, run_dir, device=device, kernels=kernels,
                          init_from=Path(args.init_from) if args.init_from else None, early=early, world=world)
        return run_async(run.main(cfg.train.steps))
    finally:
        world.close()


def run_async(coro) -> int:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        import asyncio
        return asyncio.run(coro)


def cmd_info(args: argparse.Namespace) -> int:
    from andrea.model import layout_for, n_params
    cfg = config_mod.load(preset=args.preset if args.preset or args.config else DEFAULT_PRESET,
                          config_file=args.config, overrides=args.set or [])
    layout = layout_for(cfg.model)
    n = n_params(layout)
    print(json.dumps({"preset": args.preset, "n_params": n, "checkpoint_bytes": ckpt.checkpoint_bytes(n),
                      "params": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in layout]},
                     indent=1))
    return 0


def expected_n_params(run_dir: Path) -> int | None:
    if not (run_dir / "run.toml").exists():
        return None
    from andrea.model import layout_for, n_params
    return n_params(layout_for(ops.run_config(run_dir).model))


def cmd_verify(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.is_dir():
        files, n = [p for _, p in ckpt.list_checkpoints(path)], expected_n_params(path)
        if not files:
            error(f"{path}: no step_NNNNNN.bin checkpoints")
            return 1
    elif path.exists():
        files, n = [path], expected_n_params(path.parent)
    else:
        error(f"{path}: no such file or directory")
        return 1
    bad = 0
    for f in files:
        try:
            info = ckpt.validate(f, n, deep=True)
            print(f"ok {f} step={info.step} n_params={info.n_params}")
        except ckpt.CheckpointError as e:
            print(f"bad {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from andrea.data.store import TextCodec
    from andrea.trainer import Trainer
    run_dir = Path(args.run_dir)
    cfg = ops.run_config(run_dir)
    trainer = Trainer(cfg, torch.device("cpu"))
    if args.step is None:
        info, _ = ckpt.newest_valid(run_dir, trainer.n)
        if info is None:
            raise ckpt.CheckpointError(f"{run_dir}: no valid checkpoint")
        path = info.path
    else:
        path = run_dir / ckpt.checkpoint_name(args.step)
    step, payload = ckpt.read_payload(path, trainer.n)
    trainer.load(torch.from_numpy(payload))
    codec = TextCodec.load(run_dir / "tokenizer.json")
    ids = codec.encode(args.prompt) or [codec.eot]
    [new] = trainer.generate([ids], args.max_new_tokens, temperature=args.temperature, top_k=cfg.sample.top_k,
                             generators=[torch.Generator().manual_seed(args.seed)])
    print(args.prompt + codec.decode(new))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from andrea.export import export_run
    print(export_run(Path(args.run_dir), Path(args.out), args.step, args.format))
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    from andrea.control import ctl
    return ctl.main(Path(args.run_dir), args.action, timeout=args.timeout)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a TOML file (sections model, train, checkpoint, data, policy, sample)")
    p.add_argument("--preset", help=f"a shipped preset: {', '.join(config_mod.preset_names())}")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one key (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="andrea", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train or resume a run")
    add_config_flags(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, help="the step to stop at, counted from 0 (the final step is checkpointed)")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--kernels", choices=["auto", "torch", "triton"])
    p.add_argument("--init-from", metavar="PATH",
                   help="start from this step_NNNNNN.bin instead of the run's newest checkpoint; or, in a run "
                        "without checkpoints, from weights only (step 0, m = v = 0): a model.safetensors, "
                        "model.npz, pytorch_model.bin or a GPT-2 directory holding one (andrea export's output)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("info", help="a preset's size and parameter layout (JSON)")
    add_config_flags(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="validate checkpoints")
    p.add_argument("path", help="a run directory or one step_NNNNNN.bin")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="a checkpoint as a Hugging Face GPT-2 directory (or numpy arrays)")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--out", required=True, help="the directory to create (absent or empty)")
    p.add_argument("--format", choices=["safetensors", "npz"], default="safetensors",
                   help="safetensors: HF GPT2LMHeadModel names (default); npz: andrea's layout names")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("ctl", help="signal a running trainer or read its state")
    p.add_argument("run_dir")
    p.add_argument("action", choices=["checkpoint", "stop", "status"])
    p.add_argument("--timeout", type=float, default=0.0, help="checkpoint/stop: wait up to this many seconds")
    p.set_defaults(func=cmd_ctl)

    ops.add_commands(sub, add_config_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        error(str(e))
        return 2
    except user_errors() as e:
        error(str(e))
        return 1
