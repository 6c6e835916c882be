"""Rollout generation from the Megatron-Core model being trained (KV cache, TP, PP)."""

from megatron_cascade.rollout.batch import FinishReason, RolloutBatch, RolloutSample
from megatron_cascade.rollout.generate import generate
from megatron_cascade.rollout.packing import PackedRollouts, pack_rollouts
from megatron_cascade.rollout.params import SamplingParams

__all__ = ["SamplingParams", "generate", "RolloutBatch", "RolloutSample", "FinishReason",
           "PackedRollouts", "pack_rollouts"]
