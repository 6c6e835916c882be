"""Training memory: the activations a layer keeps for its backward, and the output head's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_cascade.cascade.plan.params import DTYPE_BYTES, head_dim, mamba_sizes, stage_layers
from megatron_cascade.config import RunConfig
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.model import Layout
from megatron_cascade.models.architectures import ATTENTION, MAMBA, MOE
from megatron_cascade.ops.logprobs import CHUNK_ELEMENTS


# -- activations, logits, KV cache --------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What one training micro-batch or generation batch looks like to one GPU."""

    seq: int  # tokens per sequence (before context-parallel splitting)
    batch: int  # sequences
    routed_load: float = 1.0  # MoE: routed tokens on this (the most loaded) EP rank over the mean


def routed_load(cfg: RunConfig, layout: Layout) -> float:
    """``Shape.routed_load`` of ``layout``: ``cluster.moe_load_imbalance``, at most EP (every token on
    one rank); 1 without expert parallelism (one rank holds every expert: the total is fixed)."""
    if not cfg.model.moe.num_experts or layout.ep == 1:
        return 1.0
    return min(cfg.cluster.moe_load_imbalance, float(layout.ep))


def layer_activation_bytes(m: ModelConfig, layout: Layout, shape: Shape, *, sequence_parallel: bool,
                           fused_attention: bool, keep_scores: bool, moe_layer: bool) -> float:
    """Bytes one transformer layer keeps for its backward (one micro-batch, one GPU), without recompute.

    Korthikanti et al. 2022 per layer: ``sbh (34/t + 5as/(ht))`` with SP (``10 + 24/t`` without), for
    MHA, a 4h GELU MLP and dropout; here term by term so that GQA, SwiGLU, head dim, dropout and
    MoE top-k enter: each tensor saved for backward, in the model dtype (dropout masks 1 byte).
    ``keep_scores``: the [s x s] softmax of unfused attention is kept (no selective recompute).
    """
    return (_attention_block_bytes(m, layout, shape, sequence_parallel, fused_attention, keep_scores)
            + _mlp_block_bytes(m, layout, shape, sequence_parallel, moe_layer))


def _block_input_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool) -> float:
    """What every pre-norm block keeps outside the TP region: its norm input and its first linear's
    input (SP shards both), and the dropout mask of its residual add."""
    outside = 1 / layout.tp if sequence_parallel else 1.0
    tokens = shape.seq / layout.cp * shape.batch
    hidden_mask = 1 if m.hidden_dropout > 0 else 0
    return tokens * m.hidden_size * (2 * DTYPE_BYTES[m.precision] + hidden_mask) * outside


def _attention_block_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool,
                           fused_attention: bool, keep_scores: bool) -> float:
    """The attention half of a layer: block inputs, Q, K, V, the out-projection input, and the softmax
    statistics (fused) or the kept [s x s] scores (unfused, no selective recompute)."""
    e, t, s = DTYPE_BYTES[m.precision], layout.tp, shape.seq / layout.cp
    tokens = s * shape.batch
    a, d = m.num_attention_heads, head_dim(m)
    g = m.num_query_groups or a
    total = _block_input_bytes(m, layout, shape, sequence_parallel)
    total += e * tokens * d * (a + 2 * g) / t + e * tokens * a * d / t  # Q, K, V; out-projection input
    if fused_attention:
        total += 4 * shape.batch * (a / t) * s  # TE fused attention keeps fp32 softmax statistics only
    elif keep_scores:
        per_score = e + (1 + e if m.attention_dropout > 0 else 0)  # softmax out (+ dropout mask and out)
        total += per_score * shape.batch * (a / t) * s * shape.seq  # a [s/cp x s] block per rank
    return total


def _mlp_block_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool,
                     moe_layer: bool) -> float:
    """The MLP half of a layer: block inputs and the dense MLP's, or the routed and shared experts',
    intermediates (fc1 output = activation input, activation output)."""
    e, t = DTYPE_BYTES[m.precision], layout.tp
    tokens = shape.seq / layout.cp * shape.batch
    h = m.hidden_size
    outside = 1 / t if sequence_parallel else 1.0
    gate = 2 if m.activation == "swiglu" else 1
    total = _block_input_bytes(m, layout, shape, sequence_parallel)
    if moe_layer:
        routed = tokens * outside * m.moe.router_topk * shape.routed_load  # local tokens, each to top-k experts
        e_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size or 4 * h
        total += 4 * tokens * outside * m.moe.num_experts  # fp32 router logits
        total += e * routed * (h + e_ffn * (gate + 1) / layout.etp)  # expert fc1 in, fc1 out, act out
        shared = m.moe.shared_expert_intermediate_size or 0
        total += e * tokens * shared * (gate + 1) / t
    else:
        ffn = m.ffn_hidden_size or 4 * h
        total += e * tokens * ffn * (gate + 1) / t  # fc1 output (activation input), activation output
    return total


