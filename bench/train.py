"""Training throughput: andrea's Trainer against a plain-torch reference loop on the same model, batch and seed.

The reference is the loop most people would write: the same GPT (below, `ReferenceGPT`: a normal nn.Module with
one tensor per parameter and SDPA attention), initialised with andrea's bytes, `torch.optim.AdamW` with torch's
default implementation on CPU (the per-tensor for-loop; torch turns foreach on by default only on accelerators)
and `fused=True` on CUDA, `clip_grad_norm_`, weight decay on matrices only, bf16 autocast on CUDA. andrea runs
its Trainer (flat `[w | m | v]`, its own AdamW) with `--kernels torch`, and on CUDA also with `triton`.

Every subject sees the same random-token batches in the same order; steps alternate between subjects, so a
noisy machine slows all of them alike, and the order of the subjects reverses every step (A B, B A, ...): on a
CPU the subject that runs second after another one's step measured 1-2% slower or faster than when first.
Warm-up steps are excluded; tokens/s = batch x block / median step time.
The first step's losses are reported beside each other as a parity check (same init, same batch: they agree to
float rounding). On CUDA the model-FLOPs utilisation of every row is reported, both presets: andrea/control/observe/mfu.py's
(6·N + 12·L·H·Q·T) FLOPs per token (PaLM's estimate, as nanoGPT's) x tokens/s / the device's dense bf16 peak
("unknown" for a device not in its table).
Target: andrea >= 1.0x the reference on CPU. Timings describe this machine; nothing here fails on them.

Reads the presets (andrea/presets/*.toml); writes a markdown report to stdout and, with `--json PATH`, every
step time. andrea-120m runs on CUDA by default, on CPU only with --include-120m-cpu (minutes per step).

    python bench/train.py                       # CPU: andrea-12m, batch 8, 3 warm-up + 8 measured steps
    python bench/train.py --json out.json       # CUDA: andrea-12m and andrea-120m, preset batches
    python bench/train.py --presets andrea-12m --batch-size 32 --steps 12
    python bench/train.py --threads 1 --batch-size 4      # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.config import load as configload  # noqa: E402
from andrea.config.schema import ModelConfig, RunConfig  # noqa: E402
from andrea.control.run.trainer import Trainer, lr_at, resolve_device  # noqa: E402
from andrea.control.observe.mfu import mfu, model_flops_per_token, table_peak  # noqa: E402

CPU_BATCH = 8  # keeps the default CPU run to about a minute on 2 cores; the preset's batch on CUDA


# --- the plain-torch reference ----------------------------------------------------------------------------------
class ReferenceBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(C, bias=cfg.bias)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(C, 3 * C, bias=cfg.bias),
                                       c_proj=nn.Linear(C, C, bias=cfg.bias)))
        self.ln_2 = nn.LayerNorm(C, bias=cfg.bias)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(C, 4 * C, bias=cfg.bias),
                                      c_proj=nn.Linear(4 * C, C, bias=cfg.bias)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    """nanoGPT's GPT with an untied head; parameter names match andrea.model.gpt so weights copy by name."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(ReferenceBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class ReferenceLoop:
    def __init__(self, cfg: RunConfig, device: torch.device, init: Trainer):
        self.cfg, self.device = cfg, device
        with torch.device("meta"):
            self.model = ReferenceGPT(cfg.model)
        self.model.to_empty(device=device)
        flat = dict(init.model.named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(flat[name])
        tc = cfg.train
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, **fused)
        self.impl = "fused" if fused else "default (for-loop on CPU)"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tc = self.cfg.train
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.model(x, y)
        loss.backward()
        if tc.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, tc)
        self.opt.step()
        return loss.detach()


