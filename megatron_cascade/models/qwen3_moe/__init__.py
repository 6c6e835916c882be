"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B)."""

from megatron_cascade.models.qwen3_moe.family import FAMILY, Qwen3MoeFamily

__all__ = ["FAMILY", "Qwen3MoeFamily"]
