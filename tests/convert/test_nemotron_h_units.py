"""nemotron_h config mapping, refusals, layouts and spec names (no processes, no weights)."""

from __future__ import annotations

import pytest

from megatron_cascade.convert import ConversionError, model_config_from_hf, validate_layout
from megatron_cascade.convert.hf_config import hf_config_from_model
from megatron_cascade.models.nemotron_h import FAMILY as NEMOTRON_H
from megatron_cascade.convert.spec_names import resolve_spec_names
from megatron_cascade.model.builder import validate_model_config

PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
# Nemotron-3-Nano-30B-A3B's architecture (the facts of shared/notes/nemotron_h.md), in the HF spelling.
NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": PATTERN,
    "num_hidden_layers": 52, "hidden_size": 2688, "num_attention_heads": 32, "num_key_value_heads": 2,
    "head_dim": 128, "intermediate_size": 1856, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 128,
    "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
    "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
    "mamba_proj_bias": False, "attention_bias": False, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
    "vocab_size": 131072, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}


def test_nemotron_3_nano_config_maps_every_field():
    family, cfg = model_config_from_hf(NANO, "nano/config.json")
    assert family is NEMOTRON_H
    validate_model_config(cfg)
    assert (cfg.architecture, cfg.num_layers, cfg.hybrid.layer_pattern) == ("hybrid", 52, PATTERN)
    assert [PATTERN.count(s) for s in "ME*"] == [23, 23, 6]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (2688, 32, 2, 128)
    h = cfg.hybrid
    assert (h.mamba_num_heads, h.mamba_head_dim, h.mamba_state_dim, h.mamba_num_groups, h.mamba_conv_kernel,
            h.mamba_chunk_size) == (64, 64, 128, 8, 4, 128)
    m = cfg.moe
    assert (m.num_experts, m.router_topk, m.ffn_hidden_size, m.shared_expert_intermediate_size) == (128, 6, 1856, 3712)
    assert (m.router_score_function, m.router_enable_expert_bias, m.router_topk_scaling_factor,
            m.router_load_balancing_type) == ("sigmoid", True, 2.5, "none")
    assert (cfg.activation, cfg.position_embedding_type, cfg.normalization, cfg.norm_epsilon) == \
        ("squared_relu", "none", "RMSNorm", 1e-5)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.tie_embeddings, cfg.precision) == (131072, 131072, False, "bf16")


def test_exported_config_reads_back_and_transformers_accepts_it():
    import transformers

    _, cfg = model_config_from_hf(NANO, "nano/config.json")
    hf = hf_config_from_model(cfg, NEMOTRON_H, None, "bf16")
    assert hf["hybrid_override_pattern"] == PATTERN and len(hf["layers_block_type"]) == 52
    assert model_config_from_hf(hf, "exported")[1] == cfg
    parsed = transformers.NemotronHConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert parsed.hybrid_override_pattern == PATTERN and parsed.n_groups == 8 and parsed.n_routed_experts == 128


def test_export_keeps_the_templates_spelling():
    legacy = {k: v for k, v in NANO.items() if k != "n_groups"} | {"mamba_n_groups": 8}
    _, cfg = model_config_from_hf(legacy, "legacy/config.json")
    hf = hf_config_from_model(cfg, NEMOTRON_H, legacy, "bf16")
    assert hf["mamba_n_groups"] == 8 and "n_groups" not in hf and "layers_block_type" not in hf
    assert hf == legacy


@pytest.mark.parametrize("change,needle", [
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
    ({"moe_latent_size": 512}, "moe_latent_size=512"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    ({"n_group": 4, "topk_group": 2}, "grouped routing"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"hybrid_override_pattern": "M*ME/"}, "hybrid_override_pattern='M*ME/'"),
    ({"layers_block_type": ["mamba", "sliding_attention"]}, "sliding_attention"),
])
def test_unsupported_features_are_refused_naming_the_key(change, needle):
    with pytest.raises(ConversionError) as info:
        model_config_from_hf({**NANO, **change}, "nano/config.json")
    assert needle in str(info.value) and "nano/config.json" in str(info.value)


def test_tp_is_bounded_by_the_mamba_groups_and_kv_heads_may_be_replicated():
    _, cfg = model_config_from_hf(NANO, "nano/config.json")
    for tp in (1, 2, 4, 8):  # 2 KV heads: split at TP 2, replicated at 4 and 8
        validate_layout(cfg, tp=tp, ep=8)
    with pytest.raises(ConversionError, match="--tp=16: .*mamba_num_groups=8"):
        validate_layout(cfg, tp=16)
    with pytest.raises(ConversionError, match="--tp=3"):
        validate_layout(cfg, tp=3)


def test_norms_and_experts_map_to_the_transformer_engine_specs_names():
    _, cfg = model_config_from_hf(NANO, "nano/config.json")
    te_names = {  # layer 0 (M) and 1 (E) of megatron-core's mamba_stack_spec (grouped-GEMM experts), 5 (*)
        "decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.experts.linear_fc1.weight7",
        "decoder.layers.5.self_attention.linear_qkv.layer_norm_weight",
    }
    resolved = {}
    for layer in (0, 1, 5):
        resolved.update(resolve_spec_names(NEMOTRON_H.layer_names(cfg, layer), te_names))
    assert resolved["decoder.layers.0.mixer.in_proj.layer_norm_weight"] == "backbone.layers.0.norm.weight"
    assert resolved["decoder.layers.1.pre_mlp_layernorm.weight"] == "backbone.layers.1.norm.weight"
    expert = resolved["decoder.layers.1.mlp.experts.linear_fc1.weight7"]
    assert expert == "backbone.layers.1.mixer.experts.7.up_proj.weight"
    assert resolved["decoder.layers.5.self_attention.linear_qkv.layer_norm_weight"] == "backbone.layers.5.norm.weight"
    # names the model has stay as they are (the local spec)
    local = resolve_spec_names(NEMOTRON_H.layer_names(cfg, 0), {"decoder.layers.0.norm.weight"})
    assert local["decoder.layers.0.norm.weight"] == "backbone.layers.0.norm.weight"
