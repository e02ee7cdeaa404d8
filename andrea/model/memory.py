"""Memory decisions as pure functions over plain data: the micro-batch a step runs with, the out-of-memory
fallback of `train.micro_batch_size = "auto"`, and the device-memory estimate `andrea info` prints.

Reads and writes nothing; imports no torch (the trainer applies these decisions, andrea/control/run/trainer.py).

The estimate counts what a training step keeps alive at its peak, the moment the loss's backward starts:
    parameters   fp32 masters, 4·n bytes            (the flat `w`, andrea/control/run/trainer.py)
    gradient     fp32, 4·n                          (the flat gradient every micro-batch accumulates into)
    adam_m_v     fp32 m and v, 8·n                  (1/P of that per rank under torchrun: ZeRO-1, andrea/control/parallel/zero.py)
    activations  what autograd saved for the backward, per micro-batch of b rows of T tokens
    logits       the (b·T, V) log-probabilities the loss saved and the same-sized gradient its backward makes
    optimizer_workspace  what the update allocates beside the state (Muon: andrea/optim/muon.py's
                 workspace_bytes; AdamW: nothing, in place). It lives after the backward, when the activations
                 and logits are gone: the peak is the larger of the two moments, and the total counts that.
Activations per token, counted from the tensors autograd saves (checked against saved-tensor hooks in
tests/e2e/test_microbatch.py): per block the LayerNorm inputs (2·C), their outputs (2·C), q, k, v (3·C), the attention
output (C), the MLP's hidden layer before and after GELU (8·C), and small per-token statistics (LayerNorm mean
and rstd, the attention's log-sum-exp per head); outside the blocks the final LayerNorm's input and output (2·C).
On CPU every one is fp32 (4 bytes). On CUDA the forward runs under bf16 autocast: the residual stream and the
LayerNorm inputs stay fp32, the matmul inputs and outputs are bf16, the attention output is copied once more
to (B, T, C) for c_proj, and the loss works on an fp32 copy of the bf16 logits (a modelled count: no GPU
measurement yet). With activation checkpointing ("blocks") a block keeps only its input (fp32, 4·C) and one
block at a time holds its full activations again while its backward runs.
The modern model (andrea/model/modern.py, H = its SwiGLU width) per block on CPU, fp32: the two RMSNorm inputs and
outputs (4·C), q and k as QK-norm reads them (2·C) and v (C), the rotated q and k (2·C), the attention output
(C: SDPA writes it token-major, as its q, so o_proj reads it without a copy), the gate|up projection (2·H), SiLU's
output and the product (2·H; with model.mlp = "relu2", H = 4·C: the relu's output and its square, 2·H, and no
concatenated weight); with embed_norm its input and rsqrt (C + 1 fp32), with logit_softcap tanh's output (V); per-token statistics: the block norms' and QK-norm's rsqrt, the attention's log-sum-exp (3·n_head + 2
fp32); and, once per block rather than per token, the concatenated q|k|v and gate|up weights its two fused matmuls
save ((3·C + 2·H)·C, fp32 on CPU, their bf16 cast on CUDA). On CUDA (modelled, the Triton kernels under bf16
autocast): fp32 RMSNorm inputs (2·C), bf16 everything else, the QK-normed q and k not kept (rotary saves only its
tables).
nanochat's parts (fp32 on either device, outside the blocks' recomputation): per value-embedding layer the
embedding's rows and the gate (C + 2·n_head), with resid_lambdas each block's unmixed input (C), with smear the
previous tokens' embeddings and the gate (C + 2); backout saves nothing new (its middle stream is the next block's
input). Checked against saved-tensor hooks in tests/unit/model/test_parts.py.
Not counted: the allocator's slack and fragmentation, the CUDA context (~0.5 GB), dropout masks (dropout is off
by default), the checkpoint staging buffers on the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from andrea.config.schema import ModelConfig, mlp_hidden, swiglu_hidden

GIB = 1024 ** 3


def micro_batch_rows(micro_batch_size: int | str, rows: int) -> int:
    """Rows per pass for a (per-rank) batch of `rows`: 0 and "auto" start from the whole batch."""
    return rows if micro_batch_size in (0, "auto") else int(micro_batch_size)


def check_micro_batch(micro_batch_size: int | str, rows: int, where: str | None = None) -> str | None:
    """The problem with this micro-batch for a batch of `rows` (one line), or None when it divides it."""
    mb = micro_batch_rows(micro_batch_size, rows)
    if mb > rows or rows % mb:
        return f"train.micro_batch_size={mb} does not divide {where or f'train.batch_size={rows}'}"
    return None


def next_micro_batch(rows: int, current: int) -> int | None:
    """The out-of-memory fallback: the largest divisor of `rows` at most half of `current` (a step keeps
    consecutive equal slices of its batch); None when `current` is already one row."""
    for mb in range(current // 2, 0, -1):
        if rows % mb == 0:
            return mb
    return None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of device memory one training step needs at its peak (see the module docstring)."""

    device: str
    micro_batch_size: int
    activation_checkpointing: str
    parameters: int
    gradient: int
    adam_m_v: int
    activations: int
    logits: int
    optimizer_workspace: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradient + self.adam_m_v + max(self.activations + self.logits,
                                                                     self.optimizer_workspace)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        out["total_gib"] = round(self.total / GIB, 3)
        return out


