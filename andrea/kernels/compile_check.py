"""The compile check: every Triton kernel at every launch configuration the trainer can pick, compiled on a CPU
(no GPU, no driver) for sm_80 (A100), sm_89 (RTX 4090) and sm_90 (H100/H200), with shared memory, registers and
spills per (kernel, configuration, architecture).

Where the configurations come from: nothing here copies a block size. The real launchers (attention_forward and
_backward, layer_norm_forward and _backward for model.arch = gpt2, rms_norm_forward and _backward on the residual
stream and per head (QK-norm) and rotary_apply both ways for model.arch = modern, cross_entropy_forward and
_backward, and the trainer's optimizer update: adamw_step, or Muon's muon_momentum and muon_apply with adamw_step on
the rest) run on meta tensors shaped as each preset's training step, as the model hands them over (q and k as
strided views), and a few config knobs that change a kernel: model.bias, train.grad_clip, train.beta1,
train.optimizer, train.muon_nesterov; attention, LayerNorm and cross-entropy in bf16, fp16 and fp32, RMSNorm and
rotary in the dtypes training gives them (_modern_launches), with each kernel's `run` swapped for a recorder. So
each launch's constexprs, num_warps / num_stages / enable_fp_fusion and scalar arguments are exactly what the
launcher and its config function (attention_config, layer_norm_config, rms_norm_config, rotary_config,
cross_entropy_block, adamw_config, muon_config) produce for that shape. Triton's own binder
(create_function_from_signature + _pack_args, what a real launch specializes with: i32 / i64, divisible by 16,
equal to 1) turns a launch into (signature, constexprs, attributes, options) per target; launches that bind
identically (one kernel shared by presets) are compiled once.

Each compile is `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` in a pool of worker processes,
each compile with a Triton cache of its own (a fresh temporary directory, deleted after it): no earlier compile can
hide a failure. Registers, spill stores/loads and static shared memory are ptxas -v's report from the very run that
built the cubin: Triton always invokes the wheel's ptxas (bin/ptxas, or bin/ptxas-blackwell from sm_90 on) with -v,
and knobs.nvidia.dump_ptxas_log prints that report. (Rerunning ptxas -v with Triton's flags on compiled.asm["ptx"]
gives the same figures, which match cuobjdump --dump-resource-usage on the cubin, at ~15 % more CPU.)
A configuration fails when it does not compile, when dynamic + static shared memory exceed the architecture's
per-block opt-in limit (SHARED_LIMIT), or when its registers cannot fit one block in the 64K register file.

Reads the presets (andrea/presets/*.toml). Writes the table to stdout and, with --json PATH, the rows as JSON.
Run: python -m andrea.kernels.compile_check [--json PATH] [--arch 80,89,90] [--workers 2]; exit 1 on a failure.
Needs compiled kernels (TRITON_INTERPRET unset or 0): the interpreter has no compiler to check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import json
import multiprocessing
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import triton

from andrea.config.load import load, preset_names
from andrea.model.arch import layout_for
from andrea.model.gpt import n_params
from andrea.control.run.trainer import update_fn
from andrea.optim.registry import Hyper

# The kernel modules by import path: the package re-exports functions named like two of them (attention,
# cross_entropy), so attribute access on andrea.kernels would find those instead.
MODULES = ("andrea.kernels.attention", "andrea.kernels.layernorm", "andrea.kernels.cross_entropy",
           "andrea.kernels.adamw", "andrea.kernels.rmsnorm", "andrea.kernels.rotary", "andrea.kernels.muon_update")
ARCHS = {80: "A100", 89: "RTX 4090", 90: "H100/H200"}
# Largest shared memory one block may use (bytes, after cudaFuncSetAttribute opt-in), from NVIDIA's tuning guides
# and the CUDA C++ Programming Guide's per-compute-capability table: A100 (8.0) up to 163 KB per block of its
# 164 KB per SM (Ampere tuning guide, "shared memory"); 8.9 (Ada) 99 KB of 100 KB per SM (Ada tuning guide);
# H100 (9.0) 227 KB of 228 KB per SM (Hopper tuning guide). 1 KB of each SM's is reserved for the system.
# https://docs.nvidia.com/cuda/ampere-tuning-guide/ https://docs.nvidia.com/cuda/ada-tuning-guide/
# https://docs.nvidia.com/cuda/hopper-tuning-guide/
SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGISTER_FILE = 65536  # 32-bit registers per SM (and per block) on 8.0, 8.9 and 9.0
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Config knobs that select a different kernel specialization (HAS_BIAS; HAS_CLIP; AdamW's LERP_FROM_START; Muon's
# kernels and, without Nesterov, its momentum kernel's NESTEROV=False).
VARIANTS = ((), ("model.bias=false",), ("train.grad_clip=0",), ("train.beta1=0",), ("train.optimizer=muon",),
            ("train.optimizer=muon", "train.muon_nesterov=false"))


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its arguments as the launcher passed them, and who launched it."""
    kernel: triton.runtime.JITFunction
    args: tuple
    kwargs: dict
    use: tuple[str, str] = ("", "")  # (preset without "andrea-", config override or "")


