"""Hugging Face ``nemotron_h`` ``config.json`` <-> ``ModelConfig`` (``model.architecture: hybrid``).

Reads both spellings transformers accepts: ``hybrid_override_pattern`` (the released checkpoints,
e.g. Nemotron-3-Nano-30B-A3B) or ``layers_block_type`` (transformers 5), and the legacy ``mamba_*``
aliases. Features the Megatron model cannot reproduce are refused, naming the HF key.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_cascade.config.model import HybridConfig, ModelConfig, MoEConfig
from megatron_cascade.models.errors import ConversionError

_BLOCK_TO_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                    "moe": "E"}
_SYMBOL_TO_BLOCK = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Each value may be stored under a legacy alias (NemotronHConfig.__post_init__ accepts both).
_ALIASES = {
    "n_groups": ("n_groups", "mamba_n_groups"),
    "conv_kernel": ("conv_kernel", "mamba_d_conv"),
    "chunk_size": ("chunk_size", "mamba_chunk_size"),
    "use_conv_bias": ("use_conv_bias", "mamba_conv_bias"),
}


def _get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    for alias in _ALIASES.get(key, (key,)):
        if alias in hf:
            return hf[alias]
    return default


def _put(hf: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` under whichever of its spellings ``hf`` already uses (else the transformers 5 one)."""
    aliases = _ALIASES.get(key, (key,))
    hf[next((a for a in aliases if a in hf), aliases[0])] = value


def hf_layer_pattern(hf: dict[str, Any], source: str) -> str:
    """The layer pattern (M * - E) of a nemotron_h config."""
    blocks = hf.get("layers_block_type")
    if blocks:
        unknown = sorted({b for b in blocks if b not in _BLOCK_TO_SYMBOL})
        if unknown:
            raise ConversionError(f"{source}: layers_block_type has unknown layer types {unknown}")
        return "".join(_BLOCK_TO_SYMBOL[b] for b in blocks)
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise ConversionError(f"{source}: neither layers_block_type nor hybrid_override_pattern is set")
    if set(pattern) - set(_SYMBOL_TO_BLOCK):
        raise ConversionError(f"{source}: hybrid_override_pattern={pattern!r} has symbols other than M * - E "
                              "(no multi-token-prediction or pipeline markers are supported)")
    return pattern


def _refuse_unsupported(hf: dict[str, Any], source: str) -> None:
    checks = [
        (hf.get("mlp_hidden_act", "relu2") != "relu2", f"mlp_hidden_act={hf.get('mlp_hidden_act')!r} (only relu2)"),
        (hf.get("mamba_hidden_act", "silu") != "silu", f"mamba_hidden_act={hf.get('mamba_hidden_act')!r} (only silu)"),
        (bool(hf.get("use_bias")) or bool(hf.get("mamba_proj_bias")), "use_bias / mamba_proj_bias=true"),
        (not _get(hf, "use_conv_bias", True), "use_conv_bias=false"),
        (bool(hf.get("attention_bias")) or bool(hf.get("mlp_bias")), "attention_bias / mlp_bias=true"),
        (hf.get("moe_latent_size") is not None, f"moe_latent_size={hf.get('moe_latent_size')} (latent MoE)"),
        (int(hf.get("num_nextn_predict_layers") or 0) > 0,
         f"num_nextn_predict_layers={hf.get('num_nextn_predict_layers')} (multi-token prediction layers)"),
        (int(hf.get("n_group", 1)) != 1 or int(hf.get("topk_group", 1)) != 1,
         f"grouped routing (n_group={hf.get('n_group')}, topk_group={hf.get('topk_group')})"),
        (not hf.get("norm_topk_prob", True) and int(hf.get("num_experts_per_tok", 1)) > 1,
         "norm_topk_prob=false (Megatron-Core's sigmoid router always normalises the top-k scores)"),
        (hf.get("sliding_window") is not None, f"sliding_window={hf.get('sliding_window')}"),
    ]
    for failed, what in checks:
        if failed:
            raise ConversionError(f"{source}: {what} is not supported by the Megatron hybrid model; "
                                  "convert a model without it or extend megatron_cascade.model first")


