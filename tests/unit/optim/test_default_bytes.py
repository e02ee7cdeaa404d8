"""The contract's default path (gpt2 + AdamW) and today's modern + Muon keep their bytes through the optimizer
registry and every recipe key added after it: four steps of andrea-tiny on fixed tokens end in the same [w | m | v]
bits as at commit 1bdd016, the commit before the registry (digests recorded in default_bytes.json).

Run as a script, this file prints the digests of whatever `andrea` is first on PYTHONPATH; default_bytes.json
records the command that made them from 1bdd016. One thread, the reference kernels: a pure function of the
machine's fp32 arithmetic, so the check holds on the machine the digests came from (x86-64, torch's CPU kernels);
elsewhere it says so and skips rather than fail on rounding it does not govern.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pytest
import torch

from andrea.config import load as configload
from andrea.control.run.trainer import Trainer

RECORD = Path(__file__).with_name("default_bytes.json")
CASES = {  # name -> overrides of andrea-tiny: every kind of parameter, a warmup that reaches the peak
    "gpt2+adamw": ["train.warmup_steps=2"],
    "modern+muon": ["model.arch=modern", "train.optimizer=muon", "train.warmup_steps=2",
                    "train.muon_weight_decay=0.1"],
}


def digests() -> dict[str, str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, overrides in CASES.items():
            cfg = configload.load(preset="andrea-tiny", overrides=overrides)
            trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
            gen = torch.Generator().manual_seed(0)
            for step in range(4):
                x = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=gen)
                trainer.train_step(step, x, torch.roll(x, -1, dims=1))
            out[name] = hashlib.sha256(trainer.state.buffer.numpy().tobytes()).hexdigest()
        return out
    finally:
        torch.set_num_threads(threads)


def test_the_default_and_muon_paths_end_in_the_bytes_of_the_commit_before_the_registry():
    record = json.loads(RECORD.read_text())
    if platform.machine() != record["machine"]:
        pytest.skip(f"digests recorded on {record['machine']}, this is {platform.machine()}")
    assert digests() == record["digests"]


if __name__ == "__main__":
    print(json.dumps({"machine": platform.machine(), "digests": digests()}, indent=1))
