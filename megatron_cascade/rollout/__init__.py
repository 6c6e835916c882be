"""Rollout generation from the Megatron-Core model being trained (paged KV cache, continuous batching,
TP / SP / PP / EP)."""

from megatron_cascade.rollout.batch import FinishReason, GenerationStats, RolloutBatch, RolloutSample
from megatron_cascade.rollout.generate import generate
from megatron_cascade.rollout.rollout_tensors import PackedRollouts, pack_rollouts
from megatron_cascade.rollout.params import KVCacheConfig, SamplingParams

__all__ = ["SamplingParams", "KVCacheConfig", "generate", "RolloutBatch", "RolloutSample", "FinishReason",
           "GenerationStats", "PackedRollouts", "pack_rollouts"]
