"""`python -m andrea train`: what is refused before the run directory is touched, then the run (control/run/runtime.py).

Refused, in this order, each one `andrea: error:` line and nothing written: a configuration that does not resume
the run's (control/run/identity.py), an interrupted `andrea restore`, a bad replica (control/replica/replicator.py), a bad
--init-from, a notice command that does not exist, a batch the ranks cannot split, a device or kernels the machine
cannot run; then the run directory is created and the run starts. A run already at its target step (train.steps,
which run.toml keeps) trains nothing: one line on stdout saying so and how to go further, exit 0
(control/run/target.py; under torchrun rank 0 reads its checkpoints once the process group is joined, and every
rank follows). Heavy imports (torch) come after the early signal handlers: a SIGTERM from the first moment on ends
in a clean stop.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from andrea.commands.run_config import make_run_dir, resolve_config
from andrea.config import load as configload
from andrea.rundir import checkpoint as ckpt, names

log = logging.getLogger("andrea")


def cmd_train(args: argparse.Namespace) -> int:
    from andrea import testhooks
    from andrea.control.run.early_signals import EarlySignals
    from andrea.control.run.signals import HANDLED
    from andrea.control.run.start_deadline import GRACE_S, StartDeadline
    # before the slow imports: a SIGTERM from now on ends in a clean stop, or within GRACE_S if the start is blocked
    early = EarlySignals(HANDLED, StartDeadline(testhooks.start_grace() or GRACE_S))  # andrea/testhooks.py
    run_dir = Path(args.run_dir)
    cfg = resolve_config(args, run_dir, check=lambda cfg: check_existing(run_dir, cfg))
    if (run_dir / names.RESTORING_NAME).exists():
        raise OSError(f"{run_dir}: an interrupted `andrea restore` ({names.RESTORING_NAME}): run it again to complete "
                      "the run directory before training")
    if cfg.checkpoint.replica and os.environ.get("RANK", "0") == "0":  # before anything is written (rank 0)
        from andrea.control.replica.admit import check_at_start
        warning = check_at_start(cfg.checkpoint.replica, run_dir, bool(run_dir.is_dir()
                                                                        and ckpt.list_checkpoints(run_dir)))
        if warning:
            log.warning("%s", warning)
    init_from = Path(args.init_from) if args.init_from else None
    # Everything that can be refused is refused before the run directory is created or written to.
    check_init_from(init_from, cfg, run_dir)
    if init_from is None and int(os.environ.get("WORLD_SIZE", "1")) == 1 and run_dir.is_dir():
        from andrea.control.run import target  # a run at its target trains nothing: one line, how to go further
        step = target.reached(run_dir, cfg.train.steps)
        if step is not None:
            print(target.note(run_dir, step, cfg.train.steps, from_flag=args.steps is not None), flush=True)
            return 0
    from andrea.data.preparation import anchor_paths
    anchor_paths(cfg.data, run_dir / names.DATA_DIR)  # run.toml records where a new source is, absolutely
    from andrea.control.observe import notify
    notify.check(cfg.notify)  # the notice command's program exists
    import torch

    from andrea.control.run import devices
    from andrea.control.parallel.distributed import World, check_batch
    world = World.from_env()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process without them
    check_batch(cfg.train.batch_size, world.size, cfg.train.micro_batch_size)
    device_type, kernels = devices.resolve(cfg.train.device, cfg.train.kernels, world.local_rank, world.distributed)
    make_run_dir(run_dir)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise OSError(f"{run_dir}: the run directory is not writable")
    device = world.device(torch.device(device_type))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from andrea.control.run.runtime import TrainingRun
    world.init(device, cfg.watchdog.collective_timeout_s if cfg.watchdog.enabled else None)
    try:
        if init_from is None and world.distributed:  # under torchrun rank 0's checkpoints decide, for every rank
            from andrea.control.run import target
            step = target.agreed(run_dir, cfg.train.steps, world)
            if step is not None:
                if world.leader:
                    print(target.note(run_dir, step, cfg.train.steps, from_flag=args.steps is not None), flush=True)
                return 0
        run = TrainingRun(cfg, run_dir, device=device, kernels=kernels, init_from=init_from, early=early,
                          world=world, accept_ledger_gap=args.accept_ledger_gap)
        return run_async(run.main(cfg.train.steps))
    finally:
        world.close()


def check_existing(run_dir: Path, cfg) -> None:
    """An existing run keeps what its checkpoints mean (control/run/identity.py)."""
    if run_dir.is_dir():
        from andrea.rundir.inspect import refuse_special_files
        refuse_special_files(run_dir)  # a FIFO at a run file's name: refused before anything opens it
        from andrea.control.run.identity import check_resume
        saved = run_dir / names.CONFIG_NAME
        check_resume(run_dir, cfg, configload.run_config(run_dir) if saved.exists() else None)


def check_init_from(path: Path | None, cfg, run_dir: Path) -> None:
    """--init-from names a file, or an exported directory holding weights (model/init_from.py); checked before the
    run directory is touched: the weights' config.json describes this run's model, a checkpoint's run means by
    its bytes what this run does, its tokenizer too where this run's is known yet (control/run/identity.py; one
    trained at the start is checked there). The tensors themselves are read when the run starts."""
    if path is None:
        return
    from andrea.model.init_from import check_config, is_weights, weights_file
    if is_weights(path):
        check_config(weights_file(path), cfg.model)  # no such file, no weights, another model: one line naming it
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: --init-from: {'not a file' if path.exists() else 'no such file'}")
    else:
        from andrea.control.run.identity import check_init_from as same_identity, run_tokenizer_sha256
        same_identity(path, cfg, run_tokenizer_sha256(run_dir, cfg))


def run_async(coro) -> int:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        import asyncio
        return asyncio.run(coro)
