"""The gradient of one global batch does not depend on how the batch is split.

One global batch of 8 sequences of 23 positions with very different lengths (1 to 20 valid response
tokens), with GRPO (advantages, sampler log-probs for the IS correction, a KL reference) and MOPD
(teacher log-probs, sequence normalisation). Reference: one process, one micro-batch. Then 4
micro-batches, DP=2, TP=2, TP=2 + sequence parallel (23 positions: padded to 24 for SP), PP=2 (each
with 2 micro-batches per rank) and PP=2 x TP=2 + SP. Gradients are compared whole (through a distributed checkpoint
re-assembled at TP=1) to 1e-6 in fp32.

The MoE model (4 experts, top-2, sigmoid scores with expert bias, a per-sequence load-balancing loss
with a large coefficient so that it moves the gradients) runs GRPO at TP=2 + SP (expert TP 2, and
EP=2 with expert TP 1), EP=2 x DP=2 and PP=2; its reference is one process, one micro-batch. Loss, gradients (the
aux loss included) and the expert biases after the step (updated from the global token counts) equal
the reference.
"""

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict, save_gradients_as_checkpoint

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
MOE = replace(MODEL, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, token_dispatcher_type="alltoall",
                                   router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.5,
                                   router_score_function="sigmoid", router_enable_expert_bias=True,
                                   router_bias_update_rate=0.01))
BATCH, SEQ, VOCAB = 8, 23, 100


def _global_batch():
    from megatron_cascade.testing.batches import UNEVEN_SPANS, random_rl_batch

    return random_rl_batch(UNEVEN_SPANS, SEQ, VOCAB)


def _expert_biases(module) -> dict:
    """{layer number (global, 1-based): router expert bias} of this rank's pipeline stage."""
    return {m.layer_number: m.expert_bias.detach().clone() for m in module.modules()
            if getattr(m, "expert_bias", None) is not None}


def _gradient_worker(parallel, micro_batch_size, kind, weights_dir, grads_dir, init, model=MODEL):
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel, load_model_weights, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(model, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if init:
        save_model_weights(policy.module, weights_dir, model)
    else:
        load_model_weights(policy.module, weights_dir, model)
    batch = _global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select(slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp))
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB)
    # Forward-only log-probs (PPO's old policy) come back at the batch's own length, padded or not.
    logprobs = forward_logprobs(policy.chunks, share, spec, micro_batch_size)
    metrics = compute_gradients(policy, share, spec, TrainingConfig(micro_batch_size=micro_batch_size))
    metrics["logprobs"] = logprobs
    metrics["expert_biases"] = _expert_biases(policy.module)  # updated by finalize_model_grads
    save_gradients_as_checkpoint(policy.module, grads_dir, model)
    return metrics, full_state_dict(model, grads_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("invariance"))
    out = {"tmp": tmp}
    for kind in ("grpo", "mopd"):
        out[kind] = run_distributed(_gradient_worker, 1, ParallelConfig(), BATCH, kind, f"{tmp}/w",
                                    f"{tmp}/ref_{kind}", kind == "grpo")[0]
    out["moe"] = run_distributed(_gradient_worker, 1, ParallelConfig(), BATCH, "grpo", f"{tmp}/w_moe",
                                 f"{tmp}/ref_moe", True, MOE)[0]
    return out


SPLITS = [
    ("4-microbatches", 1, ParallelConfig(), 2),
    ("dp2", 2, ParallelConfig(), 2),
    ("tp2", 2, ParallelConfig(tensor_model_parallel_size=2), 4),
    ("tp2-sp", 2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4),
    ("pp2", 2, ParallelConfig(pipeline_model_parallel_size=2), 2),
]
# PP with SP: the pipeline passes [S/TP, b, H] activations between stages, so the whole batch is
# padded to the SP multiple before the schedule (not per micro-batch inside the loss).
PP_SP = ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)


@pytest.mark.parametrize("kind", ["grpo", "mopd"])
@pytest.mark.parametrize("name,world,parallel,mbs", SPLITS, ids=[s[0] for s in SPLITS])
def test_gradient_is_invariant_to_the_split(reference, kind, name, world, parallel, mbs):
    ref_metrics, ref_grads = reference[kind]
    tmp = reference["tmp"]
    results = run_distributed(_gradient_worker, world, parallel, mbs, kind, f"{tmp}/w", f"{tmp}/{name}_{kind}", False)
    _assert_same(results[0], (ref_metrics, ref_grads))


def test_gradient_is_invariant_at_pp2_tp2_sp(reference):
    tmp = reference["tmp"]
    results = run_distributed(_gradient_worker, 4, PP_SP, 2, "grpo", f"{tmp}/w", f"{tmp}/pp2-tp2-sp", False)
    _assert_same(results[0], reference["grpo"])


MOE_SPLITS = [
    ("moe-tp2-sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4),
    ("moe-tp2-sp-ep2-etp1", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                           expert_model_parallel_size=2, expert_tensor_parallel_size=1), 4),
    ("moe-ep2-dp2", ParallelConfig(expert_model_parallel_size=2), 2),
    ("moe-pp2", ParallelConfig(pipeline_model_parallel_size=2), 4),
]


@pytest.mark.parametrize("name,parallel,mbs", MOE_SPLITS, ids=[s[0] for s in MOE_SPLITS])
def test_moe_gradient_and_expert_bias_are_invariant_to_the_split(reference, name, parallel, mbs):
    tmp = reference["tmp"]
    results = run_distributed(_gradient_worker, 2, parallel, mbs, "grpo", f"{tmp}/w_moe", f"{tmp}/{name}", False, MOE)
    _assert_same(results[0], reference["moe"])
    ref_biases = reference["moe"][0]["expert_biases"]
    assert sorted(ref_biases) == [1, 2] and all(b.abs().sum() > 0 for b in ref_biases.values())
    seen = set()
    for rank_metrics, _ in results:
        for layer, bias in rank_metrics["expert_biases"].items():
            torch.testing.assert_close(bias, ref_biases[layer], atol=0, rtol=0)
            seen.add(layer)
    assert seen == set(ref_biases)


def _assert_same(result, reference):
    (metrics, grads), (ref_metrics, ref_grads) = result, reference
    assert abs(metrics["loss"] - ref_metrics["loss"]) < 1e-6
    # The policy-entropy metric (sum over loss tokens, all-reduced like the loss) is split-invariant too.
    assert metrics["entropy_mean"] > 0 and abs(metrics["entropy_mean"] - ref_metrics["entropy_mean"]) < 1e-6
    assert metrics["tokens"] == ref_metrics["tokens"] == 66
    rows = metrics["logprobs"].shape[0]  # rank 0's share of the batch
    torch.testing.assert_close(metrics["logprobs"], ref_metrics["logprobs"][:rows], atol=1e-5, rtol=1e-5)
    nonzero = 0
    for key, ref in ref_grads.items():
        torch.testing.assert_close(grads[key], ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{key}: {m}")
        nonzero += int(ref.abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2, "most reference gradients are zero: the test would prove nothing"
