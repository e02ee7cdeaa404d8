"""What one does with a run's checkpoints from the command line: `verify`, `sample` from one, `export` one.

verify   deep validation (rundir/checkpoint.py), the content checksum included, and a run directory's prepared
         token files and tokenizer against data/manifest.json: `ok`, `unverifiable`, `gone` lines on stdout, `bad`
         ones on stderr, exit 1 if any is bad.
sample   text generated from a checkpoint (the newest valid one, or --step) on the CPU, on stdout.
export   a checkpoint as a Hugging Face GPT-2 directory or npz (model/export.py); prints the directory.
Reads the run directory; only `export` writes (its --out directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from andrea.config import load as configload
from andrea.errors import UserError
from andrea.rundir import checkpoint as ckpt, names


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
            raise UserError(f"{path}: no step_NNNNNN.bin checkpoints")
    elif path.exists():
        files, n = [path], expected_n_params(path.parent)
    else:
        raise UserError(f"{path}: no such file or directory")
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

    from andrea.config.check import ConfigError
    from andrea.data.store import TextCodec
    from andrea.model.export import pick_checkpoint
    from andrea.model.generate import DivergedModel
    from andrea.control.run.trainer import Trainer
    run_dir = Path(args.run_dir)
    if args.temperature < 0 or args.max_new_tokens < 0:
        raise ConfigError(f"--temperature {args.temperature:g} and --max-new-tokens {args.max_new_tokens} must be >= 0 "
                          "(temperature 0: the most likely token)")
    cfg = configload.run_config(run_dir)
    trainer = Trainer(cfg, torch.device("cpu"))
    path = pick_checkpoint(run_dir, trainer.n, args.step, "sample")  # an invalid newer one: skipped, said
    step, payload = ckpt.read_payload(path, trainer.n)
    trainer.load(torch.from_numpy(payload))
    codec = TextCodec.load(run_dir / names.TOKENIZER_NAME)
    ids = codec.encode(args.prompt) or [codec.eot]
    try:
        [new] = trainer.generate([ids], args.max_new_tokens, temperature=args.temperature, top_k=cfg.sample.top_k,
                                 generators=[torch.Generator().manual_seed(args.seed)])
    except DivergedModel as e:
        raise DivergedModel(f"{path}: {e}") from None
    print(args.prompt + codec.decode(new))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from andrea.model.export import export_run
    print(export_run(Path(args.run_dir), Path(args.out), args.step, args.format, args.average))
    return 0
