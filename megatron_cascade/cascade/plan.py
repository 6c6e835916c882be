"""``run --dry-run``: refuse what the code cannot run, then print the layout, the per-GPU memory plan
and the stage plan, for the cluster the config describes (no GPU touched, no CUDA/TE needed here).

Memory model (bytes per GPU, the most loaded pipeline stage, per stage of the cascade):

* static: weights, gradients, optimizer state (``static_memory``), plus the frozen KL reference
  (GRPO with ``loss.kl_coef > 0``) or the one resident MOPD teacher, in the model dtype;
* generation (``rollout/engine.py``): the paged KV cache — ``rollout.kv_cache_bytes`` or
  ``kv_cache_fraction`` of the memory the static state and frozen models leave, at most what every
  local sample needs at its longest — plus one generation step (the largest layer intermediates of
  up to max(16K, the longest sample) tokens and the sampled rows' logits); blocks are taken on
  demand, so the samples decoding at once are counted at ``rollout.expected_response_fraction`` of
  ``max_new_tokens`` (per GPU: over the TP x PP x CP GPUs of a model replica); a budget that cannot
  hold one sample at its longest is refused;
* training: activations of the micro-batches in flight (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", generalised to GQA, SwiGLU and MoE top-k;
  with ``model.recompute`` none/selective/full) and the output head: where the stage samples from a
  top-k / top-p truncated distribution the [tokens, V/t] logits with their gradient (model dtype: the
  fp32 work of ``ops/truncated_logprobs.py`` is chunked, and Float16Module's fp32 copy is disabled),
  else the fused log-prob head's working set (``training/output_head.py``: per-chunk logit buffers,
  the gathered hidden states and their gradient; no [tokens, vocab] tensor); with expert
  parallelism the routed experts' tensors are those of the most loaded EP rank
  (``cluster.moe_load_imbalance`` x the mean);
* peak = static + max(generation, training) + ``cluster.runtime_overhead_gib`` (CUDA context, NCCL,
  workspaces); host memory holds the offloaded MOPD teachers.

Hybrid models (``model.architecture: hybrid``) are counted layer by layer from their pattern: Mamba-2
layers (parameters, the activations their scan keeps, one conv + SSM state per sample in generation),
attention-only, MLP-only and MoE-only layers; under ``recompute: full`` (``model/hybrid_model.py``)
each chunk's input is kept and the largest chunk's layers are recomputed at once. They generate in
the same paged engine, each sample holding one Mamba state slot besides its KV blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from megatron_cascade.config import ConfigError, RunConfig, resolve_stage
from megatron_cascade.config.model import FP8Config, ModelConfig
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.model import Layout, resolve_layout
from megatron_cascade.ops.logprobs import _CHUNK_ELEMENTS as _HEAD_CHUNK_ELEMENTS
from megatron_cascade.stages.registry import stage_type

GIB = 2**30
_FP8_ALIGN = 16  # TE FP8 GEMMs need both operand dims divisible by 16
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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


def _head_dim(m: ModelConfig) -> int:
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def _is_moe_layer(m: ModelConfig, layer: int) -> bool:
    return bool(m.moe.num_experts) and layer % m.moe.layer_freq == 0


def _symbols_on_stage(m: ModelConfig, layout: Layout) -> str:
    """Layer symbols of the most loaded pipeline stage (hybrid: Megatron splits the pattern evenly;
    the stage with the most Mamba + attention layers, the ones with per-token state)."""
    pattern = m.hybrid.layer_pattern
    per = m.num_layers // layout.pp
    stages = [pattern[i * per:(i + 1) * per] for i in range(layout.pp)]
    return max(stages, key=lambda st: (st.count("M") + st.count("*"), st.count("E")))


def _mamba_sizes(m: ModelConfig) -> tuple[int, int, int, int]:
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
    heads, d_inner, conv, width = _mamba_sizes(m)
    return h + h * width + conv * (m.hybrid.mamba_conv_kernel + 1) + 3 * heads + d_inner + d_inner * h


def _count_hybrid(m: ModelConfig, attention: int, dense_mlp: int, gate: int) -> ParamCount:
    """Parameters of a hybrid model, layer by layer from its pattern (each layer has one pre-norm)."""
    h = m.hidden_size
    dense = expert = 0
    for symbol in m.hybrid.layer_pattern:
        if symbol == "M":
            dense += _mamba_parameters(m)
        elif symbol == "*":
            dense += attention - h  # one norm, no pre-MLP norm
        elif symbol == "-":
            dense += dense_mlp + h
        else:  # "E"
            e_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size or 4 * h
            shared = m.moe.shared_expert_intermediate_size or 0
            expert += m.moe.num_experts * (h * e_ffn * gate + e_ffn * h)
            dense += h + h * m.moe.num_experts + h * shared * gate + shared * h
    embedding = m.padded_vocab_size * h * (1 if m.tie_embeddings else 2)
    return ParamCount(embedding, dense + h, expert)


def count_parameters(m: ModelConfig) -> ParamCount:
    """Analytic parameter count of the model ``m`` describes (GPT, or hybrid layer by layer)."""
    h, heads = m.hidden_size, m.num_attention_heads
    hd = _head_dim(m)
    groups = m.num_query_groups or heads
    gate = 2 if m.activation == "swiglu" else 1
    attention = h * hd * (heads + 2 * groups) + heads * hd * h + 2 * h
    attention += (hd * (heads + 2 * groups) if m.add_qkv_bias else 0) + (2 * hd if m.qk_layernorm else 0)
    ffn = m.ffn_hidden_size or 4 * h
    dense_mlp = h * ffn * gate + ffn * h
    if m.architecture == "hybrid":
        return _count_hybrid(m, attention, dense_mlp, gate)
    dense = expert = 0
    for layer in range(m.num_layers):
        dense += attention
        if _is_moe_layer(m, layer):
            e_ffn = m.moe.ffn_hidden_size or ffn
            expert += m.moe.num_experts * (h * e_ffn * gate + e_ffn * h)
            dense += h * m.moe.num_experts
            shared = m.moe.shared_expert_intermediate_size or 0
            dense += h * shared * gate + shared * h
        else:
            dense += dense_mlp
    dense += h  # final norm
    embedding = m.padded_vocab_size * h * (1 if m.tie_embeddings else 2)
    return ParamCount(embedding, dense, expert)


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


# -- what the code cannot run -----------------------------------------------------------------------
def check_runnable(cfg: RunConfig, layout: Layout) -> None:
    """Raise ``ConfigError`` (naming the key and the reason) for a layout or option this code or
    the libraries under it refuse at run time; called by the dry run before it plans anything."""
    m = cfg.model
    check_generation_layouts(cfg, layout)
    if m.moe.num_experts and m.moe.token_dispatcher_type == "flex":
        raise ConfigError("model.moe.token_dispatcher_type=flex needs DeepEP/HybridEP, which megatron-cascade "
                          "neither installs nor tests; use alltoall")
    if m.moe.num_experts and m.moe.grouped_gemm and not cfg.cluster.transformer_engine:
        raise ConfigError("model.moe.grouped_gemm=true needs Transformer Engine (cluster.transformer_engine=false)")
    _check_fp8(cfg, layout)
    _check_transformer_config(cfg)
    for index, stage_cfg in enumerate(cfg.stages):
        if stage_cfg.prompts_per_step % layout.dp:
            raise ConfigError(f"stages[{index}] ({stage_cfg.name}): prompts_per_step={stage_cfg.prompts_per_step} "
                              f"is not divisible by the data-parallel size {layout.dp}")


def check_generation_layouts(cfg: RunConfig, layout: Layout) -> None:
    """Every stage's decode layout (``check_decode_layout``), and with context parallelism a decode
    layout wherever the run generates (the training layout cannot decode with CP > 1); ``ConfigError``.
    The dry run and the start of a run call it, before anything is built."""
    stages = [resolve_stage(cfg, stage_cfg) for stage_cfg in cfg.stages]
    for stage in stages:
        check_decode_layout(cfg, stage, layout.world_size)
    if layout.cp > 1:
        at_training_layout = [s.name for s in stages if s.rollout.parallel is None
                              and (stage_type(s.type).generates or cfg.eval.enabled)]
        if at_training_layout:
            raise ConfigError(f"parallel.context_parallel_size={layout.cp}: stages {at_training_layout} generate "
                              "(rollouts or evaluation) at the training layout, which cannot decode with CP > 1 "
                              "(one token per request per step); set rollout.parallel (a decode layout, e.g. "
                              "{tensor_model_parallel_size: 1}) or parallel.context_parallel_size=1")


def check_decode_layout(cfg: RunConfig, stage: ResolvedStage, world_size: int) -> Optional[Layout]:
    """``stage``'s decode layout (``rollout.parallel``) against the model and ``world_size``, or None
    without one; ``ConfigError`` naming the ``rollout.parallel`` key it cannot run."""
    decode = stage.rollout.parallel
    if decode is None:
        return None
    m = cfg.model
    if stage.rollout.cuda_graphs is not None and not _has_graphable_layers(m):
        raise ConfigError(
            f"stage {stage.name}: rollout.cuda_graphs={stage.rollout.cuda_graphs}: every layer of this model holds a "
            "MoE block, which megatron-core 0.16.1 cannot replay from a CUDA graph in inference (its dispatcher "
            "reads token counts on the host); set rollout.cuda_graphs: null")
    try:
        return resolve_layout(m, decode.as_parallel(), world_size, check_this_machine=False, prefix="rollout.parallel.")
    except ConfigError as exc:
        raise ConfigError(f"stage {stage.name}: {exc}") from None


def _has_graphable_layers(m) -> bool:
    """Whether some layer has no MoE block (the layers a decode step replays from CUDA graphs)."""
    if m.architecture == "hybrid":
        return any(symbol in (m.hybrid.layer_pattern or "") for symbol in "M*-")
    return not m.moe.num_experts or m.moe.layer_freq > 1


def uses_cuda_graphs(cfg: RunConfig) -> bool:
    """Whether a stage of the run decodes with CUDA graphs (``rollout.cuda_graphs``)."""
    return any(resolve_stage(cfg, stage_cfg).rollout.cuda_graphs is not None for stage_cfg in cfg.stages)


def decode_copy_bytes(cfg: RunConfig, decode: Layout) -> float:
    """Bytes of the decode copy's weights on one GPU (model dtype): what each refit moves into it."""
    return _DTYPE_BYTES[cfg.model.precision] * sum(params_per_gpu(cfg, decode))


