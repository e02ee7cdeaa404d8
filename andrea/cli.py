"""`python -m andrea …`: the stable command line (scripts, tests and systemd units depend on it).

    train    train (or resume) a run in a run directory
    prepare  prepare a run's data (tokenizer, token files) without training; train's first start does the same
    info     a preset's size and parameter layout, as JSON
    verify   validate checkpoints (a run directory or one file)
    sample   generate text from a checkpoint
    export   a checkpoint as a Hugging Face directory (GPT-2, or Qwen3 for a modern run) or npz
    eval     a checkpoint's multiple-choice accuracy on a HellaSwag-format tasks file (andrea/commands/evaluate.py)
    ctl      talk to a running trainer: checkpoint | stop | status
    restore  bring a run back from its replica (checkpoint.replica) onto an empty disk
    status, pivot, branch, compare, plot: a run's life (andrea/commands/operate.py, with ctl)

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

from andrea.config import load as configload
from andrea.commands import operate
from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.rundir import checkpoint as ckpt, names

DEFAULT_PRESET = "andrea-12m"
log = logging.getLogger("andrea")


def error(message: str) -> None:
    """The one `andrea: error: …` line, in ONE write: under torchrun every worker shares the launcher's stderr,
    and a line written in pieces would interleave with another worker's."""
    sys.stderr.write(f"andrea: error: {message}\n")
    sys.stderr.flush()


def user_errors() -> tuple[type[Exception], ...]:
    from andrea.mixture.bandit import BanditStateError
    from andrea.run.boundary import RunFailed
    from andrea.data.sources import DataError
    from andrea.mixture.policy import PolicyError
    from andrea.rundir.ledger import LedgerError
    from andrea.replica.store import ReplicaError
    from andrea.rundir.runlock import RunLockedError
    from andrea.rundir.sidecars import SidecarError
    return (ckpt.CheckpointError, DataError, RunLockedError, BanditStateError, PolicyError, SidecarError,
            LedgerError, RunFailed, ReplicaError, OSError)


