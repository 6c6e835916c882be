"""Qwen3 (``Qwen3ForCausalLM``): Llama with an RMSNorm of q and k per head (``q_norm``, ``k_norm``)."""

from __future__ import annotations

from megatron_cascade.models.llama.family import LlamaFamily


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    qk_norm = True


FAMILY = Qwen3Family()
