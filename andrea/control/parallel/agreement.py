"""Ranks that disagree: at each checkpoint under torchrun the ranks compare a digest of the full weights they hold.

Under ZeRO-1 (control/parallel/zero.py) every rank holds all of w, rebuilt by one all-gather after each update, so every
rank's w is the same bytes. A rank whose copy differs at a checkpoint — a silently corrupted GPU, a bit flipped in
memory between the all-gather and the snapshot — would commit a slice no other rank agrees with, and train on from
weights that are not the run's. So before the checkpoint of step S is taken (control/run/boundary.py), each rank hashes its
w[:n] on its training thread (xxh3-128 of the fp32 bytes: one host copy and one pass at memory speed, at the
checkpoint cadence only), the digests are all-gathered (a few dozen bytes each), and `disagreement` decides: equal,
or the ranks outside the majority (ties: the group holding rank 0 is taken as the majority). A disagreement is an
incident (a `rank_mismatch` marker, its notice, and the guard's rollback to its known-good checkpoint, committed
while the ranks agreed: control/guard/decisions.py `declare`); the checkpoint of S is never written. Every rank sees the
same digests and takes the same decision.
Test hook: `ANDREA_TEST_FLIP_WEIGHT=<step>@<rank>` (andrea/testhooks.py) flips one mantissa bit of one weight on
rank <rank> with `flip_one_bit` after the update that reaches header step <step> (control/run/runtime.py).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
import xxhash

def weights_digest(w: torch.Tensor) -> str:
    """xxh3-128 of the weights' fp32 bytes, hex (the rank's copy of w[:n], read back to the host)."""
    host = w.detach().to("cpu", torch.float32).contiguous().numpy()
    return xxhash.xxh3_128_hexdigest(memoryview(host).cast("B"))


def disagreement(digests: list[str]) -> list[int]:
    """The ranks whose digest is not the majority's ([] when all agree); a tie goes to rank 0's group."""
    counts = Counter(digests)
    top = max(counts.values())
    majority = digests[0] if counts[digests[0]] == top else next(d for d in digests if counts[d] == top)
    return [rank for rank, d in enumerate(digests) if d != majority]


def flip_one_bit(w: torch.Tensor, index: int = 0, bit: int = 3) -> None:
    """Flip mantissa bit `bit` of weight `index` in place (finite before, finite after: no value check sees it)."""
    value = w[index:index + 1].to("cpu").numpy().view(np.uint32) ^ np.uint32(1 << bit)
    w[index:index + 1] = torch.from_numpy(value.view(np.float32)).to(w.device)