def _check_fp8(cfg: RunConfig, layout: Layout) -> None:
    m = cfg.model
    if m.fp8.format is None:
        return
    if not cfg.cluster.transformer_engine:
        raise ConfigError("model.fp8.format needs Transformer Engine on the cluster (cluster.transformer_engine=false)")
    if m.moe.num_experts and not m.moe.grouped_gemm:
        raise ConfigError("model.fp8.format with an MoE model needs model.moe.grouped_gemm=true: only TE's grouped "
                          "experts pad each expert's tokens to the FP8 GEMM alignment (16)")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    dims = [("model.hidden_size", m.hidden_size, 1),
            ("model.num_attention_heads x head dim", m.num_attention_heads * _head_dim(m), layout.tp)]
    if not m.moe.num_experts or m.moe.layer_freq > 1:
        dims.append(("model.ffn_hidden_size", ffn, layout.tp))
    if m.moe.num_experts:
        dims.append(("model.moe.ffn_hidden_size", m.moe.ffn_hidden_size or ffn, layout.etp))
    for key, size, split in dims:
        if (size // split) % _FP8_ALIGN:
            raise ConfigError(f"model.fp8.format: {key}={size} / {split} (its tensor-parallel split) is not a "
                              f"multiple of {_FP8_ALIGN}, which TE's FP8 GEMMs need")


# Megatron's names (fields, or their --flag spelling in its messages) of the options we set.
_MEGATRON_NAMES = {
    "moe_router_pre_softmax": "model.moe.router_pre_softmax", "moe_router_topk": "model.moe.router_topk",
    "moe_token_dispatcher_type": "model.moe.token_dispatcher_type", "moe_grouped_gemm": "model.moe.grouped_gemm",
    "moe_aux_loss_coeff": "model.moe.aux_loss_coeff",
    "moe_router_load_balancing_type": "model.moe.router_load_balancing_type",
    "moe_router_score_function": "model.moe.router_score_function",
    "moe_router_enable_expert_bias": "model.moe.router_enable_expert_bias",
    "moe_router_bias_update_rate": "model.moe.router_bias_update_rate",
    "moe_shared_expert_intermediate_size": "model.moe.shared_expert_intermediate_size",
    "moe_ffn_hidden_size": "model.moe.ffn_hidden_size", "moe_layer_freq": "model.moe.layer_freq",
    "num_moe_experts": "model.moe.num_experts", "recompute_num_layers": "model.recompute_num_layers",
    "recompute_granularity": "model.recompute", "recompute_method": "model.recompute",
    "num_query_groups": "model.num_query_groups", "kv_channels": "model.kv_channels",
    "ffn_hidden_size": "model.ffn_hidden_size", "sequence_parallel": "parallel.sequence_parallel",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
}


def _our_keys(message: str) -> list[str]:
    """Config keys of the Megatron options a Megatron error message mentions."""
    text = message.lower()
    keys = [key for name, key in _MEGATRON_NAMES.items()
            if name in text or "--" + name.replace("_", "-") in text]
    return sorted(set(keys))


def _check_transformer_config(cfg: RunConfig) -> None:
    """Build Megatron's ``TransformerConfig`` here, without CUDA: what it (or ``validate_model_config``)
    refuses is refused now, with our config keys added to Megatron's message. FP8 fields are checked by
    ``_check_fp8``: TransformerConfig reads the installed TE version for them, absent without GPUs."""
    from megatron_cascade.model import transformer_config

    try:
        transformer_config(replace(cfg.model, fp8=FP8Config()), cfg.parallel)
    except ConfigError as exc:
        keys = [k for k in _our_keys(str(exc)) if k not in str(exc)]
        raise ConfigError(f"{exc} (config keys: {', '.join(keys)})" if keys else str(exc)) from None


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
    return tokens * m.hidden_size * (2 * _DTYPE_BYTES[m.precision] + hidden_mask) * outside


def _attention_block_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool,
                           fused_attention: bool, keep_scores: bool) -> float:
    """The attention half of a layer: block inputs, Q, K, V, the out-projection input, and the softmax
    statistics (fused) or the kept [s x s] scores (unfused, no selective recompute)."""
    e, t, s = _DTYPE_BYTES[m.precision], layout.tp, shape.seq / layout.cp
    tokens = s * shape.batch
    a, d = m.num_attention_heads, _head_dim(m)
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
    e, t = _DTYPE_BYTES[m.precision], layout.tp
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
    e, t, s = _DTYPE_BYTES[m.precision], layout.tp, shape.seq / layout.cp
    heads, d_inner, _, width = _mamba_sizes(m)
    hy = m.hybrid
    total = _block_input_bytes(m, layout, shape, sequence_parallel)
    total += e * s * shape.batch * (width + 2 * d_inner) / t
    total += 4 * shape.batch * math.ceil(s / hy.mamba_chunk_size) * (heads / t) * hy.mamba_head_dim * hy.mamba_state_dim
    return total