def model_config(hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int,
                            precision: str) -> ModelConfig:
    """The ``ModelConfig`` (architecture hybrid) of a nemotron_h HF config read from ``source``."""
    _refuse_unsupported(hf, source)
    pattern = hf_layer_pattern(hf, source)
    eps = float(hf.get("layer_norm_epsilon", 1e-5))
    if "M" in pattern and eps != 1e-5:
        # Megatron-Core 0.16.1 builds the Mamba mixer's gated norm with eps=1e-5 whatever the config says.
        raise ConversionError(f"{source}: layer_norm_epsilon={eps} is not supported with Mamba layers (Megatron-Core's "
                              "Mamba mixer norm has eps 1e-5 built in)")
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        cfg = ModelConfig(
            architecture="hybrid",
            num_layers=len(pattern),
            hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            kv_channels=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            position_embedding_type="none",
            normalization="RMSNorm",
            norm_epsilon=eps,
            activation="squared_relu",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            precision=precision,
            hybrid=HybridConfig(
                layer_pattern=pattern,
                mamba_num_heads=int(hf["mamba_num_heads"]),
                mamba_head_dim=int(hf["mamba_head_dim"]),
                mamba_state_dim=int(hf["ssm_state_size"]),
                mamba_num_groups=int(_get(hf, "n_groups", 8)),
                mamba_conv_kernel=int(_get(hf, "conv_kernel", 4)),
                mamba_chunk_size=int(_get(hf, "chunk_size", 128)),
            ),
        )
        if "E" in pattern:
            # transformers builds one shared MLP of this width whatever n_shared_experts says.
            shared = int(hf.get("moe_shared_expert_intermediate_size") or 0)
            scaling = float(hf.get("routed_scaling_factor", 1.0))
            cfg.moe = MoEConfig(
                num_experts=int(hf["n_routed_experts"]),
                router_topk=int(hf["num_experts_per_tok"]),
                ffn_hidden_size=int(hf["moe_intermediate_size"]),
                shared_expert_intermediate_size=shared or None,
                router_score_function="sigmoid",
                router_enable_expert_bias=True,
                router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                router_load_balancing_type="none",
            )
    except KeyError as exc:
        raise ConversionError(f"{source}: required key {exc} is missing") from exc
    return cfg


def hf_config(model: ModelConfig, template: dict[str, Any] | None) -> dict[str, Any]:
    """The nemotron_h HF config dict for ``model``: ``template`` (the config imported from) updated.

    Without a template every key the model determines is written, the pattern both as
    ``hybrid_override_pattern`` (NVIDIA's remote code) and ``layers_block_type`` (transformers 5).
    The dtype key is the caller's.
    """
    hf = copy.deepcopy(template) if template else {}
    pattern = model.hybrid.layer_pattern or ""
    hf.update(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        layer_norm_epsilon=model.norm_epsilon,
        tie_word_embeddings=model.tie_embeddings,
        mamba_num_heads=model.hybrid.num_heads(model.hidden_size),
        mamba_head_dim=model.hybrid.mamba_head_dim,
        ssm_state_size=model.hybrid.mamba_state_dim,
        mlp_hidden_act="relu2",
        mamba_hidden_act="silu",
    )
    if model.ffn_hidden_size is not None:
        hf["intermediate_size"] = model.ffn_hidden_size
    _put(hf, "n_groups", model.hybrid.mamba_num_groups)
    _put(hf, "conv_kernel", model.hybrid.mamba_conv_kernel)
    _put(hf, "chunk_size", model.hybrid.mamba_chunk_size)
    if template is None or "num_hidden_layers" in hf:
        hf["num_hidden_layers"] = model.num_layers
    if template is None or "hybrid_override_pattern" in hf:
        hf["hybrid_override_pattern"] = pattern
    if template is None or "layers_block_type" in hf:
        hf["layers_block_type"] = [_SYMBOL_TO_BLOCK[s] for s in pattern]
    moe = model.moe
    if moe.num_experts:
        hf.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                  moe_intermediate_size=moe.ffn_hidden_size or model.ffn_hidden_size,
                  moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                  routed_scaling_factor=moe.router_topk_scaling_factor or 1.0, norm_topk_prob=True)
    return hf
