"""A hybrid Mamba-2 / attention / MoE model trains the same whatever the parallel layout.

One global GRPO batch (8 sequences of 23 positions, 1 to 20 loss tokens each, IS correction and a
KL reference) through a tiny ``M*ME`` model (Mamba chunk 8: the scan carries state across chunks;
relu² experts, sigmoid router with expert bias, routed scaling 2.5, a shared expert). Reference:
one process, one micro-batch. Then TP=2 + sequence parallel (the Mamba heads and groups split over
the two ranks, the norms' SP gradients all-reduced), EP=2 x DP=2 (experts split, alltoall
dispatcher) and padding-free packing (several sequences per row: the Mamba conv and scan restart at
each sequence through ``seq_idx``, attention is block-diagonal). Loss, forward log-probs, every gradient
(re-assembled at TP=1 through a distributed checkpoint) and, unpacked, the expert biases after the
step equal the reference.
"""

from __future__ import annotations

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict, save_gradients_as_checkpoint

pytestmark = pytest.mark.distributed

HYBRID = ModelConfig(
    architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, ffn_hidden_size=64, position_embedding_type="none", activation="squared_relu",
    norm_epsilon=1e-5,
    hybrid=HybridConfig(layer_pattern="M*ME", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16,
                        mamba_chunk_size=8),
    moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, shared_expert_intermediate_size=48,
                  router_score_function="sigmoid", router_enable_expert_bias=True, router_bias_update_rate=0.01,
                  router_topk_scaling_factor=2.5, token_dispatcher_type="alltoall"))
BATCH, SEQ, VOCAB = 8, 23, 100


def _global_batch():
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    for row, length in enumerate([1, 20, 3, 12, 7, 2, 16, 5]):
        mask[row, 3:3 + length] = 1
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask,
                      advantages=torch.randn(BATCH, generator=gen),
                      inference_logprobs=-torch.rand(BATCH, SEQ, generator=gen) * 6,
                      ref_logprobs=-torch.rand(BATCH, SEQ, generator=gen) * 6)


def _gradient_worker(parallel, micro_batch_size, weights_dir, grads_dir, init, packing=False):
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel, load_model_weights, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(HYBRID, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if init:
        save_model_weights(policy.module, weights_dir, HYBRID)
    else:
        load_model_weights(policy.module, weights_dir, HYBRID)
    batch = _global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select(slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp))
    spec = LossSpec("grpo", LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0),
                    temperature=0.7, vocab_size=VOCAB)
    logprobs = forward_logprobs(policy.chunks, share, spec, micro_batch_size, sequence_packing=packing)
    training = TrainingConfig(micro_batch_size=micro_batch_size, sequence_packing=packing)
    metrics = compute_gradients(policy, share, spec, training)
    metrics["logprobs"] = logprobs
    metrics["expert_biases"] = {m.layer_number: m.expert_bias.detach().clone() for m in policy.module.modules()
                                if getattr(m, "expert_bias", None) is not None}
    save_gradients_as_checkpoint(policy.module, grads_dir, HYBRID)
    return metrics, full_state_dict(HYBRID, grads_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hybrid_invariance"))
    return tmp, run_distributed(_gradient_worker, 1, ParallelConfig(), BATCH, f"{tmp}/w", f"{tmp}/ref", True)[0]


SPLITS = [
    ("tp2-sp", 2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4, False),
    ("ep2-dp2", 2, ParallelConfig(expert_model_parallel_size=2), 2, False),
    ("packed", 1, ParallelConfig(), 4, True),
]


@pytest.mark.parametrize("name,world,parallel,mbs,packing", SPLITS, ids=[s[0] for s in SPLITS])
def test_hybrid_gradient_is_invariant_to_the_layout(reference, name, world, parallel, mbs, packing):
    tmp, (ref_metrics, ref_grads) = reference
    results = run_distributed(_gradient_worker, world, parallel, mbs, f"{tmp}/w", f"{tmp}/{name}", False, packing)
    metrics, grads = results[0]
    assert abs(metrics["loss"] - ref_metrics["loss"]) < 1e-6
    assert metrics["tokens"] == ref_metrics["tokens"] == 66
    rows = metrics["logprobs"].shape[0]
    on_loss = _global_batch().loss_mask[:rows].bool()  # packed rows return 0 after a sequence's last loss token
    torch.testing.assert_close(metrics["logprobs"][on_loss], ref_metrics["logprobs"][:rows][on_loss],
                               atol=1e-5, rtol=1e-5)
    mamba_keys = [k for k in ref_grads if ".mixer." in k]
    assert any(k.endswith("A_log") for k in mamba_keys) and any("conv1d" in k for k in mamba_keys)
    # The routers' expert-bias buffers (updated from routed-token counts) are compared below, not as
    # gradients. Packing runs no position after a sequence's last loss token, so its routers count
    # fewer tokens: the bias update legitimately differs there (training/packing.py).
    buffers = ("expert_bias", "local_tokens_per_expert")
    nonzero = 0
    for key, ref in ref_grads.items():
        if key.endswith(buffers):
            continue
        torch.testing.assert_close(grads[key], ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{key}: {m}")
        nonzero += int(ref.abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2, "most reference gradients are zero: the test would prove nothing"
    ref_biases = ref_metrics["expert_biases"]
    assert list(ref_biases) == [4] and ref_biases[4].abs().sum() > 0
    if packing:
        return
    for rank_metrics, _ in results:
        for layer, bias in rank_metrics["expert_biases"].items():
            torch.testing.assert_close(bias, ref_biases[layer], atol=0, rtol=0)