@dataclass
class Job:
    """One compile: a kernel bound for one target; `key` identifies identical compiles across uses."""
    module: str
    name: str
    cc: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    config: str
    spec: str
    uses: list[tuple[str, str]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return repr((self.module, self.name, self.cc, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted((k, repr(v)) for k, v in self.options.items())))


def kernels() -> list[triton.runtime.JITFunction]:
    """Every Triton kernel in the kernel modules (JITFunctions only exist with the interpreter off)."""
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        found += [v for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction)]
    return found


@contextlib.contextmanager
def recording(kernel_list):
    """Within: launching any of `kernel_list` records a Launch instead of compiling or running anything."""
    launches: list[Launch] = []

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):  # JITFunction.__getitem__ calls self.run(grid=..., warmup=False)
            launches.append(Launch(kernel, args, kwargs))
        return run

    for k in kernel_list:
        k.run = recorder(k)  # an instance attribute shadows JITFunction.run
    try:
        yield launches
    finally:
        for k in kernel_list:
            del k.run


def trainer_launches(preset: str, overrides: tuple[str, ...] = ()) -> list[Launch]:
    """The launches of one training step of `preset` (+ overrides), the 16-bit and fp32 kernels all included."""
    from andrea.kernels.attention import attention_backward, attention_forward
    from andrea.kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from andrea.kernels.layernorm import layer_norm_backward, layer_norm_forward
    from andrea.kernels.rmsnorm import rms_norm_backward, rms_norm_forward
    from andrea.kernels.rotary import rotary_apply

    cfg = load(preset, overrides=list(overrides))
    m, t = cfg.model, cfg.train
    B, T, C, H, V = t.batch_size, m.block_size, m.n_embd, m.n_head, m.vocab_size
    meta = dict(device="meta")
    with recording(kernels()) as launches:
        for dtype in DTYPES:
            q, k, v = (torch.empty(B, H, T, C // H, dtype=dtype, **meta) for _ in range(3))  # (B, nh, T, hs)
            o, lse = attention_forward(q, k, v)
            attention_backward(torch.empty_like(o), q, k, v, o, lse)
            if m.arch == "gpt2":
                x = torch.empty(B, T, C, dtype=dtype, **meta)
                weight, bias = torch.empty(C, **meta), (torch.empty(C, **meta) if m.bias else None)
                y, x2d, mean, rstd = layer_norm_forward(x, weight, bias)
                layer_norm_backward(torch.empty_like(y), x2d, weight, mean, rstd, bias is not None)
            logits = torch.empty(B * T, V, dtype=dtype, **meta)
            targets = torch.empty(B * T, dtype=torch.int64, **meta)
            loss, lse = cross_entropy_forward(logits, targets)
            cross_entropy_backward(torch.empty_like(loss), logits, targets, lse)
        if m.arch == "modern":
            _modern_launches(B, T, C, H, rms_norm_forward, rms_norm_backward, rotary_apply)
        layout = layout_for(m)
        n = n_params(layout)
        w, g, mom, var = (torch.empty(n, **meta) for _ in range(4))
        # the trainer's optimizer and call (Trainer.train_step): AdamW, or Muon on the hidden matrices and AdamW on the
        # rest; decay mask always, clipping unless grad_clip is 0
        update = update_fn(t, layout, "triton", torch.device("meta"))
        update(w, g, mom, var, Hyper(1, t.lr, t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip or None))
    use = (preset.removeprefix("andrea-"), " ".join(o.split(".", 1)[1] for o in overrides))
    for launch in launches:
        launch.use = use
    return launches


def _modern_launches(B: int, T: int, C: int, n_head: int, rms_norm_forward, rms_norm_backward, rotary_apply) -> None:
    """The modern model's own kernels as andrea/model/modern.py calls them in training on a GPU, in the dtypes they
    get there (one each, not the three: 16 compiles an arch fewer in the suite's compile check): RMSNorm on
    the fp32 residual stream (autocast leaves the embedding and the residual adds in fp32), QK-norm on the bf16 q of
    the projection viewed (B, T, nh, hs), rotary on its (B, nh, T, hs) transpose (strided) and the inverse rotation
    of the contiguous gradient that attention_backward returns into that transpose's layout."""
    meta = dict(device="meta")
    y, x2d, rstd = rms_norm_forward(torch.empty(B, T, C, **meta), 1e-6)  # (B, T, C) fp32
    rms_norm_backward(torch.empty_like(y), x2d, rstd)
    q = torch.empty(B, T, n_head, C // n_head, dtype=torch.bfloat16, **meta)  # (B, T, nh, hs): q_proj under autocast
    q_normed, q2d, rstd = rms_norm_forward(q, 1e-6)
    rms_norm_backward(torch.empty_like(q_normed), q2d, rstd)
    cos, sin = (torch.empty(T, C // n_head // 2, **meta) for _ in range(2))  # (T, hs/2) fp32
    q_rot = rotary_apply(q_normed.transpose(1, 2), cos, sin)  # (B, nh, T, hs)
    rotary_apply(torch.empty_like(q_rot), cos, sin, inverse=True, layout=q_normed.transpose(1, 2))


def bind(launch: Launch, cc: int) -> Job:
    """Specialize a recorded launch for one target exactly as JITFunction.run would on that GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug  # as JITFunction.run
    backend = make_backend(GPUTarget("cuda", cc, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    names = [p.name for p in kernel.params]
    declared = [(names[i], v) for (i,), v in sorted(constexprs.items()) if kernel.params[i].is_constexpr]
    config = " ".join(f"{n}={v}" for n, v in declared) + f" w{options.num_warps} s{options.num_stages}"
    # scalar specializations worth naming: an int the binder made constexpr (== 1) or found not divisible by 16
    spec = [f"{names[i]}=1" for (i,), v in sorted(constexprs.items()) if not kernel.params[i].is_constexpr]
    spec += [f"{names[i]}~16" for (i,), a in sorted(attrs.items()) if signature[names[i]] in ("i32", "i64") and not a]
    return Job(kernel.fn.__module__, kernel.fn.__name__, cc, signature, constexprs, attrs, dict(options.__dict__),
               config, " ".join(spec) or "-", [launch.use])


def all_jobs(archs=tuple(ARCHS)) -> tuple[list[Job], list[str]]:
    """The distinct compiles for every preset, variant and arch; and what the launches themselves get wrong: a
    launch that leaves fp fusion to Triton's default, a kernel that no launch reaches (so nothing checks it)."""
    jobs: dict[str, Job] = {}
    failures: set[str] = set()
    for preset in sorted(preset_names(), key=lambda p: n_params(layout_for(load(p).model))):  # smallest first
        for overrides in VARIANTS:
            for launch in trainer_launches(preset, overrides):
                if "enable_fp_fusion" not in launch.kwargs:
                    failures.add(f"{launch.kernel.fn.__name__}: launched without enable_fp_fusion (Triton's default "
                                 f"changes in 3.10)")
                for cc in archs:
                    job = bind(launch, cc)
                    seen = jobs.setdefault(job.key, job)
                    if seen is not job and launch.use not in seen.uses:
                        seen.uses.append(launch.use)
    for name in sorted({k.fn.__name__ for k in kernels()} - {j.name for j in jobs.values()}):
        failures.add(f"{name}: no launcher call in trainer_launches reaches it, so it is not checked")
    return list(jobs.values()), sorted(failures)


_PTXAS = {"regs": r"Used (\d+) registers", "spill_stores": r"(\d+) bytes spill stores",
          "spill_loads": r"(\d+) bytes spill loads", "static_shared": r"(\d+) bytes smem"}


def parse_ptxas(log: str) -> dict[str, int | None]:
    """ptxas -v's report of one entry function → regs, spill_stores, spill_loads, static_shared (bytes; 0 if
    absent, None where ptxas printed no register count)."""
    found = {k: re.search(p, log) for k, p in _PTXAS.items()}
    out = {k: int(m.group(1)) if m else 0 for k, m in found.items()}
    if found["regs"] is None:
        out["regs"] = None
    return out


def problems(row: dict) -> list[str]:
    """Why a compiled row would not launch on its architecture (empty: it would)."""
    if row.get("error"):
        return [row["error"]]
    out = []
    shared = row["shared"] + row["static_shared"]
    if shared > SHARED_LIMIT[row["arch"]]:
        out.append(f"shared memory {shared} B > {SHARED_LIMIT[row['arch']]} B per block on sm_{row['arch']}")
    if row["regs"] is None:
        out.append("ptxas -v printed no register count")
    elif row["regs"] * row["threads"] > REGISTER_FILE:
        out.append(f"{row['regs']} registers x {row['threads']} threads > {REGISTER_FILE}")
    return out


def compile_job(job: Job) -> dict:
    """Compile one job (in a worker process) → its table row."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = dict(kernel=job.name, arch=job.cc, dtype=job.signature[next(iter(job.signature))].lstrip("*"),
               config=job.config, spec=job.spec, uses=job.uses, threads=32 * job.options["num_warps"],
               limit=SHARED_LIMIT[job.cc], error=None)
    fn = getattr(importlib.import_module(job.module), job.name)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        # Triton always runs ptxas with -v to build the cubin; dump_ptxas_log prints that report (to stdout).
        # A cache of its own per compile: a hit would skip ptxas (and its report) and prove nothing.
        with triton.knobs.nvidia.scope(), triton.knobs.cache.scope(), contextlib.redirect_stdout(log), \
                tempfile.TemporaryDirectory(prefix="andrea-compile-check-") as cache_dir:
            triton.knobs.nvidia.dump_ptxas_log = True
            triton.knobs.cache.dir = cache_dir
            compiled = triton.compile(ASTSource(fn, job.signature, job.constexprs, job.attrs),
                                      target=GPUTarget("cuda", job.cc, 32), options=job.options)
    except Exception as e:  # a failed compile is a row of the report, not the end of it
        return {**row, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
    return {**row, "seconds": round(time.perf_counter() - start, 2), "shared": compiled.metadata.shared,
            **parse_ptxas(log.getvalue())}


def run(archs=tuple(ARCHS), workers: int = 2) -> tuple[list[dict], list[str]]:
    """Compile every job → (rows, launch failures: see all_jobs); nothing cached before, between or after."""
    jobs, failures = all_jobs(archs)
    jobs.sort(key=lambda j: (not j.name.startswith("_attn"), j.name, j.cc))  # the slow ones first
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads forked
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        rows = list(pool.map(compile_job, jobs))
    rows.sort(key=lambda r: (r["kernel"], r["arch"], r["dtype"], r["config"], r["spec"]))
    return rows, failures


def describe_uses(uses: list[tuple[str, str]]) -> str:
    """[("tiny", ""), ("tiny", "bias=false"), ("12m", "bias=false")] → "tiny, 12m bias=false": a preset whose
    defaults launch this compile is named alone; otherwise with the overrides that do."""
    presets = list(dict.fromkeys(p for p, _ in uses))
    default = [p for p in presets if (p, "") in uses]
    by_variant: dict[str, list[str]] = {}
    for p, variant in uses:
        if p not in default:
            by_variant.setdefault(variant, []).append(p)
    return ", ".join(default + [f"{'/'.join(ps)} {variant}" for variant, ps in by_variant.items()])


def table(rows: list[dict]) -> str:
    head = ("kernel", "arch", "dtype", "config", "spec", "used by", "smem B", "limit B", "regs", "spills st/ld B")
    lines = [head]
    for r in rows:
        uses = describe_uses([tuple(u) for u in r["uses"]])
        if r.get("error"):
            lines.append((r["kernel"], f"sm_{r['arch']}", r["dtype"], r["config"], r["spec"], uses, "FAILED",
                          "", "", r["error"]))
            continue
        lines.append((r["kernel"], f"sm_{r['arch']}", r["dtype"], r["config"], r["spec"], uses,
                      str(r["shared"] + r["static_shared"]), str(r["limit"]), str(r["regs"]),
                      f"{r['spill_stores']}/{r['spill_loads']}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def summary(rows: list[dict]) -> str:
    """One line per (kernel, arch): how many configurations, and the largest shared memory, registers and spills."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["arch"]), []).append(r)
    head = ("kernel", "arch", "configs", "max smem B", "limit B", "max regs", "with spills", "max spills st/ld B")
    lines = [head]
    for (kernel, cc), rs in sorted(groups.items()):
        ok = [r for r in rs if not r.get("error")]
        spilled = [r for r in ok if r["spill_stores"] or r["spill_loads"]]
        worst = max(spilled, key=lambda r: r["spill_stores"] + r["spill_loads"], default=None)
        lines.append((kernel, f"sm_{cc}", f"{len(ok)}/{len(rs)}",
                      str(max((r["shared"] + r["static_shared"] for r in ok), default=0)), str(SHARED_LIMIT[cc]),
                      str(max((r["regs"] or 0 for r in ok), default=0)), str(len(spilled)),
                      f"{worst['spill_stores']}/{worst['spill_loads']} ({worst['dtype']})" if worst else "0/0"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m andrea.kernels.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the rows to this file as JSON")
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities, e.g. 80,89,90")
    parser.add_argument("--workers", type=int, default=2, help="compiler processes (default 2)")
    a = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("compile_check: TRITON_INTERPRET is on, so there are no compiled kernels to check; "
              "run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    try:
        archs = tuple(int(x) for x in a.arch.split(","))
        if not archs or any(cc not in ARCHS for cc in archs):
            raise ValueError
    except ValueError:
        print(f"compile_check: --arch {a.arch}: expected a comma list of {sorted(ARCHS)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, failures = run(archs, max(1, a.workers))
    print(table(rows))
    print()
    print(summary(rows))
    bad = [(r, p) for r in rows for p in problems(r)]
    for r, p in bad:
        print(f"FAIL {r['kernel']} sm_{r['arch']} {r['dtype']} {r['config']}: {p}")
    for failure in failures:
        print(f"FAIL {failure}")
    spills = sum(1 for r in rows if not r.get("error") and (r["spill_stores"] or r["spill_loads"]))
    print(f"{len(rows)} compiles ({len({(r['kernel'], r['config'], r['spec'], r['dtype']) for r in rows})} "
          f"configurations x {len(archs)} archs: " + ", ".join(f"sm_{cc} {ARCHS[cc]}" for cc in archs)
          + f") in {time.perf_counter() - start:.0f} s; {len(bad) + len(failures)} failures, "
          f"{spills} with spills")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "launch_failures": failures}, f, indent=1)
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
