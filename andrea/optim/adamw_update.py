"""AdamW over a range of the flat state (train.optimizer = "adamw", the default): the registry's update around the
kernel.

Reads and updates device memory only. `AdamW(layout, tc, adamw, kernels, device, lo, hi)` binds the layout's decay
mask for [lo, hi) (matrices decay; biases and norm gains do not: model/gpt.py `decay_mask`) to `adamw`, the
kernel or its torch reference (andrea/kernels/adamw.py), and is called as every registered update is,
`update(w, g, m, v, hp)` (andrea/optim/registry.py `Hyper`): one call of the kernel over the whole range, the same
call the trainer made before the registry, so the contract's default path keeps its bytes.
"""

from __future__ import annotations

import torch

from andrea.model.gpt import ParamSpec, decay_mask
from andrea.optim.registry import Hyper


class AdamW:
    def __init__(self, layout: list[ParamSpec], tc, adamw, kernels: str, device: torch.device, lo: int = 0,
                 hi: int | None = None):
        self.adamw = adamw
        self.mask = decay_mask(layout, device)[lo:hi]  # one view, kept: the CPU reference caches plans per mask

    def __call__(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: Hyper) -> torch.Tensor:
        """The update in place; the pre-clip norm of g, a 0-d device tensor."""
        return self.adamw(w, g, m, v, decay_mask=self.mask, **hp.adamw())
