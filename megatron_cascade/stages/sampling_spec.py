"""The loss spec of a stage that trains on its own samples."""

from __future__ import annotations

from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.training import LossSpec


def rollout_loss_spec(stage: ResolvedStage, loss: str, vocab_size: int) -> LossSpec:
    """``loss`` on the log-probs of the distribution the rollouts were sampled from (temperature,
    top-k, top-p of ``stage.rollout``); greedy rollouts (temperature 0) train at temperature 1
    without truncation."""
    r = stage.rollout
    if r.temperature <= 0:
        return LossSpec(loss, stage.loss, temperature=1.0, vocab_size=vocab_size)
    return LossSpec(loss, stage.loss, temperature=r.temperature, vocab_size=vocab_size, top_k=r.top_k, top_p=r.top_p)
