"""Supported Hugging Face model families and their tensor-name maps to Megatron-Core module names.

Megatron names are the module names of a TP=PP=EP=1 local-spec ``GPTModel`` (Llama/Qwen families) or
``MambaModel`` (``nemotron_h``, in ``convert/nemotron_h_names.py``); ``spec_names`` moves them onto the
Transformer Engine spec's names when that spec built the model. The checkpoint keys they map onto
come from the model's ``sharded_state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.convert.errors import ConversionError
from megatron_cascade.convert.nemotron_h_names import (
    check_nemotron_h_supported, nemotron_h_global_names, nemotron_h_layer_names,
)


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its class name, ``model_type`` and structural features."""

    name: str
    architecture: str
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    hybrid: bool = False  # a Megatron-Core MambaModel (model.architecture: hybrid)


LLAMA = Family("llama", "LlamaForCausalLM", "llama")
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe=True)
NEMOTRON_H = Family("nemotron_h", "NemotronHForCausalLM", "nemotron_h", hybrid=True)
FAMILIES = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, NEMOTRON_H)


def family_by_architecture(architecture: str, source: str) -> Family:
    """The family of an HF ``architectures[0]`` (or ``model_type``) value; ``source`` names the config file."""
    for fam in FAMILIES:
        if architecture in (fam.architecture, fam.model_type):
            return fam
    supported = ", ".join(f.architecture for f in FAMILIES)
    raise ConversionError(f"{source}: architecture {architecture!r} is not supported; supported: {supported}")


def family_of_model(model: ModelConfig) -> Family:
    """The family a model config exports to when no Hugging Face config was recorded."""
    if model.architecture == "hybrid":
        return NEMOTRON_H
    if model.moe.num_experts:
        return QWEN3_MOE
    if model.qk_layernorm:
        return QWEN3
    if model.add_qkv_bias:
        return QWEN2
    return LLAMA


def global_names(family: Family, model: ModelConfig) -> dict[str, str]:
    """Megatron name -> HF name for the tensors outside the decoder layers of ``family``."""
    if family.hybrid:
        return nemotron_h_global_names(model)
    return hf_global_names(model)


def layer_names(family: Family, model: ModelConfig, layer: int) -> dict[str, str]:
    """Megatron name -> HF name (or ``+``-joined HF names) for decoder layer ``layer`` of ``family``."""
    if family.hybrid:
        return nemotron_h_layer_names(model, layer)
    return hf_layer_names(family, model, layer)


def hf_global_names(model: ModelConfig) -> dict[str, str]:
    """Megatron name -> HF name for the tensors outside the decoder layers (Llama/Qwen)."""
    names = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if not model.tie_embeddings:
        names["output_layer.weight"] = "lm_head.weight"
    return names


def hf_layer_names(family: Family, model: ModelConfig, layer: int) -> dict[str, str]:
    """Megatron name -> HF name (or ``+``-joined HF names) for one decoder layer.

    Joined names are concatenated along dim 0 in the order given (SwiGLU [gate; up]); the q/k/v
    triple of ``linear_qkv`` is interleaved per query group (see ``tensor_maps.pack_qkv``).
    """
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn = h + "self_attn."
    names = {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "self_attention.linear_qkv.weight": "+".join(attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")),
        m + "self_attention.linear_proj.weight": attn + "o_proj.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
    }
    if family.qkv_bias:
        names[m + "self_attention.linear_qkv.bias"] = "+".join(attn + p + ".bias" for p in ("q_proj", "k_proj", "v_proj"))
    if family.qk_norm:
        names[m + "self_attention.q_layernorm.weight"] = attn + "q_norm.weight"
        names[m + "self_attention.k_layernorm.weight"] = attn + "k_norm.weight"
    if family.moe:
        names[m + "mlp.router.weight"] = h + "mlp.gate.weight"
        for e in range(model.moe.num_experts or 0):
            src, dst = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            names[dst + "linear_fc1.weight"] = f"{src}gate_proj.weight+{src}up_proj.weight"
            names[dst + "linear_fc2.weight"] = src + "down_proj.weight"
    else:
        names[m + "mlp.linear_fc1.weight"] = f"{h}mlp.gate_proj.weight+{h}mlp.up_proj.weight"
        names[m + "mlp.linear_fc2.weight"] = h + "mlp.down_proj.weight"
    return names


def all_hf_names(family: Family, model: ModelConfig) -> set[str]:
    """Every HF tensor name a checkpoint of this family and config must contain."""
    out = set(global_names(family, model).values())
    for layer in range(model.num_layers):
        for joined in layer_names(family, model, layer).values():
            out.update(joined.split("+"))
    return out


def check_family_supported(family: Family, model: ModelConfig) -> None:
    """Raise if the model config needs features the family map does not cover."""
    if family.hybrid or model.architecture == "hybrid":
        if not family.hybrid:
            raise ConversionError(f"a hybrid (Mamba) model does not map onto {family.architecture}; "
                                  f"export it as {NEMOTRON_H.architecture}")
        check_nemotron_h_supported(model)
        return
    if family.moe != bool(model.moe.num_experts):
        raise ConversionError(f"family {family.name} {'needs' if family.moe else 'cannot have'} MoE layers")
    if model.moe.shared_expert_intermediate_size:
        raise ConversionError("shared experts map onto nemotron_h only (a hybrid model), not onto Llama/Qwen")
    if model.moe.num_experts and model.moe.layer_freq != 1:
        raise ConversionError("MoE with dense layers in between (moe.layer_freq != 1) is not supported")
    if model.add_bias_linear or model.activation != "swiglu" or model.normalization != "RMSNorm":
        raise ConversionError(
            "only RMSNorm + SwiGLU models without linear biases map onto Llama/Qwen "
            f"(got normalization={model.normalization}, activation={model.activation}, "
            f"add_bias_linear={model.add_bias_linear})"
        )
    if model.position_embedding_type != "rope" or model.rotary_percent != 1.0:
        raise ConversionError("only full RoPE (position_embedding_type=rope, rotary_percent=1.0) maps onto Llama/Qwen")
