"""Qwen3 (``Qwen3ForCausalLM``)."""

from megatron_cascade.models.qwen3.family import FAMILY, Qwen3Family

__all__ = ["FAMILY", "Qwen3Family"]
