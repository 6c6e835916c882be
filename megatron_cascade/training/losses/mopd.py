"""MOPD / on-policy distillation: sampled-token reverse KL to a teacher, IS-corrected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_cascade.algorithms import MOPD_METRIC_KEYS, mopd_loss
from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.losses.base import OFF_SUPPORT_METRIC, importance_inputs, on_support


@dataclass(frozen=True)
class MOPDLoss:
    cfg: LossConfig
    name: ClassVar[str] = "mopd"
    needs = ("teacher_logprobs",)
    metric_keys = (*MOPD_METRIC_KEYS, OFF_SUPPORT_METRIC)

    @property
    def normalization(self) -> str:
        return "sequence" if self.cfg.mopd_normalization == "sequence" else "token"

    def __call__(self, logprobs, micro, normalizer):
        cfg = self.cfg
        inference, is_mode = importance_inputs(cfg, micro)
        mask, off_support = on_support(logprobs, micro)
        loss, metrics = mopd_loss(
            logprobs, micro.teacher_logprobs, mask, inference_logprobs=inference,
            is_bounds=(cfg.is_low, cfg.is_high), is_mode=is_mode, normalization=cfg.mopd_normalization,
            normalizer=normalizer,
        )
        return loss, {**metrics, OFF_SUPPORT_METRIC: off_support}
