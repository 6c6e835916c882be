"""GRPO: clipped policy gradient on group-relative advantages, IS-corrected, optional k3 KL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_cascade.algorithms import GRPO_METRIC_KEYS, grpo_loss
from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.losses.base import OFF_SUPPORT_METRIC, importance_inputs, on_support


@dataclass(frozen=True)
class GRPOLoss:
    cfg: LossConfig
    name: ClassVar[str] = "grpo"
    needs = ("advantages",)
    normalization = "token"
    metric_keys = (*GRPO_METRIC_KEYS, OFF_SUPPORT_METRIC)

    def __call__(self, logprobs, micro, normalizer):
        cfg = self.cfg
        inference, is_mode = importance_inputs(cfg, micro)
        mask, off_support = on_support(logprobs, micro)
        loss, metrics = grpo_loss(
            logprobs, micro.advantages, mask,
            old_logprobs=micro.old_logprobs, inference_logprobs=inference, ref_logprobs=micro.ref_logprobs,
            clip_eps=(cfg.clip_eps_low, cfg.clip_eps_high), is_bounds=(cfg.is_low, cfg.is_high),
            is_mode=is_mode, kl_coef=cfg.kl_coef, normalizer=normalizer,
        )
        return loss, {**metrics, OFF_SUPPORT_METRIC: off_support}
