"""``run --dry-run`` refuses what the code cannot run (naming the key) and its memory plan adds
activations, logits, the generation KV cache and frozen models; the activation term is checked
against Korthikanti et al. 2022's closed forms computed by hand."""

from __future__ import annotations

import textwrap

import pytest

from megatron_cascade.cascade.plan import (
    Shape,
    describe_plan,
    kv_cache_bytes,
    layer_activation_bytes,
    stage_memory,
    training_activation_bytes,
)
from megatron_cascade.config import ConfigError, load_config, resolve_stage
from megatron_cascade.model import resolve_layout

SMALL = """
output_dir: {out}
model: {{num_layers: 4, hidden_size: 64, num_attention_heads: 4, vocab_size: 256, precision: bf16}}
cluster: {{nodes: 1, gpus_per_node: 4, gpu_memory_gib: 80}}
domains: {{math: {{train: {out}/train.jsonl}}}}
stages:
  - {{name: rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 2, domains: {{math: 1.0}}}}
"""
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.router_load_balancing_type=none"]


def small_config(tmp_path, *overrides: str, sft: bool = False):
    text = textwrap.dedent(SMALL.format(out=tmp_path))
    if sft:
        text = text.replace("type: grpo", "type: sft")
    path = tmp_path / "small.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


REFUSED = {
    "cp": (["parallel.context_parallel_size=2"], False, "parallel.context_parallel_size=2"),
    "sp_with_rollouts": (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], False,
                         "parallel.sequence_parallel=true"),
    "param_gather_without_dist_opt": (["parallel.overlap_param_gather=true"], False,
                                      "parallel.overlap_param_gather"),
    "flex_dispatcher": ([*MOE, "model.moe.token_dispatcher_type=flex"], False, "model.moe.token_dispatcher_type"),
    "grouped_gemm_without_te": ([*MOE, "model.moe.grouped_gemm=true", "cluster.transformer_engine=false"], False,
                                "model.moe.grouped_gemm"),
    "fp8_without_te": (["model.fp8.format=hybrid", "cluster.transformer_engine=false"], False, "model.fp8.format"),
    "fp8_moe_without_grouped_gemm": ([*MOE, "model.fp8.format=hybrid"], False, "model.moe.grouped_gemm"),
    "fp8_unaligned_width": (["model.fp8.format=hybrid", "model.hidden_size=72", "model.num_attention_heads=4"],
                            False, "model.hidden_size=72"),
    "megatron_topk1_without_pre_softmax": ([*MOE, "model.moe.router_topk=1"], False,
                                           "model.moe.router_pre_softmax"),
    "prompts_not_divisible_by_dp": (["stages.rl.prompts_per_step=6"], False, "prompts_per_step=6"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_dry_run_refuses_what_cannot_run_naming_the_key(tmp_path, case):
    overrides, sft, key = REFUSED[case]
    cfg = small_config(tmp_path, *overrides, sft=sft)
    with pytest.raises(ConfigError) as info:
        describe_plan(cfg)
    assert key in str(info.value), str(info.value)


def test_sequence_parallel_is_fine_for_sft_only_runs_without_eval(tmp_path):
    sp = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
    assert "layout: TP=2" in describe_plan(small_config(tmp_path, *sp, sft=True))
    # Evaluation after the stage generates too.
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true.*eval.enabled"):
        describe_plan(small_config(tmp_path, *sp, f"domains.math.eval={tmp_path}/eval.jsonl", sft=True))


def korthikanti_per_layer(s, b, h, a, t, sp):
    """Eq. of Korthikanti et al. 2022 (bytes, 16-bit activations, dropout on, MHA, 4h GELU MLP)."""
    replicated = 34 / t if sp else 10 + 24 / t
    return s * b * h * (replicated + 5 * a * s / (h * t))


@pytest.mark.parametrize("sp", [False, True])
def test_activation_term_matches_korthikanti_by_hand(tmp_path, sp):
    # The paper's setting: MHA, GELU 4h MLP, dropout on both; unfused attention (local spec).
    cfg = small_config(tmp_path, "model.activation=gelu", "model.attention_dropout=0.1", "model.hidden_dropout=0.1",
                       "parallel.tensor_model_parallel_size=2", f"parallel.sequence_parallel={str(sp).lower()}",
                       "cluster.transformer_engine=false", sft=True)
    layout = resolve_layout(cfg.model, cfg.parallel, 4, check_this_machine=False)
    s, b, h, a, t = 96, 3, 64, 4, 2
    got = layer_activation_bytes(cfg.model, layout, Shape(s, b), sequence_parallel=sp, fused_attention=False,
                                 keep_scores=True, moe_layer=False)
    assert got == pytest.approx(korthikanti_per_layer(s, b, h, a, t, sp))
    # Selective recompute drops the 5as/h score term: sbh * 34/t with SP.
    selective = layer_activation_bytes(cfg.model, layout, Shape(s, b), sequence_parallel=sp, fused_attention=False,
                                       keep_scores=False, moe_layer=False)
    assert selective == pytest.approx(s * b * h * (34 / t if sp else 10 + 24 / t))
    # Whole model, 4 layers, 1 micro-batch in flight (PP=1).
    assert training_activation_bytes(cfg, layout, Shape(s, b), 1) == pytest.approx(4 * got)


def test_full_recompute_keeps_layer_inputs_plus_one_recomputed_layer(tmp_path):
    cfg = small_config(tmp_path, "model.recompute=full", "model.activation=gelu", "cluster.transformer_engine=false",
                       sft=True)
    layout = resolve_layout(cfg.model, cfg.parallel, 4, check_this_machine=False)
    s, b, h = 128, 2, 64
    one_layer = layer_activation_bytes(cfg.model, layout, Shape(s, b), sequence_parallel=False,
                                       fused_attention=False, keep_scores=True, moe_layer=False)
    assert training_activation_bytes(cfg, layout, Shape(s, b), 2) == pytest.approx(2 * 4 * 2 * s * b * h + one_layer)


def test_moe_top_k_scales_the_expert_activations(tmp_path):
    cfg1 = small_config(tmp_path, *MOE[:1], "model.moe.router_topk=1", "model.moe.router_pre_softmax=true", sft=True)
    cfg2 = small_config(tmp_path, *MOE[:1], "model.moe.router_topk=2", sft=True)
    layout = resolve_layout(cfg1.model, cfg1.parallel, 4, check_this_machine=False)
    shape = Shape(32, 1)

    def moe(cfg):
        return layer_activation_bytes(cfg.model, layout, shape, sequence_parallel=False, fused_attention=True,
                                      keep_scores=False, moe_layer=True)

    h, f, e = 64, 256, 2  # per routed token: expert input h, fc1 output 2f (SwiGLU), activation output f
    assert moe(cfg2) - moe(cfg1) == pytest.approx(e * 32 * (h + 3 * f))


def test_plan_counts_kv_cache_frozen_models_and_warns_on_overflow(tmp_path):
    cfg = small_config(tmp_path, "stages.rl.loss.kl_coef=0.1", "rollout.max_new_tokens=64",
                       "data.max_prompt_tokens=64")
    layout = resolve_layout(cfg.model, cfg.parallel, 4, check_this_machine=False)
    stage = resolve_stage(cfg, cfg.stages[0])
    plan = stage_memory(cfg, layout, stage)
    # 4 prompts x 2 samples over DP=4: 2 sequences of 64 + 64 tokens; K and V, 4 layers, 4 heads x 16, bf16.
    assert kv_cache_bytes(cfg.model, layout, Shape(128, 2)) == 2 * 4 * 4 * 16 * 2 * 128 * 2
    assert plan.kv_cache * 2**30 == pytest.approx(2 * 4 * 4 * 16 * 2 * 128 * 2)
    assert plan.frozen > 0  # the KL reference
    assert "WARNING" not in describe_plan(cfg)
    tight = small_config(tmp_path, "cluster.gpu_memory_gib=0.0001")
    assert "WARNING: stage rl:" in describe_plan(tight)
