"""The model families the project supports: the one list everything else asks (``convert/``)."""

from __future__ import annotations

from typing import Any

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models import llama, mixtral, nemotron_h, qwen2, qwen3, qwen3_moe
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.models.family import ModelFamily

# In the order ``family_of_model`` asks them (each claims a disjoint set of model configs).
FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY,
                                     nemotron_h.FAMILY)


def family_by_name(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no model family {name!r}; families: {[f.name for f in FAMILIES]}")


def family_by_architecture(architecture: str, source: str) -> ModelFamily:
    """The family of an HF ``architectures[0]`` (or ``model_type``) value; ``source`` names the config file."""
    for family in FAMILIES:
        if architecture in (family.architecture, family.model_type):
            return family
    supported = ", ".join(f.architecture for f in FAMILIES)
    raise ConversionError(f"{source}: architecture {architecture!r} is not supported; supported: {supported}")


def read_architecture(hf: dict[str, Any], source: str) -> ModelFamily:
    """The family named by ``architectures[0]`` (else ``model_type``) of an HF config."""
    archs = hf.get("architectures") or [hf.get("model_type")]
    if not archs or archs[0] is None:
        raise ConversionError(f"{source}: neither 'architectures' nor 'model_type' is set")
    return family_by_architecture(archs[0], source)


def family_of_model(model: ModelConfig) -> ModelFamily:
    """The family a model config exports to when no Hugging Face config was recorded."""
    for family in FAMILIES:
        if family.claims(model):
            return family
    raise ConversionError("no Hugging Face family expresses this model (Llama-style: RMSNorm, SwiGLU, RoPE, with "
                          "q/k/v biases (Qwen2) or q/k norms (Qwen3, Qwen3-MoE) or neither (Llama, Mixtral); or a "
                          "nemotron_h hybrid)")
