"""Compiler options that every kernel launch passes explicitly; read by the four kernel modules and compile_check.

FP_FUSION is Triton's `enable_fp_fusion`: whether the compiler may contract a * b + c into one FMA (one rounding
instead of two). Triton 3.9's default is on (knobs.language.default_fp_fusion, TRITON_DEFAULT_FP_FUSION unset = True;
CUDAOptions and ptxas's --fmad follow it), and 3.9 warns that the default changes in 3.10. Every bit the kernel tests
and GPU checkpoints were made with came from fused code, so the value is pinned to today's default and passed at
every launch (and in the compile check): a dependency bump cannot change a bit through this knob. The interpreter
ignores it (numpy rounds each op). TRITON_FORCE_DISABLE_FP_FUSION=1 in the environment still wins, as in Triton.
"""

FP_FUSION = True
