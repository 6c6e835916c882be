"""Local-spec module names -> the names of whichever layer spec built the model.

The model families (``models/<family>/``) name tensors as the local (CPU) spec's modules
have them. A model built with the Transformer Engine spec (on GPU) holds some of them elsewhere: a
layer's pre-norm fused into the next linear (``TELayerNormColumnParallelLinear.layer_norm_weight``),
and the experts of a grouped-GEMM MoE as ``experts.linear_fc1.weight<e>``. The same HF tensor then
maps to that name, so conversion works with either spec.
"""

from __future__ import annotations

import re

# (local-spec name pattern, the TE spec's name for it)
_ALTERNATIVES = (
    # Mamba layer pre-norm -> fused into the mixer's in_proj
    (re.compile(r"^(?P<l>(?:.*\.)?layers\.\d+\.)norm\.(?P<p>weight|bias)$"), r"\g<l>mixer.in_proj.layer_norm_\g<p>"),
    (re.compile(r"^(?P<l>(?:.*\.)?layers\.\d+\.)input_layernorm\.(?P<p>weight|bias)$"),
     r"\g<l>self_attention.linear_qkv.layer_norm_\g<p>"),
    (re.compile(r"^(?P<l>(?:.*\.)?layers\.\d+\.)pre_mlp_layernorm\.(?P<p>weight|bias)$"),
     r"\g<l>mlp.linear_fc1.layer_norm_\g<p>"),
    (re.compile(r"^(?P<x>.*\.experts\.)local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)$"),
     r"\g<x>\g<fc>.\g<p>\g<e>"),
)


def spec_name(name: str, available: set[str] | dict) -> str:
    """``name`` if the model has it, else its Transformer Engine spec counterpart when the model has that,
    else ``name`` unchanged (the caller reports it missing)."""
    if name in available:
        return name
    for pattern, replacement in _ALTERNATIVES:
        alternative, count = pattern.subn(replacement, name)
        if count and alternative in available:
            return alternative
    return name


def resolve_spec_names(names: dict[str, str], available: set[str] | dict) -> dict[str, str]:
    """``names`` ({Megatron local-spec name: HF name}) with each Megatron name as the built model has it."""
    return {spec_name(meg, available): hf for meg, hf in names.items()}