def hybrid_layer_activation_bytes(m: ModelConfig, layout: Layout, shape: Shape, symbol: str, *,
                                  sequence_parallel: bool, fused_attention: bool, keep_scores: bool) -> float:
    """Bytes one layer of a hybrid model keeps for its backward: ``M`` Mamba-2, ``*`` attention only,
    ``-`` dense MLP only, ``E`` MoE only (each a pre-norm block with its residual)."""
    if symbol == "M":
        return mamba_block_bytes(m, layout, shape, sequence_parallel)
    if symbol == "*":
        return _attention_block_bytes(m, layout, shape, sequence_parallel, fused_attention, keep_scores)
    return _mlp_block_bytes(m, layout, shape, sequence_parallel, moe_layer=symbol == "E")


def training_activation_bytes(cfg: RunConfig, layout: Layout, shape: Shape, in_flight: int) -> float:
    """Activation bytes on the first pipeline stage (it holds ``in_flight`` micro-batches under 1F1B).

    none: every layer's saved tensors; selective: the attention core is recomputed (no [s x s]
    scores); full: only each ``recompute_num_layers`` chunk's input is kept, plus one chunk
    recomputed during its backward (hybrid: the chunk of the stage whose layers keep the most).
    """
    m = cfg.model
    sp, fused = cfg.parallel.sequence_parallel, cfg.cluster.transformer_engine
    layers = m.num_layers // layout.pp
    if m.architecture == "hybrid":
        return _hybrid_activation_bytes(m, layout, shape, in_flight, sequence_parallel=sp, fused_attention=fused)

    def layer(index: int, keep_scores: bool) -> float:
        return layer_activation_bytes(m, layout, shape, sequence_parallel=sp, fused_attention=fused,
                                      keep_scores=keep_scores, moe_layer=_is_moe_layer(m, index))

    if m.recompute == "full":
        chunk = min(m.recompute_num_layers, layers)
        inputs = in_flight * math.ceil(layers / chunk) * _chunk_input_bytes(m, layout, shape, sp)
        return inputs + sum(layer(i, True) for i in range(chunk))
    return in_flight * sum(layer(i, m.recompute == "none") for i in range(layers))


