"""Supervised fine-tuning: token-mean negative log-likelihood of the reference responses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_cascade.algorithms import SFT_METRIC_KEYS, sft_loss
from megatron_cascade.config.training import LossConfig


@dataclass(frozen=True)
class SFTLoss:
    cfg: LossConfig
    name: ClassVar[str] = "sft"
    needs = ()
    normalization = "token"
    metric_keys = SFT_METRIC_KEYS

    def __call__(self, logprobs, micro, normalizer):
        return sft_loss(logprobs, micro.loss_mask, normalizer=normalizer)
