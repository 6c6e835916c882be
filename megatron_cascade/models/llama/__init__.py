"""Llama 3 (``LlamaForCausalLM``)."""

from megatron_cascade.models.llama.family import FAMILY, LlamaFamily

__all__ = ["FAMILY", "LlamaFamily"]