def _chunk_input_bytes(m: ModelConfig, layout: Layout, shape: Shape, sequence_parallel: bool) -> float:
    """The hidden states a full-recompute chunk keeps for its backward: its input [s/cp (/t under SP), b, h]."""
    chunk_input = _DTYPE_BYTES[m.precision] * shape.seq / layout.cp * shape.batch * m.hidden_size
    return chunk_input / (layout.tp if sequence_parallel else 1)


def _hybrid_activation_bytes(m: ModelConfig, layout: Layout, shape: Shape, in_flight: int, *,
                             sequence_parallel: bool, fused_attention: bool) -> float:
    """Activations of the most loaded stage of a hybrid model, layer by layer from its pattern."""
    symbols = _symbols_on_stage(m, layout)

    def kept(chunk: str, keep_scores: bool) -> float:
        return sum(hybrid_layer_activation_bytes(m, layout, shape, symbol, sequence_parallel=sequence_parallel,
                                                 fused_attention=fused_attention, keep_scores=keep_scores)
                   for symbol in chunk)

    if m.recompute != "full":
        return in_flight * kept(symbols, keep_scores=m.recompute == "none")
    size = min(m.recompute_num_layers, len(symbols))
    chunks = [symbols[i:i + size] for i in range(0, len(symbols), size)]
    inputs = in_flight * len(chunks) * _chunk_input_bytes(m, layout, shape, sequence_parallel)
    return inputs + max(kept(chunk, keep_scores=True) for chunk in chunks)


