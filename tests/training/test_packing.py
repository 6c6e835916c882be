"""Padding-free packing gives the losses, gradients and log-probs of the padded batch (TP=2 + SP, PP=2).

One batch of 8 sequences of very different lengths (the last loss position at 4..22 of 23), GRPO
(advantages, IS correction, KL reference) and MOPD (sequence normalisation: a per-sequence term the
loss must still see per sequence). In one worker the same policy computes the step padded, then
packed into rows of a 40-token budget (several sequences per row, rows of different lengths):
loss, metrics and every gradient equal to 1e-6 (fp32), and the forward log-probs equal at every
position up to each row's last loss token. At TP=2 + SP (rows padded to the TP multiple) and PP=2
(every row as long as the longest: one activation shape); TP=1 (DP=2) runs in
test_context_parallel.py. The planner is tested on its own.
"""

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.training.packing import balanced_bins, first_fit_decreasing, plan_rows

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
BATCH, SEQ, VOCAB = 8, 23, 100
# (first loss position, loss tokens) per row: last loss positions 3+1-1=3 .. 22.
SPANS = [(3, 1), (3, 20), (5, 3), (2, 12), (8, 7), (10, 2), (6, 16), (1, 5)]


def make_batch(seed: int = 3):
    from megatron_cascade.testing.batches import random_rl_batch

    return random_rl_batch(SPANS, SEQ, VOCAB, seed)


def _grads(policy) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in policy.chunks[0].parameters()]


def _packed_vs_padded_worker(parallel: ParallelConfig, kinds: tuple):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(MODEL, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    batch = make_batch()
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    results = []
    for kind in kinds:
        spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB)
        out = {}
        for name, training in (("padded", TrainingConfig(micro_batch_size=4)),
                               ("packed", TrainingConfig(micro_batch_size=4, sequence_packing=True,
                                                         max_tokens_per_row=40))):
            packing = dict(sequence_packing=training.sequence_packing, max_tokens_per_row=training.max_tokens_per_row)
            logprobs = forward_logprobs(policy.chunks, batch, spec, 4, **packing)
            metrics = compute_gradients(policy, batch, spec, training)
            out[name] = (metrics, _grads(policy), logprobs)
        results.append(out)
    return results


def _assert_packed_equals_padded(out):
    (metrics, grads, logprobs), (ref_metrics, ref_grads, ref_logprobs) = out["packed"], out["padded"]
    assert metrics["tokens"] == ref_metrics["tokens"] == sum(n for _, n in SPANS)
    for key, ref in ref_metrics.items():
        assert abs(metrics[key] - ref) <= 1e-6 * max(1.0, abs(ref)), key
    nonzero = 0
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-5)
        nonzero += int(ref.abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2, "most reference gradients are zero: the test would prove nothing"
    for row, (start, length) in enumerate(SPANS):
        end = start + length  # positions after the last loss token are not run when packed
        torch.testing.assert_close(logprobs[row, :end], ref_logprobs[row, :end], atol=1e-5, rtol=1e-5)
        assert (logprobs[row, end:] == 0).all()


# TP=1 (with DP=2: the replicas' rows packed together) is in test_context_parallel.py, in the same
# processes as the CP=2 run.
LAYOUTS = [
    ("tp2-sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("pp2", ParallelConfig(pipeline_model_parallel_size=2)),
]


@pytest.mark.distributed
@pytest.mark.parametrize("name,parallel", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_packed_equals_padded_distributed(name, parallel):
    for rank_results in run_distributed(_packed_vs_padded_worker, 2, parallel, ("grpo", "mopd")):
        for out in rank_results:
            _assert_packed_equals_padded(out)


def test_first_fit_decreasing_respects_the_budget():
    sizes = [9, 2, 7, 3, 5, 5, 1, 8]
    bins = first_fit_decreasing(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in bins of 10: no fewer possible
    assert first_fit_decreasing([12, 3], 10) == [[0], [1]]  # too long: a bin of its own


def test_rows_are_balanced_and_within_budget():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(64, 1025, (64,), generator=gen).tolist()  # a realistic spread of lengths
    capacity = 4096
    rows = plan_rows(sizes, capacity)
    loads = [sum(sizes[i] for i in row) for row in rows]
    assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
    assert max(loads) <= capacity
    assert len(rows) == len(first_fit_decreasing(sizes, capacity))  # as few rows as FFD
    ffd_loads = [sum(sizes[i] for i in b) for b in first_fit_decreasing(sizes, capacity)]
    # FFD leaves a nearly empty last row; balancing evens the rows (micro-batches) out.
    assert max(loads) - min(loads) < max(ffd_loads) - min(ffd_loads)
    assert max(loads) - min(loads) <= max(sizes)
    assert balanced_bins([5, 5, 4, 3, 3], 2) == [[0, 2], [1, 3, 4]]  # loads 9 and 11
