"""What the code (or the libraries under it) cannot run: refused by the dry run and at the start of a run."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron_cascade.cascade.plan.params import DTYPE_BYTES, head_dim, params_per_gpu
from megatron_cascade.config import ConfigError, RunConfig, resolve_stage
from megatron_cascade.config.model import FP8Config
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.model import Layout, resolve_layout
from megatron_cascade.models.architectures import MOE, megatron_architecture

_FP8_ALIGN = 16  # TE FP8 GEMMs need both operand dims divisible by 16


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
    return any(MOE not in layer for layer in megatron_architecture(m).layer_blocks(m))


def uses_cuda_graphs(cfg: RunConfig) -> bool:
    """Whether a stage of the run decodes with CUDA graphs (``rollout.cuda_graphs``)."""
    return any(resolve_stage(cfg, stage_cfg).rollout.cuda_graphs is not None for stage_cfg in cfg.stages)


def decode_copy_bytes(cfg: RunConfig, decode: Layout) -> float:
    """Bytes of the decode copy's weights on one GPU (model dtype): what each refit moves into it."""
    return DTYPE_BYTES[cfg.model.precision] * sum(params_per_gpu(cfg, decode))


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
            ("model.num_attention_heads x head dim", m.num_attention_heads * head_dim(m), layout.tp)]
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