def logits_bytes(m: ModelConfig, layout: Layout, tokens: float) -> float:
    """Output-layer logits [tokens, V/t] kept for the log-prob backward, and their gradient."""
    return 2 * _DTYPE_BYTES[m.precision] * tokens * m.padded_vocab_size / layout.tp


def fused_head_bytes(m: ModelConfig, layout: Layout, tokens: float) -> float:
    """The fused log-prob head's working set (``ops/fused_output_logprobs.py``) for ``tokens`` positions.

    Its op keeps the hidden states it reads (all-gathered over the sequence under SP: [tokens, h]) and
    produces their gradient; each chunk of about 2^24 / (V/t) tokens fills [chunk, V/t] buffers: the
    logits in the model dtype, their float32 copy (16-bit models) and, in forward, the float32 softmax;
    the backward adds a weight-sized buffer for each chunk's 16-bit weight gradient.
    """
    e = _DTYPE_BYTES[m.precision]
    upcast = 4 if e != 4 else 0
    forward = _HEAD_CHUNK_ELEMENTS * (e + upcast + 4)
    weight_grad = e * m.padded_vocab_size / layout.tp * m.hidden_size if upcast else 0
    backward = _HEAD_CHUNK_ELEMENTS * (e + upcast) + weight_grad
    return 2 * e * tokens * m.hidden_size + max(forward, backward)


def samples_truncated(stage: ResolvedStage) -> bool:
    """Whether ``stage`` trains on log-probs of a top-k / top-p truncated distribution (its rollouts
    sample with temperature > 0 and ``rollout.top_k`` > 0 or ``top_p`` < 1, ``stages/sampling_spec.py``):
    those need the whole logit row, so the fused head cannot run (``training/output_head.py``)."""
    r = stage.rollout
    return stage_type(stage.type).generates and r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0)


def prefill_bytes(m: ModelConfig, layout: Layout, shape: Shape, *, fused_attention: bool) -> float:
    """Largest set of live tensors while one layer runs the prompt forward (no grad, nothing kept):
    the residual and norm output plus the attention block's or the MLP/experts' intermediates."""
    e, t = _DTYPE_BYTES[m.precision], layout.tp
    tokens = shape.seq * shape.batch
    h, a, d = m.hidden_size, m.num_attention_heads, _head_dim(m)
    g = m.num_query_groups or a
    gate = 2 if m.activation == "swiglu" else 1
    attention = tokens * d * (2 * a + 2 * g) / t  # Q, K, V and the core-attention output
    if not fused_attention:
        attention += shape.batch * (a / t) * shape.seq**2  # the [s x s] scores of unfused attention
    if m.moe.num_experts:
        e_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size or 4 * h
        routed = tokens * m.moe.router_topk * shape.routed_load
        mlp = routed * (h + e_ffn * (gate + 1) / layout.etp)
    else:
        mlp = tokens * (m.ffn_hidden_size or 4 * h) * (gate + 1) / t
    return e * (2 * tokens * h + max(attention, mlp))


