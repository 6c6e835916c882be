"""Megatron-Core's ``GPTModel``: every layer is attention then a dense MLP or (``moe.layer_freq``) MoE."""

from __future__ import annotations

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.architectures.base import ATTENTION, MLP, MOE, MegatronArchitecture


class GPTArchitecture(MegatronArchitecture):
    name = "gpt"

    def layer_blocks(self, model: ModelConfig) -> list[str]:
        moe = bool(model.moe.num_experts)
        return [ATTENTION + (MOE if moe and layer % model.moe.layer_freq == 0 else MLP)
                for layer in range(model.num_layers)]


ARCHITECTURE = GPTArchitecture()
