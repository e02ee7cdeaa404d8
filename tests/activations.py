"""What autograd keeps for the backward, measured: the bytes a forward saves, for the memory-estimate and
activation-checkpointing tests of either architecture (tests/e2e/test_microbatch.py, tests/unit/model/test_modern.py)."""

from __future__ import annotations

import torch


def saved_bytes(trainer, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd holds for the backward after a forward (distinct storages; parameters excluded)."""
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.model(x, y)
    return sum(b for p, b in storages.items() if p not in params)