def resolve_config(args: argparse.Namespace, run_dir: Path | None) -> RunConfig:
    """An existing run's run.toml, then --preset, --config and every override on top (later wins)."""
    overrides = list(getattr(args, "set", None) or [])
    for flag, key in (("steps", "train.steps"), ("checkpoint_every", "checkpoint.every"), ("seed", "train.seed"),
                      ("device", "train.device"), ("kernels", "train.kernels")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    saved = run_dir / names.CONFIG_NAME if run_dir is not None else None
    base = configload.read_toml(saved) if saved is not None and saved.exists() else None
    preset = args.preset or (None if args.config or base else DEFAULT_PRESET)
    if base and args.preset:
        overridden = configload.overridden_keys(configload.parse_toml(configload.preset_text(args.preset),
                                                                      f"preset {args.preset}"), base)
        if overridden:
            log.warning("--preset %s: %s keeps its own %s (the run's; --set changes a key deliberately)",
                        args.preset, saved, ", ".join(overridden[:4]) + (" ..." if len(overridden) > 4 else ""))
    return configload.load(preset=preset, config_file=args.config, base=base, overrides=overrides,
                           base_source=str(saved))


def cmd_train(args: argparse.Namespace) -> int:
    from andrea.run.signals import EarlySignals
    early = EarlySignals()  # before the slow imports: a SIGTERM from now on ends in a clean stop
    run_dir = Path(args.run_dir)
    cfg = resolve_config(args, run_dir)
    if run_dir.is_dir():  # an existing run keeps what its checkpoints mean (run/identity.py)
        from andrea.run.identity import check_resume
        saved = run_dir / names.CONFIG_NAME
        check_resume(run_dir, cfg, configload.run_config(run_dir) if saved.exists() else None)
    if (run_dir / names.RESTORING_NAME).exists():
        raise OSError(f"{run_dir}: an interrupted `andrea restore` ({names.RESTORING_NAME}): run it again to complete "
                      "the run directory before training")
    if cfg.checkpoint.replica and os.environ.get("RANK", "0") == "0":  # before anything is written (rank 0)
        from andrea.replica.admit import check_at_start
        warning = check_at_start(cfg.checkpoint.replica, run_dir, bool(run_dir.is_dir()
                                                                        and ckpt.list_checkpoints(run_dir)))
        if warning:
            log.warning("%s", warning)
    init_from = Path(args.init_from) if args.init_from else None
    # Everything that can be refused is refused before the run directory is created or written to.
    check_init_from(init_from)
    from andrea.observe import notify
    notify.check(cfg.notify)  # the notice command's program exists
    import torch

    from andrea.run import devices
    from andrea.parallel.distributed import World, check_batch
    world = World.from_env()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process without them
    check_batch(cfg.train.batch_size, world.size, cfg.train.micro_batch_size)
    device_type, kernels = devices.resolve(cfg.train.device, cfg.train.kernels, world.local_rank, world.distributed)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{run_dir}: cannot create the run directory: {e.strerror}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise OSError(f"{run_dir}: the run directory is not writable")
    device = world.device(torch.device(device_type))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from andrea.run.runtime import TrainingRun
    world.init(device, cfg.watchdog.collective_timeout_s if cfg.watchdog.enabled else None)
    try:
        run = TrainingRun(cfg, run_dir, device=device, kernels=kernels, init_from=init_from, early=early,
                          world=world, accept_ledger_gap=args.accept_ledger_gap)
        return run_async(run.main(cfg.train.steps))
    finally:
        world.close()


def check_init_from(path: Path | None) -> None:
    """--init-from names a file, or a GPT-2 directory holding weights (export.weights_file); checked before the
    run directory is touched (the file itself is validated when the run starts)."""
    if path is None:
        return
    from andrea.model.export import is_weights, weights_file
    if is_weights(path):
        weights_file(path)  # no such file / a directory without weights: one line naming it
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: --init-from: {'not a file' if path.exists() else 'no such file'}")


def run_async(coro) -> int:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        import asyncio
        return asyncio.run(coro)


def cmd_prepare(args: argparse.Namespace) -> int:
    from andrea.commands.prepare import prepare_command
    run_dir = Path(args.run_dir)
    cfg = resolve_config(args, run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{run_dir}: cannot create the run directory: {e.strerror}") from None
    return prepare_command(cfg, run_dir)


def cmd_info(args: argparse.Namespace) -> int:
    """The JSON on stdout; the device-memory estimate (andrea/model/memory.py) also as one line on stderr."""
    from andrea.model import memory
    from andrea.observe.mfu import model_flops_per_token
    from andrea.model.arch import layout_for
    from andrea.model.gpt import n_params
    overrides = list(args.set or [])
    if args.micro_batch_size is not None:
        overrides.append(f"train.micro_batch_size={args.micro_batch_size}")
    if args.activation_checkpointing:
        overrides.append('train.activation_checkpointing="blocks"')
    cfg = configload.load(preset=args.preset if args.preset or args.config else DEFAULT_PRESET,
                          config_file=args.config, overrides=overrides)
    layout = layout_for(cfg.model)
    n = n_params(layout)
    tc = cfg.train
    est = memory.estimate(cfg.model, n, memory.micro_batch_rows(tc.micro_batch_size, tc.batch_size),
                          activation_checkpointing=tc.activation_checkpointing, device=args.device)
    flops = model_flops_per_token(cfg.model, n)  # andrea/observe/mfu.py (PaLM's 6N + 12LHQT)
    print(json.dumps({"preset": args.preset, "arch": cfg.model.arch, "n_params": n, "checkpoint_bytes": ckpt.checkpoint_bytes(n),
                      "flops_per_token": flops, "flops_per_step": flops * tc.batch_size * cfg.model.block_size,
                      "memory": est.as_dict(),
                      "params": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in layout]},
                     indent=1))
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    sys.stderr.write(f"device memory ({args.device}, micro-batch {est.micro_batch_size} of {tc.batch_size} rows, "
                     f"activation checkpointing {est.activation_checkpointing}): parameters {mib(est.parameters)}, "
                     f"gradient {mib(est.gradient)}, m and v {mib(est.adam_m_v)}, activations "
                     f"{mib(est.activations)}, logits {mib(est.logits)}; total {est.total / 2**30:.2f} GiB\n")
    return 0


def expected_n_params(run_dir: Path) -> int | None:
    if not (run_dir / names.CONFIG_NAME).exists():
        return None
    from andrea.model.arch import layout_for
    from andrea.model.gpt import n_params
    return n_params(layout_for(configload.run_config(run_dir).model))


def cmd_verify(args: argparse.Namespace) -> int:
    """Deep validation of each checkpoint, its content checksum included: `ok` (verified), `unverifiable` (valid,
    written before checksums existed), `bad` (one line naming the file and the problem; exit 1). A checkpoint
    retention removes while this runs was never broken: it is reported as `gone`, not as a failure. A run
    directory's prepared token files and tokenizer are checked against data/manifest.json too."""
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
        except ckpt.CheckpointError as e:
            if path.is_dir() and not f.exists():
                print(f"gone {f} (removed by retention while verify ran)")
                continue
            print(f"bad {e}", file=sys.stderr)
            bad += 1
            continue
        if info.checksum == ckpt.VERIFIED:
            print(f"ok {f} step={info.step} n_params={info.n_params} checksum=verified")
        else:
            print(f"unverifiable {f} step={info.step} n_params={info.n_params}: valid, but written before "
                  "checksums (no step_NNNNNN.sum.json)")
    if path.is_dir() and (path / names.DATA_DIR / names.MANIFEST_NAME).exists():  # and what the run reads
        from andrea.data.manifest import verify_tokens
        for status, what, detail in verify_tokens(path):
            print(f"{status} {what}: {detail}", file=sys.stderr if status == "bad" else sys.stdout)
            bad += status == "bad"
    return 1 if bad else 0


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from andrea.data.store import TextCodec
    from andrea.run.trainer import Trainer
    run_dir = Path(args.run_dir)
    cfg = configload.run_config(run_dir)
    trainer = Trainer(cfg, torch.device("cpu"))
    if args.step is None:
        info, _ = ckpt.newest_valid(run_dir, trainer.n)
        if info is None:
            raise ckpt.CheckpointError(f"{run_dir}: no valid checkpoint")
        path = info.path
    else:
        path = run_dir / names.checkpoint_name(args.step)
    step, payload = ckpt.read_payload(path, trainer.n)
    trainer.load(torch.from_numpy(payload))
    codec = TextCodec.load(run_dir / names.TOKENIZER_NAME)
    ids = codec.encode(args.prompt) or [codec.eot]
    [new] = trainer.generate([ids], args.max_new_tokens, temperature=args.temperature, top_k=cfg.sample.top_k,
                             generators=[torch.Generator().manual_seed(args.seed)])
    print(args.prompt + codec.decode(new))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from andrea.model.export import export_run
    print(export_run(Path(args.run_dir), Path(args.out), args.step, args.format))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from andrea.commands.evaluate import cmd_eval as evaluate
    return evaluate(args)


def cmd_restore(args: argparse.Namespace) -> int:
    from andrea.commands.restore import restore
    return restore(args.replica, Path(args.run_dir))


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a TOML file (sections model, train, checkpoint, data, policy, sample)")
    p.add_argument("--preset", help=f"a shipped preset: {', '.join(configload.preset_names())}")
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
    p.add_argument("--accept-ledger-gap", action="store_true",
                   help="resume although .loss.json is not what the checkpoint recorded (cut short, changed): "
                        "continue past the gap, recorded as a `gap` marker")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="prepare a run's data (tokenizer, token files) without training")
    add_config_flags(p)
    p.add_argument("--run-dir", required=True)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("info", help="a preset's size, parameter layout and device-memory estimate (JSON)")
    add_config_flags(p)
    p.add_argument("--micro-batch-size", type=int, metavar="M", help="estimate memory with M rows per pass")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="estimate memory with train.activation_checkpointing = blocks")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: bf16 autocast activations (default); cpu: fp32")
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

    p = sub.add_parser("export", help="a checkpoint as a Hugging Face directory: GPT-2, or Qwen3 for a modern run "
                                        "(or numpy arrays)")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--out", required=True, help="the directory to create (absent or empty)")
    p.add_argument("--format", choices=["safetensors", "npz"], default="safetensors",
                   help="safetensors: HF GPT2LMHeadModel names (default); npz: andrea's layout names")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="a checkpoint's multiple-choice accuracy on a HellaSwag-format tasks file")
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True, metavar="FILE.jsonl",
                   help="JSON Lines: ctx, endings, label per line (HellaSwag's format, e.g. hellaswag_val.jsonl)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line")
    p.add_argument("--batch-size", type=int, metavar="ROWS",
                   help="rows (example endings) per forward (default: eval.batch_rows's, 32)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: the run's train.device")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("restore", help="bring a run back from its replica onto an empty disk")
    p.add_argument("replica", metavar="REPLICA", help="the run's checkpoint.replica: s3://bucket/prefix or a path")
    p.add_argument("--run-dir", required=True, help="the directory to restore into (absent or empty)")
    p.set_defaults(func=cmd_restore)

    operate.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.func is not cmd_prepare:
        from andrea.data import early_stop
        early_stop.release()  # `prepare` alone takes over a signal received while starting
    try:
        return args.func(args)
    except ConfigError as e:
        error(str(e))
        return 2
    except user_errors() as e:
        error(str(e))
        return 1
