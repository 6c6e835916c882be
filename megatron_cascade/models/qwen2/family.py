"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on the q/k/v projections."""

from __future__ import annotations

from megatron_cascade.models.llama.family import LlamaFamily


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    qkv_bias = True


FAMILY = Qwen2Family()