def mamba_block_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool) -> float:
    """One Mamba-2 layer (Megatron's memory-efficient path, whose fused kernel recomputes the conv in
    backward): block inputs, the in_proj output [z x B C dt] (the kernel's input), the gated norm's
    and out_proj's inputs (d_inner each), and the scan's fp32 state at each chunk boundary
    [heads / t, head dim, state]."""
    e, t, s = DTYPE_BYTES[m.precision], layout.tp, shape.seq / layout.cp
    heads, d_inner, _, width = mamba_sizes(m)
    hy = m.hybrid
    total = _block_input_bytes(m, layout, shape, sequence_parallel)
    total += e * s * shape.batch * (width + 2 * d_inner) / t
    total += 4 * shape.batch * math.ceil(s / hy.mamba_chunk_size) * (heads / t) * hy.mamba_head_dim * hy.mamba_state_dim
    return total


def block_activation_bytes(m: ModelConfig, layout: Layout, shape: Shape, block: str, *,
                           sequence_parallel: bool, fused_attention: bool, keep_scores: bool) -> float:
    """Bytes one block of a layer keeps for its backward (``models/architectures/``): ``M`` Mamba-2,
    ``*`` attention, ``-`` dense MLP, ``E`` MoE (each a pre-norm block with its residual)."""
    if block == MAMBA:
        return mamba_block_bytes(m, layout, shape, sequence_parallel)
    if block == ATTENTION:
        return _attention_block_bytes(m, layout, shape, sequence_parallel, fused_attention, keep_scores)
    return _mlp_block_bytes(m, layout, shape, sequence_parallel, moe_layer=block == MOE)


def training_activation_bytes(cfg: RunConfig, layout: Layout, shape: Shape, in_flight: int) -> float:
    """Activation bytes on the most loaded pipeline stage, which holds ``in_flight`` micro-batches
    (1F1B's first stage holds the most), block by block of its layers.

    none: every layer's saved tensors; selective: the attention core is recomputed (no [s x s]
    scores); full: only each ``recompute_num_layers`` chunk's input is kept, plus one chunk
    recomputed during its backward (the chunk whose layers keep the most).
    """
    m = cfg.model
    sp, fused = cfg.parallel.sequence_parallel, cfg.cluster.transformer_engine
    layers = stage_layers(m, layout)

    def kept(chunk: list[str], keep_scores: bool) -> float:
        return sum(block_activation_bytes(m, layout, shape, block, sequence_parallel=sp, fused_attention=fused,
                                          keep_scores=keep_scores) for layer in chunk for block in layer)

    if m.recompute != "full":
        return in_flight * kept(layers, keep_scores=m.recompute == "none")
    size = min(m.recompute_num_layers, len(layers))
    chunks = [layers[i:i + size] for i in range(0, len(layers), size)]
    inputs = in_flight * len(chunks) * _chunk_input_bytes(m, layout, shape, sp)
    return inputs + max(kept(chunk, keep_scores=True) for chunk in chunks)


def _chunk_input_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool) -> float:
    """The hidden states a full-recompute chunk keeps for its backward: its input [s/cp (/t under SP), b, h]."""
    chunk_input = DTYPE_BYTES[m.precision] * shape.seq / layout.cp * shape.batch * m.hidden_size
    return chunk_input / (layout.tp if sequence_parallel else 1)


def logits_bytes(m: ModelConfig, layout: Layout, tokens: float) -> float:
    """Output-layer logits [tokens, V/t] kept for the log-prob backward, and their gradient."""
    return 2 * DTYPE_BYTES[m.precision] * tokens * m.padded_vocab_size / layout.tp


def fused_head_bytes(m: ModelConfig, layout: Layout, tokens: float) -> float:
    """The fused log-prob head's working set (``ops/fused_output_logprobs.py``) for ``tokens`` positions.

    Its op keeps the hidden states it reads (all-gathered over the sequence under SP: [tokens, h]) and
    produces their gradient; each chunk of about 2^24 / (V/t) tokens fills [chunk, V/t] buffers: the
    logits in the model dtype, their float32 copy (16-bit models) and, in forward, the float32 softmax;
    the backward adds a weight-sized buffer for each chunk's 16-bit weight gradient.
    """
    e = DTYPE_BYTES[m.precision]
    upcast = 4 if e != 4 else 0
    forward = CHUNK_ELEMENTS * (e + upcast + 4)
    weight_grad = e * m.padded_vocab_size / layout.tp * m.hidden_size if upcast else 0
    backward = CHUNK_ELEMENTS * (e + upcast) + weight_grad
    return 2 * e * tokens * m.hidden_size + max(forward, backward)


def samples_truncated(stage: ResolvedStage) -> bool:
    """Whether ``stage`` trains on log-probs of a top-k / top-p truncated distribution (its rollouts
    sample with temperature > 0 and ``rollout.top_k`` > 0 or ``top_p`` < 1, ``stages/sampling_spec.py``):
    those need the whole logit row, so the fused head cannot run (``training/output_head.py``)."""
    r = stage.rollout
    return stage_type(stage.type).generates and r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0)
