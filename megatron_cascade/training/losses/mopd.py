"""MOPD / on-policy distillation: sampled-token reverse KL to a teacher, IS-corrected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_cascade.algorithms import MOPD_METRIC_KEYS, mopd_loss
from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.losses.base import importance_inputs


@dataclass(frozen=True)
class MOPDLoss:
    cfg: LossConfig
    name: ClassVar[str] = "mopd"
    needs = ("teacher_logprobs",)
    metric_keys = MOPD_METRIC_KEYS

    @property
    def normalization(self) -> str:
        return "sequence" if self.cfg.mopd_normalization == "sequence" else "token"

    def __call__(self, logprobs, micro, normalizer):
        cfg = self.cfg
        inference, is_mode = importance_inputs(cfg, micro)
        return mopd_loss(
            logprobs, micro.teacher_logprobs, micro.loss_mask, inference_logprobs=inference,
            is_bounds=(cfg.is_low, cfg.is_high), is_mode=is_mode, normalization=cfg.mopd_normalization,
            normalizer=normalizer,
        )
