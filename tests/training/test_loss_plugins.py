"""The loss plug-ins (``training/losses``): declared fields, normalisation, and tokens outside the
trainer's top-k/top-p support.

A token the sampler drew but the trainer's truncated distribution excludes gets the log-prob floor
(-1e4). With ``ppo_epochs > 1`` the old policy may exclude a token the current one includes: the PPO
ratio is exp(9995) = inf, and inf x an IS weight of 0 made the GRPO loss and its gradient NaN
(seen before the fix). Such tokens now leave the loss and are counted (``off_support_tokens``)."""

from __future__ import annotations

import pytest
import torch

from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.batch import TrainBatch
from megatron_cascade.training.loss_plugin import LossSpec, compute_loss
from megatron_cascade.training.losses import LOSSES

FLOOR = -1e4


def _batch(**fields) -> TrainBatch:
    ids = torch.zeros(1, 2, dtype=torch.long)
    return TrainBatch(input_ids=ids, target_ids=ids, loss_mask=torch.ones(1, 2), **fields)


@pytest.mark.parametrize("kind", ["grpo", "mopd"])
def test_tokens_off_the_truncated_support_leave_the_loss(kind):
    logp = torch.tensor([[-5.0, -1.0]], requires_grad=True)
    fields = {"old_logprobs": torch.tensor([[FLOOR, -1.0]]), "inference_logprobs": torch.tensor([[-5.0, -1.0]])}
    if kind == "grpo":
        fields["advantages"] = torch.tensor([-1.0])
    else:
        fields["teacher_logprobs"] = torch.tensor([[-2.0, -0.5]])
    spec = LossSpec(kind, LossConfig(), top_k=5)
    loss, metrics = compute_loss(spec, logp, _batch(**fields), torch.tensor(2.0, dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0 and metrics["off_support_tokens"] == 1
    assert metrics["tokens"] == 1  # the other token is trained on


def test_current_policy_at_the_floor_is_left_out_too():
    logp = torch.tensor([[FLOOR, -1.0]], requires_grad=True)
    batch = _batch(advantages=torch.tensor([1.0]), inference_logprobs=torch.tensor([[-3.0, -1.0]]))
    loss, metrics = compute_loss(LossSpec("grpo", LossConfig(), top_p=0.9), logp, batch,
                                 torch.tensor(2.0, dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(loss) and metrics["off_support_tokens"] == 1 and metrics["is_masked_tokens"] == 0


def test_a_missing_declared_field_is_named():
    with pytest.raises(ValueError, match="the grpo loss needs TrainBatch.advantages"):
        compute_loss(LossSpec("grpo", LossConfig()), torch.zeros(1, 2), _batch(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="TrainBatch.teacher_logprobs"):
        compute_loss(LossSpec("mopd", LossConfig()), torch.zeros(1, 2), _batch(), torch.tensor(1.0))


def test_registry_and_normalisation():
    assert set(LOSSES) == {"sft", "grpo", "mopd"}
    assert LossSpec("mopd", LossConfig(mopd_normalization="sequence")).counts_sequences
    assert not LossSpec("mopd", LossConfig(mopd_normalization="token")).counts_sequences
    assert not LossSpec("grpo", LossConfig()).counts_sequences
    with pytest.raises(ValueError, match="is not one of"):
        LossSpec("dpo", LossConfig())
