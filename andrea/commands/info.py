"""`python -m andrea info`: a preset's size, parameter layout, FLOPs and device-memory estimate.

The JSON on stdout (n_params, checkpoint_bytes, flops_per_token and _per_step, memory, params); the memory
estimate (model/memory.py) also as one line on stderr. Reads the configuration only; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

from andrea.commands.run_config import DEFAULT_PRESET, say_default_preset
from andrea.config import load as configload
from andrea.rundir import checkpoint as ckpt


def cmd_info(args: argparse.Namespace) -> int:
    from andrea.model import memory
    from andrea.control.observe.mfu import model_flops_per_token
    from andrea.model.arch import layout_for
    from andrea.model.gpt import n_params
    from andrea.optim import registry
    overrides = list(args.set or [])
    if args.micro_batch_size is not None:
        overrides.append(f"train.micro_batch_size={args.micro_batch_size}")
    if args.activation_checkpointing:
        overrides.append('train.activation_checkpointing="blocks"')
    preset = args.preset if args.preset or args.config else DEFAULT_PRESET
    if preset != args.preset:
        say_default_preset()
    cfg = configload.load(preset=preset, config_file=args.config, overrides=overrides)
    layout = layout_for(cfg.model)
    n = n_params(layout)
    tc = cfg.train
    workspace = registry.workspace(tc.optimizer, layout, args.device)  # 0: an update in place (AdamW)
    est = memory.estimate(cfg.model, n, memory.micro_batch_rows(tc.micro_batch_size, tc.batch_size),
                          activation_checkpointing=tc.activation_checkpointing, device=args.device,
                          optimizer_workspace=workspace)
    flops = model_flops_per_token(cfg.model, n)  # andrea/control/observe/mfu.py (PaLM's 6N + 12LHQT)
    print(json.dumps({"preset": preset, "arch": cfg.model.arch, "n_params": n,
                      "checkpoint_bytes": ckpt.checkpoint_bytes(n),
                      "flops_per_token": flops, "flops_per_step": flops * tc.batch_size * cfg.model.block_size,
                      "memory": est.as_dict(),
                      "params": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in layout]},
                     indent=1))
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    sys.stderr.write(f"device memory ({args.device}, micro-batch {est.micro_batch_size} of {tc.batch_size} rows, "
                     f"activation checkpointing {est.activation_checkpointing}): parameters {mib(est.parameters)}, "
                     f"gradient {mib(est.gradient)}, m and v {mib(est.adam_m_v)}, activations "
                     f"{mib(est.activations)}, logits {mib(est.logits)}"
                     + (f", optimizer workspace {mib(workspace)} (after the backward)" if workspace else "")
                     + f"; total {est.total / 2**30:.2f} GiB\n")
    return 0
