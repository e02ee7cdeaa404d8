"""The compile check in the suite: every Triton kernel at every launch configuration the trainer can pick, compiled
for sm_89 on this CPU (andrea/kernels/compile_check.py), and the check's pure parts.

One of the check's three architectures, for the suite's time (each costs about two CPU-minutes, its two compile
workers busy): sm_89, the RTX 4090's, the Ampere-family code path under the tightest shared-memory limit (99 KiB:
the fp32 attention forward uses 96 KiB of it), so a launch configuration that outgrows a block fails here first.
sm_80 compiles the same code under a larger limit; sm_90 (Hopper's wgmma path) and all three together run in
`make compile-check`, and bench/gpu_check.sh compiles and runs them on the GPU itself.

The check runs as `python -m andrea.kernels.compile_check` in a subprocess with TRITON_INTERPRET=0: this session
imported triton under the interpreter (tests/conftest.py), whose kernels are not JITFunctions and cannot be
compiled. Its table (one line per kernel, configuration and arch: shared memory, registers, spills) shows with
`pytest -s`. What is asserted here is derived independently of the check: the kernels are found by scanning the
modules, the expected launch shapes come from the launchers' config functions and the presets.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from andrea.config.load import load, preset_names
from andrea.kernels import compile_check
from andrea.kernels.attention import attention_config
from andrea.kernels.cross_entropy import cross_entropy_block
from andrea.kernels.layernorm import layer_norm_config
from andrea.kernels.muon_update import muon_config
from andrea.kernels.rmsnorm import rms_norm_config
from andrea.kernels.rotary import rotary_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ARCHS = (89,)  # the suite's (module docstring); compile_check.ARCHS holds all three
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check(*args, interpret="0"):
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    return subprocess.run([sys.executable, "-m", "andrea.kernels.compile_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


def _kernel_names() -> set[str]:
    """Every @triton.jit kernel of the kernel modules, whichever mode triton runs in here."""
    import importlib
    names = set()
    for module in compile_check.MODULES:
        for value in vars(importlib.import_module(module)).values():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                names.add(value.fn.__name__)
    return names


def _config(row) -> dict[str, str]:
    return dict(item.split("=", 1) for item in row["config"].split() if "=" in item)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "rows.json"
    result = _check("--json", str(out), "--arch", ",".join(map(str, ARCHS)))
    print(result.stdout)  # the table, for pytest -s
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.gpu_offline
def test_every_kernel_compiles_for_every_arch_within_its_limits(report):
    rows = report["rows"]
    assert report["launch_failures"] == []  # every launch sets enable_fp_fusion; every kernel is launched
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, cc) for k in _kernel_names() for cc in ARCHS}
    for r in rows:
        assert not r["error"], r
        assert 0 < r["regs"] <= 255 and r["regs"] * r["threads"] <= 65536, r
        assert r["shared"] + r["static_shared"] <= compile_check.SHARED_LIMIT[r["arch"]], r
    # the three architectures' per-block limits, as NVIDIA's tuning guides give them
    assert compile_check.SHARED_LIMIT == {80: 166912, 89: 101376, 90: 232448}
    assert set(ARCHS) < set(compile_check.ARCHS)


@pytest.mark.gpu_offline
@pytest.mark.parametrize("preset", preset_names())
def test_each_preset_shape_is_compiled_as_its_launcher_picks_it(report, preset):
    cfg = load(preset).model
    rows = report["rows"]
    head_dim = cfg.n_embd // cfg.n_head
    for cc in ARCHS:
        for dtype, name in DTYPE_NAMES.items():
            attn = attention_config(head_dim, dtype, "cuda")
            fwd = [r for r in rows if r["kernel"] == "_attn_fwd_kernel" and r["arch"] == cc and r["dtype"] == name
                   and _config(r)["HEAD_DIM"] == str(head_dim)]
            assert [(_config(r)["BLOCK_M"], _config(r)["BLOCK_N"]) for r in fwd] == [tuple(map(str, attn.fwd))]
            assert f"w{attn.num_warps} s{attn.num_stages}" in fwd[0]["config"]
            for kernel, tiles in (("_attn_bwd_dkdv_kernel", attn.dkdv), ("_attn_bwd_dq_kernel", attn.dq)):
                assert any(r["kernel"] == kernel and r["arch"] == cc and r["dtype"] == name
                           and _config(r)["HEAD_DIM"] == str(head_dim)
                           and (_config(r)["BLOCK_M"], _config(r)["BLOCK_N"]) == tuple(map(str, tiles)) for r in rows)
            if cfg.arch == "gpt2":
                block, warps, _ = layer_norm_config(1, cfg.n_embd, "cuda")
                for kernel in ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"):
                    assert any(r["kernel"] == kernel and r["arch"] == cc and r["dtype"] == name
                               and _config(r)["BLOCK"] == str(block) and f" w{warps} " in r["config"] for r in rows)
            block, warps = cross_entropy_block(cfg.vocab_size, "cuda")
            for kernel in ("_cross_entropy_fwd_kernel", "_cross_entropy_bwd_kernel"):
                assert any(r["kernel"] == kernel and r["arch"] == cc and r["dtype"] == name
                           and _config(r)["BLOCK"] == str(block) and f" w{warps} " in r["config"] for r in rows)


@pytest.mark.gpu_offline
@pytest.mark.parametrize("preset", [p for p in preset_names() if load(p).model.arch == "modern"])
def test_each_modern_preset_compiles_rms_norm_and_rotary_in_the_dtypes_training_gives_them(report, preset):
    cfg = load(preset).model
    head_dim = cfg.n_embd // cfg.n_head
    for cc in ARCHS:
        # RMSNorm on the fp32 residual stream and per head on the bf16 q and k (QK-norm); rotary both ways on them
        for width, dtype in ((cfg.n_embd, "fp32"), (head_dim, "bf16")):
            block, per_program, warps = rms_norm_config(width, "cuda")
            for kernel in ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"):
                assert any(r["kernel"] == kernel and r["arch"] == cc and r["dtype"] == dtype
                           and _config(r) == dict(ROWS=str(per_program), BLOCK=str(block))
                           and f" w{warps} " in r["config"] and _used_by(r, preset) for r in report["rows"])
        block_t, block_half, warps = rotary_config(head_dim, "cuda")
        for inverse in ("False", "True"):
            assert any(r["kernel"] == "_rotary_kernel" and r["arch"] == cc and r["dtype"] == "bf16"
                       and _config(r) == dict(INVERSE=inverse, BLOCK_T=str(block_t), BLOCK_HALF=str(block_half))
                       and f" w{warps} " in r["config"] and _used_by(r, preset) for r in report["rows"])


@pytest.mark.gpu_offline
@pytest.mark.parametrize("preset", preset_names())
def test_each_preset_compiles_muons_kernels_for_either_nesterov(report, preset):
    block, warps = muon_config("cuda")
    for cc in ARCHS:
        for kernel, nesterov in (("_muon_momentum_kernel", "True"), ("_muon_momentum_kernel", "False"),
                                 ("_muon_apply_kernel", None)):
            assert any(r["kernel"] == kernel and r["arch"] == cc and _config(r)["BLOCK"] == str(block)
                       and f" w{warps} " in r["config"] and _config(r).get("NESTEROV") == nesterov
                       and _used_by(r, preset, "optimizer=muon") for r in report["rows"])


def _used_by(row, preset: str, variant: str = "") -> bool:
    """Whether `preset` (with overrides starting with `variant`) launches the row's compile."""
    return any(p == preset.removeprefix("andrea-") and v.startswith(variant) for p, v in row["uses"])