def block_bytes_per_token(cfg: ModelConfig, device: str) -> int:
    """Bytes autograd saves per token for one transformer block without activation checkpointing."""
    if cfg.arch == "modern":
        return _modern_block_bytes_per_token(cfg, device)
    C, stats = cfg.n_embd, 4 * (cfg.n_head + 4)  # fp32 log-sum-exp per head; mean and rstd of two LayerNorms
    if device == "cuda":
        # fp32: x and the residual after attention (LayerNorm inputs); bf16: both LayerNorm outputs, q/k/v, the
        # attention output and its (B, T, C) copy, the MLP hidden layer before and after GELU.
        return 4 * 2 * C + 2 * (2 * C + 3 * C + 2 * C + 8 * C) + stats
    return 4 * 16 * C + stats


def _modern_block_bytes_per_token(cfg: ModelConfig, device: str) -> int:
    C, H = cfg.n_embd, mlp_hidden(cfg)
    act = 2 * H if cfg.mlp == "relu2" else 4 * H  # relu2: the relu's output (its and the square's backward read
    # it) and the square; swiglu: as above
    stats = 4 * (3 * cfg.n_head + 2)  # rsqrt of two block norms and of QK-norm per head; log-sum-exp per head
    if device == "cuda":
        # fp32: both RMSNorm inputs; bf16: both norm outputs (cast), q|k|v, rotated q and k, the attention output
        # and its copy, gate|up, SiLU's output and the product
        return 4 * 2 * C + 2 * (2 * C + 3 * C + 2 * C + 2 * C + act) + stats
    return 4 * (10 * C + act) + stats


def parts_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes autograd saves per token for the modern model's parts with parameters (fp32; see the docstring)."""
    C, L = cfg.n_embd, cfg.n_layer
    ve_layers = sum(i % 2 == (L - 1) % 2 for i in range(L)) if cfg.value_embeds else 0
    return 4 * (ve_layers * (C + 2 * cfg.n_head) + (L * C if cfg.resid_lambdas else 0) + (C + 2 if cfg.smear else 0))


def block_weight_bytes(cfg: ModelConfig, device: str) -> int:
    """Bytes one block saves once, whatever the tokens: the modern model's concatenated q|k|v and gate|up weights
    (fp32 on CPU, bf16 on CUDA); none for the GPT."""
    if cfg.arch != "modern":
        return 0
    gate_up = 0 if cfg.mlp == "relu2" else 2 * swiglu_hidden(cfg.n_embd)  # relu2's up_proj is no concatenation
    return (2 if device == "cuda" else 4) * (3 * cfg.n_embd + gate_up) * cfg.n_embd


def estimate(cfg: ModelConfig, n_params: int, micro_batch_size: int, *, activation_checkpointing: str = "none",
             device: str = "cuda", world_size: int = 1, optimizer_workspace: int = 0) -> MemoryEstimate:
    """Peak device memory of a training step with micro-batches of `micro_batch_size` rows (per rank);
    `optimizer_workspace`: the update's own (Muon's: optim/muon.workspace_bytes; the whole model's, an upper bound
    for a ZeRO-1 rank, which orthogonalises only its own matrices)."""
    tokens = micro_batch_size * cfg.block_size
    block = block_bytes_per_token(cfg, device)
    if activation_checkpointing == "blocks":
        per_token = cfg.n_layer * 4 * cfg.n_embd + block  # every block's input, one block recomputed
        weights = block_weight_bytes(cfg, device)
    else:
        per_token = cfg.n_layer * block
        weights = cfg.n_layer * block_weight_bytes(cfg, device)
    per_token += 4 * 2 * cfg.n_embd + 16  # ln_f input and output; int64 inputs and targets
    if cfg.embed_norm:
        per_token += 4 * cfg.n_embd + 4  # the embedding norm's input (fp32) and its rsqrt
    per_token += parts_bytes_per_token(cfg)
    # log-probabilities (fp32) and their gradient (fp32); on CUDA also the bf16 logits and their bf16 gradient
    logits_per_token = cfg.vocab_size * (4 + 4 + (2 if device == "cuda" else 0))
    if cfg.logit_softcap:
        logits_per_token += cfg.vocab_size * (2 if device == "cuda" else 4)  # tanh's output, which its backward reads
    shard = -(-n_params // world_size)
    return MemoryEstimate(device, micro_batch_size, activation_checkpointing, parameters=4 * n_params,
                          gradient=4 * n_params, adam_m_v=8 * shard, activations=tokens * per_token + weights,
                          logits=tokens * logits_per_token, optimizer_workspace=optimizer_workspace)