def kv_bytes_per_token(m: ModelConfig, layout: Layout) -> float:
    """K and V of one token in every attention layer of the most loaded pipeline stage, this rank's KV heads."""
    groups = m.num_query_groups or m.num_attention_heads
    layers = _symbols_on_stage(m, layout).count("*") if m.architecture == "hybrid" else m.num_layers // layout.pp
    return 2 * layers * max(groups // layout.tp, 1) * _head_dim(m) * _DTYPE_BYTES[m.precision]


def mamba_state_bytes_per_sample(m: ModelConfig, layout: Layout) -> float:
    """One sample's generation state in the Mamba layers of the most loaded stage: the conv state
    [conv channels / t, kernel] and the SSM state [heads / t, head dim, state] per layer (model dtype)."""
    if m.architecture != "hybrid":
        return 0.0
    heads, _, conv, _ = _mamba_sizes(m)
    hy = m.hybrid
    per_layer = conv * hy.mamba_conv_kernel + heads * hy.mamba_head_dim * hy.mamba_state_dim
    return _symbols_on_stage(m, layout).count("M") * per_layer / layout.tp * _DTYPE_BYTES[m.precision]


@dataclass(frozen=True)
class GenerationPlan:
    """The paged generator's memory and concurrency on one GPU (``rollout/engine.py``), bytes.

    KV blocks are taken on demand: a sample holds the blocks of its tokens so far (plus, for a hybrid
    model, one conv + SSM state slot), so how many decode at once depends on how long responses
    get; the plan takes them at ``rollout.expected_response_fraction`` of ``max_new_tokens``. The
    ``samples_per_prompt`` samples of a prompt share its full blocks (``rollout/block_allocator.py``):
    a sample's figures count its share of them.
    """

    kv_cache: float  # KV blocks (at most every local sample at its longest, + the dummy) + Mamba state slots
    step: float  # one forward step: its largest layer intermediates and the sampled rows' logits
    concurrent: int  # local samples decoding at once, at their expected length
    samples: int  # local samples of a step (one model replica's)
    gpus: int  # GPUs of one model replica (TP x PP x CP): they decode its samples together
    expected_kv: float  # one sample's KV blocks at its expected length (its share of the prompt's)
    worst_kv: float  # ... at its longest (prompt + max_new_tokens)
    state: float  # one sample's Mamba state slot (hybrid models; 0 otherwise)
    capacity: int  # samples the cache holds at once at their expected length (whatever a step has)
    stages_in_series: int = 1  # pipeline stages that decode one after another (the training layout's PP)
    group: int = 1  # samples per prompt: they share the prompt's full blocks

    @property
    def prompt_sharing(self) -> str:
        return f" (prompt shared by {self.group})" if self.group > 1 else ""

    @property
    def concurrent_per_gpu(self) -> float:
        return self.concurrent / self.gpus

    @property
    def capacity_per_gpu(self) -> float:
        return self.capacity / self.gpus


def generation_plan(cfg: RunConfig, layout: Layout, stage: ResolvedStage, free_bytes: float) -> GenerationPlan:
    """What the paged generator allocates for ``stage`` (``rollout/kv_budget.cache_capacity``): the
    budget is ``rollout.kv_cache_bytes`` (or ``kv_cache_fraction`` of ``free_bytes``, the memory left
    by weights, optimizer and frozen models); a hybrid model first takes a state slot for as many
    samples as fit at their expected length, the rest are KV blocks, at most what every local sample
    needs at its longest. A step runs at most max(16384, the longest sample + the live requests)
    tokens (a preempted sample is prefilled again from prompt + response) through flash attention
    (no [s x s] scores) and the output layer on each request's last token.

    Raises ``ConfigError`` when the budget cannot hold one sample at its longest (generation would
    refuse to start).
    """
    m, r = cfg.model, stage.rollout
    samples = stage.prompts_per_step * stage.samples_per_prompt // layout.dp
    prompt = min(cfg.data.max_prompt_tokens, m.max_position_embeddings)
    longest = min(prompt + r.max_new_tokens, m.max_position_embeddings)
    expected_len = min(prompt + math.ceil(r.expected_response_fraction * r.max_new_tokens), longest)
    block = r.kv_block_size_tokens * kv_bytes_per_token(m, layout)
    group = stage.samples_per_prompt
    shared = prompt // r.kv_block_size_tokens if group > 1 else 0  # the prompt's full blocks, held once per group

    def per_sample(tokens: int) -> float:  # blocks of one sample of ``tokens`` tokens, its share of the prompt's
        return (math.ceil(tokens / r.kv_block_size_tokens) - shared + shared / group) * block

    worst, expected = per_sample(longest), per_sample(expected_len)
    alone = math.ceil(longest / r.kv_block_size_tokens) * block  # a sample without its group (e.g. preempted)
    state = mamba_state_bytes_per_sample(m, layout)
    budget = r.kv_cache_bytes if r.kv_cache_bytes is not None else r.kv_cache_fraction * free_bytes
    one = alone + block + state  # one sample at its longest, its state slot and Megatron's dummy block
    if budget < one and r.kv_cache_bytes is None and free_bytes <= 0:
        budget = one  # the static state alone overflows (the plan warns): plan one sample
    if budget < one:
        key = "rollout.kv_cache_bytes" if r.kv_cache_bytes is not None else "rollout.kv_cache_fraction"
        with_state = f" + {state / GIB:.2f} GiB of Mamba state" if state else ""
        raise ConfigError(f"stage {stage.name}: the KV cache budget ({budget / GIB:.1f} GiB from {key}) cannot hold "
                          f"one sample of {prompt} + {r.max_new_tokens} tokens ({alone / GIB:.2f} GiB per GPU"
                          f"{with_state}): raise it, lower rollout.max_new_tokens / data.max_prompt_tokens, or split "
                          "the KV heads over more TP ranks / the layers over more PP stages")
    slots = max(1, min(samples, int(budget // (state + expected)))) if state else samples
    blocks = min(int((budget - slots * state) // block) - 1, math.ceil(samples * worst / block))
    capacity = int((budget - block) // (expected + state))
    concurrent = min(samples, slots, blocks * block // expected)
    tokens = max(16384, longest + concurrent)
    step = prefill_bytes(m, layout, Shape(tokens, 1, routed_load(cfg, layout)), fused_attention=True)
    if m.architecture == "hybrid":
        e = _DTYPE_BYTES[m.precision]
        _, d_inner, _, width = _mamba_sizes(m)
        step = max(step, e * tokens * (2 * m.hidden_size + (width + d_inner) / layout.tp))  # in_proj out, scan out
    step += (_DTYPE_BYTES[m.precision] + 4) * concurrent * m.padded_vocab_size  # gathered logits, sampled in fp32
    return GenerationPlan(kv_cache=(blocks + 1) * block + slots * state, step=step, concurrent=int(concurrent),
                          samples=samples, gpus=layout.tp * layout.pp * layout.cp, expected_kv=expected,
                          worst_kv=worst, state=state, capacity=capacity, stages_in_series=layout.pp, group=group)


# -- one stage's plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """GiB per GPU (host: per node) for one stage."""

    static: float  # weights + grads + optimizer
    frozen: float  # KL reference or resident MOPD teacher
    kv_cache: float
    generation: float  # KV cache + one generation step (layer intermediates, sampled rows' logits)
    activations: float
    logits: float  # the output head: truncated sampling's logits and their gradient, else the fused head
    host_teachers: float  # offloaded MOPD teachers, per node
    overhead: float  # cluster.runtime_overhead_gib: CUDA context, NCCL, workspaces
    generation_plan: Optional[GenerationPlan] = None  # generating stages
    decode_copy: float = 0.0  # the decode copy's weights (rollout.parallel), resident; refit per step
    decode_layout: Optional[Layout] = None

    @property
    def training(self) -> float:
        return self.activations + self.logits

    @property
    def peak(self) -> float:
        # The decode copy holds its weights while generating only (released for training, refit after).
        return self.static + self.frozen + max(self.decode_copy + self.generation, self.training) + self.overhead


def stage_memory(cfg: RunConfig, layout: Layout, stage: ResolvedStage) -> StageMemory:
    """The memory plan of ``stage`` on one GPU (see the module docstring)."""
    m = cfg.model
    e = _DTYPE_BYTES[m.precision]
    dense, expert = params_per_gpu(cfg, layout)
    kind = stage_type(stage.type)
    samples = stage.prompts_per_step * (stage.samples_per_prompt if kind.generates else 1) // layout.dp
    prompt = min(cfg.data.max_prompt_tokens, m.max_position_embeddings)
    seq = min(m.max_position_embeddings, prompt + (stage.rollout.max_new_tokens if kind.generates else 0))
    micro = stage.training.micro_batch_size
    in_flight = min(layout.pp, max(1, math.ceil(samples / micro)))
    train_shape = Shape(seq, micro, routed_load(cfg, layout))
    activations = training_activation_bytes(cfg, layout, train_shape, in_flight)
    head = logits_bytes if samples_truncated(stage) else fused_head_bytes
    logits = head(m, layout, seq / layout.cp * micro)
    frozen_weights = e * (dense + expert)
    with_reference = kind.kl_reference and stage.loss.kl_coef > 0
    frozen = frozen_weights if (with_reference or kind.teachers) else 0.0
    static = memory_per_gpu(cfg, layout.world_size)["total_gib"] * GIB
    kv = generation = copy = 0.0
    gen = decode = None
    if kind.generates:
        # A decode layout generates on its own copy of the weights (no optimizer state); the training
        # state stays resident beside it.
        decode = check_decode_layout(cfg, stage, layout.world_size)
        if decode is not None:
            copy = decode_copy_bytes(cfg, decode)
        free = cfg.cluster.gpu_memory_gib * GIB - static - copy - frozen - cfg.cluster.runtime_overhead_gib * GIB
        gen = generation_plan(cfg, decode or layout, stage, free)
        kv, generation = gen.kv_cache, gen.kv_cache + gen.step
    distinct_teachers = len(set(stage.teachers.values())) if kind.teachers else 0
    host = distinct_teachers * frozen_weights * cfg.cluster.gpus_per_node
    return StageMemory(static / GIB, frozen / GIB, kv / GIB, generation / GIB, activations / GIB, logits / GIB,
                       host / GIB, cfg.cluster.runtime_overhead_gib, gen, copy / GIB, decode)


def _concurrency(mem: StageMemory) -> str:
    gen = mem.generation_plan
    if gen is None:
        return ""
    mib = 2**20
    state = f" + state {gen.state / mib:.0f}" if gen.state else ""
    return (f"; per sample {gen.expected_kv / mib:.0f} MiB expected / {gen.worst_kv / mib:.0f} worst"
            f"{gen.prompt_sharing}{state}; "
            f"{gen.concurrent} of {gen.samples} samples at once = {gen.concurrent_per_gpu:.1f}/GPU, "
            f"room for {gen.capacity_per_gpu:.0f}/GPU{_in_series(gen)}")


def _in_series(gen: GenerationPlan) -> str:
    if gen.stages_in_series == 1:
        return ""
    return (f"; {gen.stages_in_series} pipeline stages decode in series: "
            f"{gen.concurrent_per_gpu / gen.stages_in_series:.1f}/GPU at work")


def _memory_line(name: str, mem: StageMemory, stage: ResolvedStage, cfg: RunConfig) -> str:
    frozen = ""
    if mem.frozen:
        frozen = f" + {'teacher' if stage_type(stage.type).teachers else 'kl-reference'} {mem.frozen:.1f}"
    host = f"; host: {mem.host_teachers:.1f} GiB/node of offloaded teachers" if mem.host_teachers else ""
    copy = f"decode copy {mem.decode_copy:.1f} + " if mem.decode_layout is not None else ""
    return (f"  {name:<16} peak {mem.peak:6.1f} GiB = static {mem.static:.1f}{frozen} + max({copy}generation "
            f"{mem.generation:.1f} [KV cache {mem.kv_cache:.1f}{_concurrency(mem)}], training {mem.training:.1f} [activations "
            f"{mem.activations:.1f} recompute={cfg.model.recompute}, {_head_name(stage)} {mem.logits:.1f}]) + runtime "
            f"{mem.overhead:.1f}{host}")


def _head_name(stage: ResolvedStage) -> str:
    return "logits (top-k/top-p)" if samples_truncated(stage) else "fused head"


def describe_plan(cfg: RunConfig) -> str:
    """The dry-run text: layout, parameters, memory per GPU, one line per stage; ``ConfigError`` for
    a layout or option the code cannot run."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    layout = resolve_layout(cfg.model, cfg.parallel, world, check_this_machine=False)
    check_runnable(cfg, layout)
    counts = count_parameters(cfg.model)
    mem = memory_per_gpu(cfg, world)
    lines = [
        f"cluster: {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s) = {world} ranks, "
        f"{cfg.cluster.gpu_memory_gib:g} GiB each, transformer_engine={cfg.cluster.transformer_engine}",
        f"layout: TP={layout.tp} PP={layout.pp} CP={layout.cp} EP={layout.ep} ETP={layout.etp} DP={layout.dp} "
        f"expert-DP={layout.expert_dp} sequence_parallel={cfg.parallel.sequence_parallel} "
        f"distributed_optimizer={cfg.parallel.use_distributed_optimizer}",
        f"model: {counts.total / 1e9:.2f}B parameters ({counts.expert / 1e9:.2f}B in routed experts), "
        f"precision={cfg.model.precision}, fp8={cfg.model.fp8.format or 'off'}, recompute={cfg.model.recompute}",
        f"memory per GPU (weights + grads + optimizer): {mem['total_gib']:.1f} GiB "
        f"= {mem['weights_gib']:.1f} + {mem['grads_gib']:.1f} + {mem['optimizer_gib']:.1f} "
        f"of {cfg.cluster.gpu_memory_gib:.0f} GiB",
        "stages:",
    ]
    stages = [resolve_stage(cfg, stage_cfg) for stage_cfg in cfg.stages]
    for s in stages:
        teachers = f" teachers={s.teachers}" if s.teachers else ""
        lines.append(
            f"  {s.name:<14} {s.type:<5} steps={s.steps:<4} batch={s.prompts_per_step}x{s.samples_per_prompt} "
            f"max_new_tokens={s.rollout.max_new_tokens} lr={s.optimizer.lr:g} kl={s.loss.kl_coef:g} "
            f"domains={s.domains}{teachers}")
        decode = check_decode_layout(cfg, s, world) if stage_type(s.type).generates else None
        if decode is not None:
            copy = decode_copy_bytes(cfg, decode)
            graphs = (f"; decode steps on {s.rollout.cuda_graphs} CUDA graph sizes, captured per generate call"
                      if s.rollout.cuda_graphs else "")
            lines.append(f"    decode layout: TP={decode.tp} EP={decode.ep} ETP={decode.etp} DP={decode.dp} "
                         f"(rollout.parallel; refit {copy / GIB:.2f} GiB per GPU per step, in memory{graphs})")
    load = routed_load(cfg, layout)
    lines.append("memory plan per GPU (GiB; peak = static + frozen models + max([decode copy +] generation, training) "
                 "+ runtime overhead" + (f"; routed experts at {load:g}x the mean load" if load > 1 else "") + "):")
    warnings = []
    for s in stages:
        plan = stage_memory(cfg, layout, s)
        lines.append(_memory_line(s.name, plan, s, cfg))
        if plan.peak > cfg.cluster.gpu_memory_gib:
            warnings.append(f"WARNING: stage {s.name}: {plan.peak:.1f} GiB per GPU exceeds cluster.gpu_memory_gib="
                            f"{cfg.cluster.gpu_memory_gib:g}")
    return "\n".join(lines + warnings)
