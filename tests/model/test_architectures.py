"""Megatron architectures (``models/architectures/``): the blocks each layer holds, from which the dry run
counts parameters, KV and Mamba state, against the models megatron-core builds."""

from __future__ import annotations

import pytest

from megatron_cascade.cascade.plan import count_parameters, kv_bytes_per_token, mamba_state_bytes_per_sample
from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig, MoEConfig
from megatron_cascade.model import Layout
from megatron_cascade.models.architectures import ARCHITECTURES, megatron_architecture
from megatron_cascade.testing import run_distributed

GPT_MODELS = {
    "dense, q/k/v biases, q/k norms, untied": ModelConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100, ffn_hidden_size=48,
        add_qkv_bias=True, qk_layernorm=True, tie_embeddings=False),
    "MoE every other layer, shared expert": ModelConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, ffn_hidden_size=40,
        moe=MoEConfig(num_experts=4, router_topk=2, layer_freq=2, ffn_hidden_size=16,
                      shared_expert_intermediate_size=24)),
}
HYBRID = ModelConfig(architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     vocab_size=100, ffn_hidden_size=64, position_embedding_type="none", activation="squared_relu",
                     hybrid=HybridConfig(layer_pattern="M*M-", mamba_head_dim=8, mamba_num_groups=2,
                                         mamba_state_dim=16))


def _parameters_worker(models: list[ModelConfig]) -> list[int]:
    from megatron_cascade.model import build_model, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=0)
    return [sum(p.numel() for p in build_model(model, ParallelConfig()).parameters()) for model in models]


def test_the_plans_parameter_count_equals_the_built_gpt_models():
    built = run_distributed(_parameters_worker, 1, list(GPT_MODELS.values()))[0]
    assert [count_parameters(model).total for model in GPT_MODELS.values()] == built


def test_gpt_layers_hold_attention_then_mlp_or_moe_and_the_plan_takes_the_moe_heaviest_stage():
    moe = GPT_MODELS["MoE every other layer, shared expert"]
    arch = megatron_architecture(moe)
    assert arch is ARCHITECTURES["gpt"] and arch.layer_blocks(moe) == ["*E", "*-", "*E", "*-"]
    assert arch.stage_layers(moe, 2) == ["*E", "*-"]
    three = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4, vocab_size=100,
                        moe=MoEConfig(num_experts=4, router_topk=2, layer_freq=4))
    assert arch.stage_layers(three, 3) == ["*E", "*-"]  # stage 0 (layer 0) and stage 2 (layer 4) tie: the first


def test_kv_and_mamba_state_follow_the_blocks_on_the_most_loaded_stage():
    layout = Layout(world_size=2, tp=1, pp=2, cp=1, ep=1, etp=1, dp=1, expert_dp=1)
    # Stage 0 holds "M*", stage 1 "M-": the plan's stage is the one with the most stateful blocks.
    assert megatron_architecture(HYBRID).stage_layers(HYBRID, 2) == ["M", "*"]
    per_attention_layer = 2 * 2 * 8 * 4  # K and V x 2 KV heads x head dim 8 x fp32
    assert kv_bytes_per_token(HYBRID, layout) == per_attention_layer
    assert mamba_state_bytes_per_sample(HYBRID, layout) > 0
    dense = GPT_MODELS["dense, q/k/v biases, q/k norms, untied"]
    assert mamba_state_bytes_per_sample(dense, Layout(world_size=1, tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, expert_dp=1)) == 0


def test_an_unknown_architecture_is_named():
    with pytest.raises(KeyError, match="no Megatron architecture 'rwkv'; architectures: \\['gpt', 'hybrid'\\]"):
        megatron_architecture("rwkv")
