"""The model-family registry (``megatron_cascade/models/``) and its newest family, Mixtral, which was
added by the README's recipe: its folder, one registry line, one line in the conversion fixtures (the
HF-vs-Megatron logits, EP=2 and round-trip tests of ``test_convert_families.py`` then cover it)."""

from __future__ import annotations

import pytest

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.convert import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_cascade.models.registry import FAMILIES, family_by_architecture, family_of_model

MIXTRAL_HF = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
    "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def test_mixtral_8x7b_config_maps_and_round_trips():
    family, cfg = model_config_from_hf(MIXTRAL_HF, "config.json")
    assert family.name == "mixtral" and cfg.architecture == "gpt" and not cfg.qk_layernorm
    assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (8, 2, 14336)
    assert cfg.moe.router_pre_softmax is False  # softmax, top-2, renormalised = softmax over the top-2
    assert cfg.kv_channels == 128 and cfg.precision == "bf16" and cfg.rotary_base == 1e6
    assert hf_config_from_model(cfg, family, MIXTRAL_HF, "bf16") == MIXTRAL_HF
    names = family.layer_names(cfg, 3)
    assert names["decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"] == \
        "model.layers.3.block_sparse_moe.experts.7.w1.weight+model.layers.3.block_sparse_moe.experts.7.w3.weight"
    assert names["decoder.layers.3.mlp.router.weight"] == "model.layers.3.block_sparse_moe.gate.weight"


def test_mixtral_refuses_sliding_window_attention():
    with pytest.raises(ConversionError, match="sliding-window attention"):
        model_config_from_hf(dict(MIXTRAL_HF, sliding_window=4096), "/m/config.json")


def test_a_model_without_a_recorded_hf_config_exports_as_the_family_that_claims_it():
    moe = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32)
    assert family_of_model(ModelConfig(moe=moe)).name == "mixtral"
    assert family_of_model(ModelConfig(moe=moe, qk_layernorm=True)).name == "qwen3_moe"
    assert family_of_model(ModelConfig(qk_layernorm=True)).name == "qwen3"
    assert family_of_model(ModelConfig(add_qkv_bias=True)).name == "qwen2"
    assert family_of_model(ModelConfig()).name == "llama"
    with pytest.raises(ConversionError, match="no Hugging Face family"):
        family_of_model(ModelConfig(add_qkv_bias=True, qk_layernorm=True))
    claims = [f.name for f in FAMILIES if f.claims(ModelConfig(moe=moe))]
    assert claims == ["mixtral"]  # the families claim disjoint sets


def test_mixtral_export_refuses_unnormalised_routing():
    family = family_by_architecture("MixtralForCausalLM", "config.json")
    cfg = ModelConfig(moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, router_pre_softmax=True))
    with pytest.raises(ConversionError, match="router_pre_softmax"):
        family.check_supported(cfg)
