"""The C allocator's settings for training on a CPU: freed memory is kept for the next step, not handed back.

A CPU step allocates and frees the same large tensors every step (activations, their gradients, the loss's
log-probabilities). glibc serves a block above its mmap threshold (128 KiB, raised up to 32 MiB as such blocks
are freed) with a fresh mmap and unmaps it when freed, and it trims the heap's free top back to the kernel: every
step then pays the kernel's page faults and zeroing again for memory it just gave back. `keep_freed_memory` asks
glibc (mallopt) for no mmap and no trim, so the heap grows to the step's peak once and is reused from then on.
Measured on one CPU thread, forward and backward at bench/recipe.py's shape with 32 x 128 tokens: the GPT's step
~10 % shorter, the modern model's 15-20 % (it frees more temporaries per step), for a resident size that stays at
the step's peak instead of returning to it every step (docs/benchmarks.md, "The 2026 recipe").

The settings are process-wide and only change where the C allocator finds memory: no value a computation sees
(torch aligns every tensor to 64 bytes either way). A libc other than glibc has no mallopt to ask: nothing is set.
Reads and writes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_FREED = ((M_MMAP_MAX, 0),                 # no block is served by mmap: every one comes from the heap
              (M_TRIM_THRESHOLD, 2**31 - 1))   # the heap's free top is kept (mallopt takes a C int)


def _libc(function: str):
    """glibc's `function`, or None (another libc, or none found)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Apply KEEP_FREED once per process; whether glibc took every setting (False without glibc)."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in KEEP_FREED)


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (malloc_trim): for a measurement of resident memory that
    must not count what an earlier computation left for reuse (bench/memory.py's baseline). Whether any was."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1
