"""Megatron-Core's ``MambaModel``: one block per layer, placed by ``model.hybrid.layer_pattern``
(``M`` Mamba-2, ``*`` attention, ``-`` dense MLP, ``E`` MoE); generation keeps a conv + SSM state
per request in its Mamba layers next to the attention layers' KV."""

from __future__ import annotations

from typing import Any

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.config.rules import require
from megatron_cascade.models.architectures.base import MAMBA, MegatronArchitecture


class HybridArchitecture(MegatronArchitecture):
    name = "hybrid"
    gpu_packages = ("mamba-ssm", "causal-conv1d")
    # Megatron-Core's attention allows TP a multiple of the key/value heads here (they are replicated).
    kv_heads_replicate = True

    def layer_blocks(self, model: ModelConfig) -> list[str]:
        return list(model.hybrid.layer_pattern)

    def validate_layout(self, model: ModelConfig, tensor_parallel: int, context_parallel: int,
                        prefix: str = "parallel.") -> None:
        """Every TP rank needs whole Mamba groups and heads (so TP <= ``hybrid.mamba_num_groups``)."""
        if MAMBA not in (model.hybrid.layer_pattern or ""):
            return
        groups = model.hybrid.mamba_num_groups
        heads = model.hybrid.num_heads(model.hidden_size)
        require(groups % tensor_parallel == 0, f"{prefix}tensor_model_parallel_size={tensor_parallel} does not "
                f"divide model.hybrid.mamba_num_groups={groups} (each TP rank needs whole Mamba groups: TP <= groups)")
        require(heads % tensor_parallel == 0, f"{prefix}tensor_model_parallel_size={tensor_parallel} does not "
                f"divide the Mamba heads ({heads}, model.hybrid.mamba_num_heads)")
        # Megatron-Core's Mamba context parallelism splits heads over CP ranks with TE-only attention around it.
        require(context_parallel == 1, f"{prefix}context_parallel_size={context_parallel} is not supported with "
                "model.architecture=hybrid here (Mamba layers under CP are not tested)")

    def transformer_config_fields(self, model: ModelConfig) -> dict[str, Any]:
        hybrid = model.hybrid
        return dict(is_hybrid_model=True, mamba_state_dim=hybrid.mamba_state_dim,
                    mamba_head_dim=hybrid.mamba_head_dim, mamba_num_groups=hybrid.mamba_num_groups,
                    mamba_num_heads=hybrid.num_heads(model.hidden_size))

    def describe(self, model: dict[str, Any]) -> str:
        h = model.get("hybrid") or {}
        return (f" pattern={h.get('layer_pattern')} mamba_heads={h.get('mamba_num_heads')}x{h.get('mamba_head_dim')} "
                f"state={h.get('mamba_state_dim')} groups={h.get('mamba_num_groups')}")


ARCHITECTURE = HybridArchitecture()
