"""The hybrid architecture's config rules, the keys reaching Megatron, and the dry-run plan's hybrid terms
(no model is built here: see test_hybrid_training / test_hybrid_checkpoint for the real model)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from megatron_cascade.cascade.plan import (
    Shape,
    count_parameters,
    block_activation_bytes,
    kv_bytes_per_token,
    mamba_state_bytes_per_sample,
)
from megatron_cascade.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig
from megatron_cascade.config.rules import validate_tree
from megatron_cascade.model import transformer_config
from megatron_cascade.model.parallel import Layout

HYBRID = ModelConfig(
    architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
    position_embedding_type="none", activation="squared_relu",
    hybrid=HybridConfig(layer_pattern="M*ME", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16),
    moe=MoEConfig(num_experts=4, router_topk=2, router_score_function="sigmoid", router_enable_expert_bias=True,
                  router_topk_scaling_factor=2.5))


def _hybrid(**fields):
    return replace(HYBRID, hybrid=replace(HYBRID.hybrid, **fields))


@pytest.mark.parametrize("model,message", [
    (replace(HYBRID, hybrid=HybridConfig()), "model.architecture=hybrid needs model.hybrid.layer_pattern"),
    (_hybrid(layer_pattern="M*M"), "has 3 symbols but model.num_layers=4"),
    (_hybrid(layer_pattern="M*MX"), "model.hybrid.layer_pattern='M*MX' must be a non-empty string of the symbols"),
    (_hybrid(layer_pattern="M*M-"), "has no MoE layer (E) but model.moe.num_experts=4"),
    (replace(HYBRID, moe=MoEConfig()), "has MoE layers (E) but model.moe.num_experts is null"),
    (_hybrid(mamba_num_groups=3), "model.hybrid.mamba_num_groups=3 does not divide the Mamba heads (8"),
    # Full recompute runs for hybrid models (test_hybrid_recompute.py), but not with a load-balancing loss.
    (replace(HYBRID, recompute="full", moe=replace(HYBRID.moe, router_load_balancing_type="aux_loss",
                                                   aux_loss_coeff=0.01)),
     "model.recompute=full cannot be combined with an MoE load-balancing loss"),
    (replace(HYBRID, moe=replace(HYBRID.moe, layer_freq=2)), "model.moe.layer_freq=2 has no meaning"),
    (replace(HYBRID, architecture="gpt"), "model.hybrid.layer_pattern is set but model.architecture='gpt'"),
])
def test_bad_hybrid_config_names_the_key(model, message):
    with pytest.raises(ConfigError, match=_escaped(message)):
        validate_tree(model, "model.")


def _escaped(text: str) -> str:
    return "".join("\\" + c if c in "()[]*.+?" else c for c in text)


@pytest.mark.parametrize("parallel,message", [
    (ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True),
     "parallel.tensor_model_parallel_size=4 does not divide model.hybrid.mamba_num_groups=2"),
    (ParallelConfig(context_parallel_size=2), "parallel.context_parallel_size=2 is not supported with "
                                              "model.architecture=hybrid"),
])
def test_layout_must_give_every_tp_rank_whole_mamba_groups(parallel, message):
    with pytest.raises(ConfigError, match=_escaped(message)):
        transformer_config(HYBRID, parallel)


def test_hybrid_keys_reach_megatron():
    config = transformer_config(HYBRID, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    assert config.is_hybrid_model and not config.gated_linear_unit
    assert (config.mamba_num_heads, config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim) == \
        (8, 8, 2, 16)
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_score_function == "sigmoid"
    x = __import__("torch").tensor([-2.0, 0.5, 3.0])
    assert config.activation_func(x).tolist() == [0.0, 0.25, 9.0]


def test_nemotron_3_nano_parameter_count():
    """The published architecture counts 31.6B parameters, 3.6B of them active per token."""
    nano = ModelConfig(
        architecture="hybrid", num_layers=52, hidden_size=2688, num_attention_heads=32, num_query_groups=2,
        kv_channels=128, vocab_size=131072, position_embedding_type="none", activation="squared_relu",
        hybrid=HybridConfig(layer_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", mamba_num_heads=64,
                            mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8),
        moe=MoEConfig(num_experts=128, router_topk=6, ffn_hidden_size=1856, shared_expert_intermediate_size=3712,
                      router_score_function="sigmoid", router_enable_expert_bias=True, router_topk_scaling_factor=2.5))
    validate_tree(nano, "model.")
    counts = count_parameters(nano)
    assert round(counts.total / 1e9, 2) == 31.58
    assert round((counts.total - counts.expert * (1 - 6 / 128)) / 1e9, 2) == 3.58


LAYOUT = Layout(world_size=2, tp=2, pp=1, cp=1, ep=1, etp=2, dp=1, expert_dp=1)


def test_mamba_activation_and_state_terms_by_hand():
    m = _hybrid(mamba_chunk_size=8)
    s, b, e, t = 20, 3, 4, 2
    heads, d_inner, conv = 8, 64, 64 + 2 * 2 * 16
    width = d_inner + conv + heads
    by_hand = (s * b * 32 * 2 * e / t  # norm and in_proj inputs, SP-sharded
               + e * s * b * (width + 2 * d_inner) / t  # in_proj out, gated-norm and out_proj inputs
               + 4 * b * math.ceil(s / 8) * (heads / t) * 8 * 16)  # fp32 chunk states
    got = block_activation_bytes(m, LAYOUT, Shape(s, b), "M", sequence_parallel=True, fused_attention=True,
                                        keep_scores=False)
    assert got == pytest.approx(by_hand)
    # One sample's decode state: conv [conv channels, kernel] + SSM [heads, head dim, state], per Mamba layer.
    assert mamba_state_bytes_per_sample(m, LAYOUT) == pytest.approx(2 * (conv * 4 + heads * 8 * 16) / t * e)
    # Only the one attention layer of "M*ME" holds K/V: 2 x (2 groups / TP) x head dim 8 x 4 bytes.
    assert kv_bytes_per_token(m, LAYOUT) == 2 * 1 * 1 * 8 * 4


HYBRID_YAML = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "hybrid.yaml")


def test_plan_of_hybrid_generation_takes_state_slots_and_kv_on_demand(tmp_path):
    """Hybrid generation plans one Mamba state slot per sample beside KV blocks taken on demand: samples
    at once follow rollout.kv_cache_bytes at their expected length; less than one sample at its longest
    (with its state and the dummy block) is refused; long prompts are no longer batched by a prefill cap."""
    from megatron_cascade.cascade.plan import generation_plan
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import resolve_layout

    def plan(kv_bytes, *extra):
        cfg = load_config(HYBRID_YAML, [f"output_dir={tmp_path}", f"rollout.kv_cache_bytes={kv_bytes}",
                                        "rollout.max_new_tokens=40", "data.max_prompt_tokens=60",
                                        "rollout.kv_block_size_tokens=16", *extra], check_paths=False)
        layout = resolve_layout(cfg.model, cfg.parallel, 1, check_this_machine=False)
        stage = resolve_stage(cfg, next(s for s in cfg.stages if s.type == "grpo"))
        samples.append((stage.prompts_per_step * stage.samples_per_prompt, stage.samples_per_prompt))
        return generation_plan(cfg, layout, stage, free_bytes=2**30), cfg.model, layout

    samples = []
    gen, m, layout = plan(2**30)
    # hybrid.yaml: hidden 128, heads 8 x 32, groups 2, state 32, kernel 4; "M*ME": 1 attention, 2 Mamba layers.
    block = 16 * 2 * 2 * 32 * 4
    state = 2 * ((256 + 2 * 2 * 32) * 4 + 8 * 32 * 32) * 4
    assert kv_bytes_per_token(m, layout) * 16 == block and mamba_state_bytes_per_sample(m, layout) == state
    # 60 + 40 tokens at their longest: 7 blocks; expected 60 + 20 = 80 tokens: 5 blocks; the prompt's 3 full
    # blocks are shared by the G samples of its group, so a sample counts 3 / G of them.
    n, group = samples[0]
    worst, expected = (4 + 3 / group) * block, (2 + 3 / group) * block
    assert (gen.worst_kv, gen.expected_kv, gen.state) == (worst, expected, state)
    assert n > 5 and (gen.samples, gen.concurrent) == (n, n)
    assert gen.kv_cache == (math.ceil(n * worst / block) + 1) * block + n * state  # all at their longest, a slot each
    gen, _, _ = plan(int(5.5 * (state + expected)))
    assert gen.concurrent == 5 and gen.kv_cache <= 5.5 * (state + expected)
    with pytest.raises(ConfigError, match="cannot hold one sample of 60 \\+ 40 tokens"):
        plan(7 * block + block + state - 1)
    # Long prompts: memory, not a prefill cap, bounds the samples at once; a step holds the longest sample.
    gen, _, _ = plan(2**40, "data.max_prompt_tokens=8000", "model.max_position_embeddings=8040")
    assert gen.concurrent == samples[-1][0]