def test_the_check_refuses_the_interpreter_in_one_line():
    result = _check(interpret="1")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "TRITON_INTERPRET" in result.stderr


def test_ptxas_report_is_parsed_for_both_ptxas_builds():
    ampere = ("ptxas info    : Compiling entry function '_k' for 'sm_80'\nptxas info    : Function properties for _k\n"
              "    0 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads\n"
              "ptxas info    : Used 255 registers, used 1 barriers, 512 bytes smem, 416 bytes cmem[0]\n")
    hopper = ("ptxas-blackwell info    : Function properties for _k\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
              "ptxas-blackwell info    : Used 233 registers, used 1 barriers\n")
    assert compile_check.parse_ptxas(ampere) == dict(regs=255, spill_stores=28, spill_loads=24, static_shared=512)
    assert compile_check.parse_ptxas(hopper) == dict(regs=233, spill_stores=0, spill_loads=0, static_shared=0)
    assert compile_check.parse_ptxas("ptxas fatal")["regs"] is None


@pytest.mark.parametrize("cc", compile_check.ARCHS)
def test_a_block_over_the_shared_limit_or_register_file_fails(cc):
    limit = compile_check.SHARED_LIMIT[cc]
    row = dict(arch=cc, error=None, shared=limit - 512, static_shared=512, regs=255, threads=256)
    assert compile_check.problems(row) == []
    assert "shared memory" in compile_check.problems({**row, "static_shared": 513})[0]
    assert "registers" in compile_check.problems({**row, "threads": 512})[0]
    assert compile_check.problems({**row, "regs": None}) == ["ptxas -v printed no register count"]
    assert compile_check.problems({**row, "error": "CompilationError: x"}) == ["CompilationError: x"]


def test_uses_are_named_by_preset_then_by_the_override_that_selects_them():
    uses = [("tiny", ""), ("tiny", "bias=false"), ("12m", "grad_clip=0"), ("120m", "grad_clip=0")]
    assert compile_check.describe_uses(uses) == "tiny, 12m/120m grad_clip=0"
