"""Where the kernel tests run: CPU tensors under the Triton interpreter, CUDA tensors through compiled kernels.

triton chooses interpreter or compiler once per kernel, when `triton.jit` wraps it at import (triton 3.9
runtime/jit.py reads `knobs.runtime.interpret`), and reads TRITON_INTERPRET as a bool: "1"/"true"/"on" interpret,
"0"/""/"off" compile. tests/conftest.py sets it to "1" unless the environment already chose, so:
- a plain `pytest` anywhere runs the CPU cases under the interpreter and skips the CUDA ones;
- `TRITON_INTERPRET=0 pytest tests/unit/kernels` on a GPU machine (bench/gpu_check.sh) runs the CUDA cases on real
  kernels and skips the CPU ones, which compiled Triton cannot run (no CPU backend: the launchers refuse).
CUDA cases are skipped under the interpreter even with a GPU present: it would run every program in Python on
host copies (minutes per test) and prove nothing about the compiled kernels that ship.

Test modules parametrize over these marks (`pytest.param("cuda", marks=ON_CUDA)`), so each case is decided by
the same two facts, read once here.
"""

import pytest
import torch
import triton

INTERPRET = bool(triton.knobs.runtime.interpret)
HAS_CUDA = torch.cuda.is_available()

ON_CPU = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
ON_CUDA = pytest.mark.skipif(
    INTERPRET or not HAS_CUDA,
    reason="no CUDA device" if not HAS_CUDA else "TRITON_INTERPRET=1: CUDA cases need compiled kernels")

# One fp32 case per device: the CPU case is the interpreter run the suite always had.
DEVICES = [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)]