# --- measurement -------------------------------------------------------------------------------------------------
def batches(cfg: RunConfig, batch_size: int, count: int, device: torch.device, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.randint(0, cfg.model.vocab_size, (batch_size, cfg.model.block_size + 1), generator=gen)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bench_preset(preset: str, device: torch.device, batch_size: int, warmup: int, steps: int) -> dict:
    cfg = configload.load(preset=preset)
    kernels = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    subjects = {f"andrea ({k})": Trainer(cfg, device, k) for k in kernels}
    first = next(iter(subjects.values()))
    subjects["reference (torch.optim.AdamW)"] = ReferenceLoop(cfg, device, first)
    data = batches(cfg, batch_size, warmup + steps, device, cfg.train.seed)
    times = {name: [] for name in subjects}
    losses = {name: [] for name in subjects}
    for step, (x, y) in enumerate(data):
        order = list(subjects.items())  # alternate: machine noise hits every subject alike ...
        for name, subject in order if step % 2 == 0 else order[::-1]:  # ... and so does running first or last
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = subject.train_step(step, x, y)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss_value = loss.item()  # a host sync: the step is done
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss_value)
    tokens = batch_size * cfg.model.block_size
    n = first.n
    ref_name = "reference (torch.optim.AdamW)"
    ref_tps = tokens / statistics.median(times[ref_name][warmup:])
    name = device_name(device)
    rows = []
    for name in subjects:
        med = statistics.median(times[name][warmup:])
        paired = statistics.median(r / a for a, r in zip(times[name][warmup:], times[ref_name][warmup:]))
        row = dict(preset=preset, subject=name, batch=batch_size, block=cfg.model.block_size, median_s=med,
                   tokens_per_s=tokens / med, vs_reference=tokens / med / ref_tps, vs_reference_paired=paired,
                   first_loss=losses[name][0],
                   last_loss=losses[name][-1], warmup_s=times[name][:warmup], step_s=times[name][warmup:])
        if device.type == "cuda":  # bf16 autocast on both sides: against the bf16 peak
            row["mfu"] = mfu(tokens / med, model_flops_per_token(cfg.model, n), table_peak(name, "bf16"))
            row["achieved_flops"] = model_flops_per_token(cfg.model, n) * tokens / med
        rows.append(row)
    return dict(preset=preset, n_params=n, device=name, reference_adamw=subjects[ref_name].impl, rows=rows)


def markdown(results: list[dict], device: torch.device) -> str:
    lines = [f"# Training throughput on {results[0]['device'] if results else device}: andrea vs plain torch",
             f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; median of measured steps", "",
             "| preset | subject | batch x block | median s/step | tokens/s | vs reference | paired | MFU "
             "| first loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            mfu_s = "-" if "mfu" not in r else ("unknown" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%")
            lines.append(f"| {r['preset']} | {r['subject']} | {r['batch']} x {r['block']} | {r['median_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['vs_reference']:.2f}x | {r['vs_reference_paired']:.2f}x | "
                         f"{mfu_s} | {r['first_loss']:.5f} |")
    lines += ["", "vs reference: ratio of median tokens/s; paired: median over steps of the ratio within a step pair "
              "(subjects alternate, so a load spike hits both; on a shared machine trust this one).",
              "Target: andrea (torch kernels) >= 1.0x the reference on CPU (on the ratio of medians)."]
    for res in results:
        andrea_torch = next(r for r in res["rows"] if r["subject"] == "andrea (torch)")
        if device.type == "cpu":
            ok = andrea_torch["vs_reference"] >= 1.0
            lines.append(f"- {res['preset']}: {andrea_torch['vs_reference']:.2f}x -> {'PASS' if ok else 'MISS'}")
        ref = next(r for r in res["rows"] if r["subject"].startswith("reference"))
        lines.append(f"- {res['preset']}: first-step loss andrea {andrea_torch['first_loss']:.6f} vs reference "
                     f"{ref['first_loss']:.6f} (parity check: same init, same batch)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--presets", nargs="+", default=None,
                   help="default: andrea-12m, plus andrea-120m on CUDA (or with --include-120m-cpu)")
    p.add_argument("--include-120m-cpu", action="store_true", help="also run andrea-120m on CPU (minutes per step)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--batch-size", type=int, default=None, help=f"default: {CPU_BATCH} on CPU, the preset's on CUDA")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per subject (default 3)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per subject (default 8)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's; 1 is steadier on a shared machine)")
    p.add_argument("--json", metavar="PATH", help="also write every step time as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    device = resolve_device(args.device)
    presets = args.presets or ["andrea-12m", "andrea-120m"]
    notes = []
    if device.type == "cpu" and "andrea-120m" in presets and not args.include_120m_cpu:
        presets = [x for x in presets if x != "andrea-120m"]
        notes.append("andrea-120m skipped on CPU (minutes per step); pass --include-120m-cpu to run it")
    results = []
    for preset in presets:
        cfg = configload.load(preset=preset)
        batch = args.batch_size or (cfg.train.batch_size if device.type == "cuda" else CPU_BATCH)
        results.append(bench_preset(preset, device, batch, args.warmup, args.steps))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(results, device))
    for note in notes:
        print(f"- {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, threads=torch.get_num_threads(),
                           warmup=args.warmup, steps=args.steps, notes=notes, results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
