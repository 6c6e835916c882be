"""The dry run's parameter count and static memory (weights, gradients, optimizer state) per GPU."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_cascade.config import RunConfig
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.model import Layout, resolve_layout
from megatron_cascade.models.architectures import ATTENTION, MAMBA, MLP, MOE, count_blocks, megatron_architecture

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# -- parameters and static state ------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model, split by how they are sharded."""

    embedding: int  # input embedding (+ output layer when untied)
    dense: int  # attention, norms, dense MLPs, routers, shared experts
    expert: int  # routed experts

    @property
    def total(self) -> int:
        return self.embedding + self.dense + self.expert


def head_dim(m: ModelConfig) -> int:
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def stage_layers(m: ModelConfig, layout: Layout) -> list[str]:
    """The blocks of each layer of the most loaded pipeline stage (``MegatronArchitecture.stage_layers``)."""
    return megatron_architecture(m).stage_layers(m, layout.pp)


def mamba_sizes(m: ModelConfig) -> tuple[int, int, int, int]:
    """(SSM heads, d_inner = heads x head dim, conv channels = d_inner + 2 x groups x state, in_proj width)."""
    hy = m.hybrid
    heads = hy.num_heads(m.hidden_size)
    d_inner = heads * hy.mamba_head_dim
    conv = d_inner + 2 * hy.mamba_num_groups * hy.mamba_state_dim
    return heads, d_inner, conv, d_inner + conv + heads


def _mamba_parameters(m: ModelConfig) -> int:
    """One Mamba-2 layer: pre-norm, in_proj [z x B C dt], depthwise conv (+ bias), A_log, D, dt_bias,
    the gated norm and out_proj."""
    h = m.hidden_size
    heads, d_inner, conv, width = mamba_sizes(m)
    return h + h * width + conv * (m.hybrid.mamba_conv_kernel + 1) + 3 * heads + d_inner + d_inner * h


def count_parameters(m: ModelConfig) -> ParamCount:
    """Analytic parameter count of the model ``m`` describes, block by block of each layer (every
    block has one pre-norm; ``models/architectures/``)."""
    h, heads = m.hidden_size, m.num_attention_heads
    hd = head_dim(m)
    groups = m.num_query_groups or heads
    gate = 2 if m.activation == "swiglu" else 1
    attention = h * hd * (heads + 2 * groups) + heads * hd * h + h
    attention += (hd * (heads + 2 * groups) if m.add_qkv_bias else 0) + (2 * hd if m.qk_layernorm else 0)
    ffn = m.ffn_hidden_size or 4 * h
    e_ffn = m.moe.ffn_hidden_size or ffn
    shared = m.moe.shared_expert_intermediate_size or 0
    dense_of = {ATTENTION: attention, MLP: h * ffn * gate + ffn * h + h, MAMBA: _mamba_parameters(m),
                MOE: h + h * (m.moe.num_experts or 0) + h * shared * gate + shared * h}
    layers = megatron_architecture(m).layer_blocks(m)
    dense = sum(dense_of[block] for layer in layers for block in layer)
    expert = count_blocks(layers, MOE) * (m.moe.num_experts or 0) * (h * e_ffn * gate + e_ffn * h)
    embedding = m.padded_vocab_size * h * (1 if m.tie_embeddings else 2)
    return ParamCount(embedding, dense + h, expert)  # + the final norm


def params_per_gpu(cfg: RunConfig, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of the most loaded pipeline stage."""
    counts = count_parameters(cfg.model)
    # Embedding and output layer sit on the first and last pipeline stages: with PP > 1 the most
    # loaded stage holds one of them (untied) or the single shared one.
    embedding = counts.embedding if layout.pp == 1 else counts.embedding / (1 if cfg.model.tie_embeddings else 2)
    dense = counts.dense / (layout.tp * layout.pp) + embedding / layout.tp
    return dense, counts.expert / (layout.ep * layout.etp * layout.pp)


def memory_per_gpu(cfg: RunConfig, world_size: int) -> dict[str, float]:
    """GiB per GPU of weights, gradients and optimizer state (the most loaded pipeline stage).

    bf16/fp16: 2-byte weights, fp32 grads and fp32 master + Adam moments (12 B/param); fp32: 4 + 4 + 8.
    The distributed optimizer shards the optimizer state over (expert-)data-parallel ranks.
    """
    layout = resolve_layout(cfg.model, cfg.parallel, world_size, check_this_machine=False)
    dense, expert = params_per_gpu(cfg, layout)
    half = cfg.model.precision in ("bf16", "fp16")
    weight_b, grad_b, optim_b = (2, 4, 12) if half else (4, 4, 8)
    distributed = cfg.parallel.use_distributed_optimizer
    optim = optim_b * (dense / (layout.dp if distributed else 1) + expert / (layout.expert_dp if distributed else 1))
    params = dense + expert
    return {"params_per_gpu_b": params / 1e9, "weights_gib": params * weight_b / GIB,
            "grads_gib": params * grad_b / GIB, "optimizer_gib": optim / GIB,
            "total_gib": (params * (weight_b + grad_b) + optim) / GIB}
