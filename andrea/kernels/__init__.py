"""The math that runs on the GPU: each Triton kernel beside its plain-torch reference.

launch.py pins the compiler options every launch passes; compile_check.py compiles every kernel at every launch
configuration the trainer can pick for sm_80 / sm_89 / sm_90 on a CPU (python -m andrea.kernels.compile_check)."""

from andrea.kernels.adamw import adamw_reference, adamw_step
from andrea.kernels.attention import attention, attention_reference
from andrea.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from andrea.kernels.layernorm import layer_norm, layer_norm_reference
from andrea.kernels.muon_update import muon_apply, muon_apply_reference, muon_momentum, muon_momentum_reference
from andrea.kernels.rmsnorm import rms_norm, rms_norm_reference
from andrea.kernels.rotary import rotary, rotary_reference, rotary_tables

__all__ = ["adamw_reference", "adamw_step", "attention", "attention_reference", "cross_entropy",
           "cross_entropy_reference", "layer_norm", "layer_norm_reference", "muon_apply", "muon_apply_reference",
           "muon_momentum", "muon_momentum_reference", "rms_norm", "rms_norm_reference", "rotary", "rotary_reference",
           "rotary_tables"]
