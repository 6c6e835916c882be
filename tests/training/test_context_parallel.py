"""Context parallelism (CP=2) gives the losses, gradients and log-probs of CP=1.

The load-balanced split (each CP rank holds chunks r and 2CP-1-r of every packed sequence), the
per-sequence RoPE positions, the gather of log-probs back into sequence order, the loss on the whole
batch and the gradient reduction over data x context ranks all run for real; only the attention
kernel is the CPU stand-in (``model/cpu_spec.py``: keys/values all-gathered over CP, masked by
global position), as Transformer Engine's is GPU-only. Two processes run the step at CP=2 and
then, re-initialised, at CP=1 x DP=2 with the same weights (each rank half the batch, padded):
GRPO and MOPD losses, metrics and gradients equal to 1e-6 (fp32), forward log-probs to 1e-5.
The split itself is checked position by position on its own.
"""

import pytest
import torch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.training.context_parallel import cp_row_positions, zigzag_positions

from test_packing import BATCH, MODEL, SPANS, VOCAB, make_batch


def _step(parallel: ParallelConfig, weights, batch, trainings: dict):
    """(per-kind results, weights): log-probs, metrics and gradients of each loss kind in ``trainings``
    (kind -> TrainingConfig) at ``parallel``."""
    from megatron.core import parallel_state

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    parallel_state.destroy_model_parallel()
    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(MODEL, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if weights is None:
        weights = {k: v.clone() for k, v in policy.module.state_dict().items() if not k.endswith("_extra_state")}
    else:
        policy.module.load_state_dict(weights, strict=False)
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    out = {}
    for kind, training in trainings.items():
        spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB)
        logprobs = forward_logprobs(policy.chunks, make_batch(), spec, training.micro_batch_size,
                                    sequence_packing=training.sequence_packing,
                                    max_tokens_per_row=training.max_tokens_per_row)
        metrics = compute_gradients(policy, batch, spec, training)
        grads = {name: p.main_grad.detach().clone() for name, p in policy.module.named_parameters()}
        out[kind] = (metrics, grads, logprobs)
    return out, weights


# CP packs whether or not training.sequence_packing asks: GRPO with the default row budget (4 x the
# longest sequence), MOPD with several sequences in each 40-token row.
CP_TRAININGS = {"grpo": TrainingConfig(micro_batch_size=4),
                "mopd": TrainingConfig(micro_batch_size=4, sequence_packing=True, max_tokens_per_row=40)}


def _cp_worker():
    from megatron.core import parallel_state as ps

    cp, weights = _step(ParallelConfig(context_parallel_size=2), None, make_batch(), CP_TRAININGS)
    assert ps.get_context_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    half = make_batch().select(slice(rank * BATCH // 2, (rank + 1) * BATCH // 2))
    ref, _ = _step(ParallelConfig(), weights, half, {kind: TrainingConfig(micro_batch_size=2) for kind in CP_TRAININGS})
    return cp, ref


def _assert_same(result, reference):
    (metrics, grads, logprobs), (ref_metrics, ref_grads, ref_logprobs) = result, reference
    assert metrics["tokens"] == ref_metrics["tokens"] == sum(n for _, n in SPANS)
    for key, ref in ref_metrics.items():
        assert abs(metrics[key] - ref) <= 1e-6 * max(1.0, abs(ref)), key
    nonzero = 0
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        nonzero += int(ref.abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2, "most reference gradients are zero: the test would prove nothing"
    for row, (start, length) in enumerate(SPANS):
        end = start + length
        torch.testing.assert_close(logprobs[row, :end], ref_logprobs[row, :end], atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_context_parallel_equals_cp1():
    for cp, ref in run_distributed(_cp_worker, 2):
        for kind in CP_TRAININGS:
            _assert_same(cp[kind], ref[kind])


def test_zigzag_split_covers_every_position_once():
    segments = [8, 4, 12]  # multiples of 2 x CP = 4
    held = cp_row_positions(segments, 2)
    assert sorted(held.reshape(-1).tolist()) == list(range(24))
    # Rank 0: chunks 0 and 3 of each segment; rank 1: chunks 1 and 2.
    assert zigzag_positions([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions([8], 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(segments, 2, 1).tolist()[4:] == [9, 10, 15, 16, 17, 18, 19, 20]
    assert zigzag_positions(segments, 1, 0).tolist() == list(range(24))
    with pytest.raises(ValueError, match="2 x CP"):
        zigzag_positions([6], 2, 0)
