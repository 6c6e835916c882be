"""Mixtral (``MixtralForCausalLM``, e.g. Mixtral-8x7B)."""

from megatron_cascade.models.mixtral.family import FAMILY, MixtralFamily

__all__ = ["FAMILY", "MixtralFamily"]
