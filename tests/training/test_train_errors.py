"""Bad inputs to a training step: clear errors, or the skip-step guard; never a silent NaN update."""

import math

import pytest
import torch

from megatron_cascade.algorithms import NonFiniteInputError
from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.training import TrainBatch

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=50, ffn_hidden_size=64)


def _batch(mask_value=1.0):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 9), generator=gen)
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=torch.full((4, 8), mask_value),
                      advantages=torch.randn(4, generator=gen), inference_logprobs=torch.full((4, 8), -3.0))


def test_batch_shape_mismatch_is_named():
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"TrainBatch.loss_mask has shape \(2, 4\)"):
        TrainBatch(input_ids=ids, target_ids=ids, loss_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="TrainBatch.advantages"):
        TrainBatch(input_ids=ids, target_ids=ids, loss_mask=torch.ones(2, 5), advantages=torch.ones(3))


def _params(policy):
    return [p.detach().clone() for p in policy.module.parameters()]


def _error_worker(case):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy, train_step
    from megatron_cascade.training.step import apply_gradients, compute_gradients

    initialize_model_parallel(ParallelConfig(), seed=0)
    policy = build_policy(MODEL, ParallelConfig(), OptimizerConfig(lr=1e-2), total_steps=5)
    spec = LossSpec("grpo", LossConfig(), vocab_size=50)
    training = TrainingConfig(micro_batch_size=2)
    before = _params(policy)
    if case == "all_masked":
        metrics = train_step(policy, _batch(mask_value=0.0), spec, training)
        return metrics, _unchanged(policy, before)
    if case == "nan_inference_logprobs":
        batch = _batch()
        batch.inference_logprobs[1, 2] = float("nan")
        try:
            train_step(policy, batch, spec, training)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc), _unchanged(policy, before)
        return None
    if case == "nonfinite_gradient":
        compute_gradients(policy, _batch(), spec, training)
        next(policy.module.parameters()).main_grad[0, 0] = float("inf")
        return apply_gradients(policy, training), _unchanged(policy, before)
    raise ValueError(case)


def _unchanged(policy, before):
    return all(torch.equal(a, b) for a, b in zip(_params(policy), before))


def test_all_masked_batch_gives_zero_loss_and_skips_the_step():
    """No valid token: loss 0, no NaN, and no update (Adam momentum would still move the weights)."""
    metrics, unchanged = run_distributed(_error_worker, 1, "all_masked")[0]
    assert metrics["loss"] == 0.0 and metrics["tokens"] == 0.0 and metrics["skipped"] == 1.0
    assert unchanged and not any(math.isnan(v) for v in metrics.values())


def test_nan_sampler_logprob_at_a_valid_token_is_a_clear_error():
    name, message, unchanged = run_distributed(_error_worker, 1, "nan_inference_logprobs")[0]
    assert name == NonFiniteInputError.__name__
    assert "inference_logprobs" in message and "batch=1, token=2" in message
    assert unchanged


def test_nonfinite_gradient_skips_the_step_and_keeps_the_weights():
    metrics, unchanged = run_distributed(_error_worker, 1, "nonfinite_gradient")[0]
    assert metrics["skipped"] == 1.0 and math.isnan(metrics["grad_norm"])
    assert unchanged
