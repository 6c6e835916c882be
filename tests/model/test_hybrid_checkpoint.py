"""Hybrid model checkpoints: Transformer Engine names on disk, resume at another layout, architecture check.

A run at TP=2 + sequence parallel trains 2 steps, saves a training checkpoint (weights, optimizer,
schedule), trains 2 more (the uninterrupted reference). A second run at TP=1 resumes from the
checkpoint and trains the same 2 steps: both end at the same weights (fp32, 1e-6; the Mamba in_proj
and conv1d tensors are stored split into their z/x/B/C/dt parts, each sharded over TP on its own).
The resumed run's weights then refuse to load into a model of another layer pattern or a GPT model,
naming the field; the scan chunk size (not an architecture field) may differ.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig, MoEConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(
    architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
    ffn_hidden_size=64, position_embedding_type="none", activation="squared_relu",
    hybrid=HybridConfig(layer_pattern="M*-E", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16,
                        mamba_chunk_size=8),
    moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, shared_expert_intermediate_size=48,
                  router_score_function="sigmoid", router_enable_expert_bias=True))
OPTIM = OptimizerConfig(lr=1e-2, adam_eps=1e-3, weight_decay=0.01)
BATCH, SEQ, STEPS = 4, 16, 4


def _train(policy, steps) -> None:
    from megatron_cascade.training import LossSpec, TrainBatch, train_step

    spec = LossSpec("sft", LossConfig(), vocab_size=MODEL.vocab_size)
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=gen)
        batch = TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:],
                           loss_mask=(torch.rand(BATCH, SEQ, generator=gen) < 0.8).float())
        assert train_step(policy, batch, spec, TrainingConfig(micro_batch_size=2))["skipped"] == 0.0


def _run_worker(parallel: ParallelConfig, root: str, final: str, resume: bool):
    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.model.weights_checkpoint import _stored_metadata
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    initialize_model_parallel(parallel, seed=5)
    policy = build_policy(MODEL, parallel, OPTIM, total_steps=STEPS)
    if resume:
        assert load_training_checkpoint(os.path.join(root, "step_00000002"), policy)["step"] == 2
    else:
        _train(policy, range(2))
        save_training_checkpoint(root, 2, policy, {}, keep_last=1)
    _train(policy, range(2, STEPS))
    save_model_weights(policy.module, final, MODEL)
    stored = sorted(v.key for v in _stored_metadata(final).values())
    at_checkpoint = None if resume else full_state_dict(MODEL, os.path.join(root, "step_00000002", "weights"))
    refusals = [_load_as(final, m) for m in _OTHER_MODELS] if resume else None
    return full_state_dict(MODEL, final), at_checkpoint, stored, refusals


_OTHER_MODELS = [
    replace(MODEL, hybrid=replace(MODEL.hybrid, layer_pattern="*M-E")),
    ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100),
    replace(MODEL, hybrid=replace(MODEL.hybrid, mamba_chunk_size=4)),  # not an architecture field
]


def _load_as(weights: str, model: ModelConfig) -> str:
    """What loading ``weights`` into a model built from ``model`` says (parallel state already set up)."""
    from megatron_cascade.model import CheckpointError, build_gpt_model, load_model_weights

    try:
        load_model_weights(build_gpt_model(model, ParallelConfig()), weights, model)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_ckpt")
    root = str(tmp / "ckpt")
    tp2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    uninterrupted = run_distributed(_run_worker, 2, tp2, root, str(tmp / "a"), False)[0]
    resumed = run_distributed(_run_worker, 1, ParallelConfig(), root, str(tmp / "b"), True)[0]
    return tmp, uninterrupted, resumed


def test_resume_at_tp1_from_tp2_sp_continues_like_an_uninterrupted_run(runs):
    _, (uninterrupted, at_checkpoint, _, _), (resumed, _, _, _) = runs
    for key, want in uninterrupted.items():
        torch.testing.assert_close(resumed[key], want, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    moved = sum(int((at_checkpoint[k] - v).abs().max() > 1e-4) for k, v in uninterrupted.items())
    assert moved > len(uninterrupted) // 2


def test_checkpoint_stores_transformer_engine_names(runs):
    stored = set(runs[1][2])
    prefix = "decoder.layers."
    # Pre-norms as TE fuses them (Mamba, attention, dense MLP); the MoE one separate, as in TE's MoE layer.
    for key in ("0.mixer.in_proj.layer_norm_weight", "1.self_attention.linear_qkv.layer_norm_weight",
                "2.mlp.linear_fc1.layer_norm_weight", "3.pre_mlp_layernorm.weight", "3.mlp.router.expert_bias"):
        assert prefix + key in stored, key
    assert "decoder.final_norm.weight" in stored
    for part in ("z", "x", "B", "C", "dt"):
        assert f"{prefix}0.mixer.in_proj.weight.{part}" in stored
    for part in ("x", "B", "C"):
        assert f"{prefix}0.mixer.conv1d.weight.{part}" in stored
    assert not any(k.endswith((".norm.weight", "input_layernorm.weight")) and ".mixer." not in k for k in stored)


def test_loading_into_another_pattern_or_a_gpt_model_is_refused_naming_the_field(runs):
    messages = runs[2][3]
    assert "hybrid.layer_pattern: checkpoint='M*-E' model='*M-E'" in messages[0], messages[0]
    assert "architecture: checkpoint='hybrid' model='gpt'" in messages[1], messages[1]
    assert messages[2] == "loaded"


def test_dry_run_parameter_count_equals_the_built_model(runs):
    from megatron_cascade.cascade.plan import count_parameters

    weights = runs[1][0]  # every tensor of the TP=1 model (buffers too)
    buffers = ("expert_bias", "local_tokens_per_expert")
    built = sum(t.numel() for k, t in weights.items() if not k.endswith(buffers))
    assert count_parameters(MODEL).total == built
