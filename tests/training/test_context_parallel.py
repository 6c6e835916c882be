"""Context parallelism (CP=2), and packing balanced over data-parallel ranks (DP=2), give the losses,
gradients and log-probs of the padded batch at CP=1.

The load-balanced split (each CP rank holds chunks r and 2CP-1-r of every packed sequence), the
per-sequence RoPE positions, the gather of log-probs back into sequence order, the loss on the whole
batch and the gradient reduction over data x context ranks all run for real; only the attention
kernel is the CPU stand-in (``model/cpu_spec.py``: keys/values all-gathered over CP, masked by
global position), as Transformer Engine's is GPU-only. Two processes run the step at CP=2 and
then, re-initialised, at CP=1 x DP=2 with the same weights (each rank its own rows, rank 0 the
longest), padded (the reference) and packed: with DP > 1 the replicas' sequences are gathered,
packed together and the rows dealt out by tokens (TP=1 packing is tested here too). GRPO and MOPD
losses, metrics and gradients equal to 1e-6 (fp32), forward log-probs to 1e-5, and the packed
replicas process about as many tokens each where the padded ones do not. The split itself is
checked position by position on its own.
"""

import pytest
import torch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.ops.zigzag import cp_row_positions, zigzag_positions

from test_packing import MODEL, SPANS, VOCAB, make_batch


def _step(parallel: ParallelConfig, weights, batch, trainings: dict):
    """(results, weights): log-probs, metrics, gradients and tokens run for each entry of
    ``trainings`` ({name: (loss kind, TrainingConfig)}) at ``parallel``."""
    from megatron.core import parallel_state

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import _training_micro_batches, compute_gradients, forward_logprobs

    parallel_state.destroy_model_parallel()
    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(MODEL, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if weights is None:
        weights = {k: v.clone() for k, v in policy.module.state_dict().items() if not k.endswith("_extra_state")}
    else:
        policy.module.load_state_dict(weights, strict=False)
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    out = {}
    for name, (kind, training) in trainings.items():
        spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB)
        logprobs = forward_logprobs(policy.chunks, make_batch(), spec, training.micro_batch_size,
                                    sequence_packing=training.sequence_packing,
                                    max_tokens_per_row=training.max_tokens_per_row)
        metrics = compute_gradients(policy, batch, spec, training)
        grads = {name: p.main_grad.detach().clone() for name, p in policy.module.named_parameters()}
        tokens = sum(m.input_ids.numel() for m in _training_micro_batches(policy, batch, training))
        out[name] = (metrics, grads, logprobs, tokens)
    return out, weights


# CP packs whether or not training.sequence_packing asks: GRPO with the default row budget (4 x the
# longest sequence), MOPD with several sequences in each 40-token row.
PACKED_40 = TrainingConfig(micro_batch_size=4, sequence_packing=True, max_tokens_per_row=40)
CP_TRAININGS = {"grpo": ("grpo", TrainingConfig(micro_batch_size=4)), "mopd": ("mopd", PACKED_40)}
DP_TRAININGS = {"grpo": ("grpo", TrainingConfig(micro_batch_size=2)),
                "mopd": ("mopd", TrainingConfig(micro_batch_size=2)),
                "grpo-packed": ("grpo", PACKED_40), "mopd-packed": ("mopd", PACKED_40)}


def _cp_worker():
    from megatron.core import parallel_state as ps

    cp, weights = _step(ParallelConfig(context_parallel_size=2), None, make_batch(), CP_TRAININGS)
    assert ps.get_context_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    rows = [1, 3, 6, 4] if torch.distributed.get_rank() == 0 else [0, 2, 5, 7]  # rank 0: the longest
    dp, _ = _step(ParallelConfig(), weights, make_batch().select(torch.tensor(rows)), DP_TRAININGS)
    return cp, dp


def _assert_same(result, reference):
    (metrics, grads, logprobs, _), (ref_metrics, ref_grads, ref_logprobs, _) = result, reference
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
def test_context_parallel_and_dp_balanced_packing_equal_the_padded_batch():
    results = run_distributed(_cp_worker, 2)
    for cp, dp in results:
        for kind in ("grpo", "mopd"):
            _assert_same(cp[kind], dp[kind])
            _assert_same(dp[f"{kind}-packed"], dp[kind])
    padded = [dp["mopd"][3] for _, dp in results]
    packed = [dp["mopd-packed"][3] for _, dp in results]
    assert abs(packed[0] - packed[1]) <= 40 < abs(padded[0] - padded[1]), (packed, padded)


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
