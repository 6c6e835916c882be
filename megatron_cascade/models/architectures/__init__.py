"""Megatron-Core model classes (``base.MegatronArchitecture``) and the one list everything asks.

Adding one: a module here with a ``MegatronArchitecture`` subclass as ``ARCHITECTURE``, its name in
``config.model.Architecture``, a line in ``ARCHITECTURES`` below, and its build function in
``model/builder.BUILDERS``.
"""

from __future__ import annotations

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.architectures import gpt, hybrid
from megatron_cascade.models.architectures.base import (
    ATTENTION, MAMBA, MLP, MOE, STATEFUL_BLOCKS, MegatronArchitecture, count_blocks,
)

ARCHITECTURES: dict[str, MegatronArchitecture] = {arch.name: arch for arch in (gpt.ARCHITECTURE, hybrid.ARCHITECTURE)}


def megatron_architecture(model: ModelConfig | str) -> MegatronArchitecture:
    """The architecture ``model.architecture`` (or the name given) names."""
    name = str(getattr(model, "architecture", model))  # a Choice member prints as its plain value
    if name not in ARCHITECTURES:
        raise KeyError(f"no Megatron architecture {name!r}; architectures: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


__all__ = ["ARCHITECTURES", "ATTENTION", "MAMBA", "MLP", "MOE", "STATEFUL_BLOCKS", "MegatronArchitecture",
           "count_blocks", "megatron_architecture"]
