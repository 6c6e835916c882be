"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``)."""

from megatron_cascade.models.qwen2.family import FAMILY, Qwen2Family

__all__ = ["FAMILY", "Qwen2Family"]
