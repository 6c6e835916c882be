"""Tensor names of Hugging Face ``nemotron_h`` (Nemotron-H / Nemotron-3-Nano) <-> Megatron-Core ``MambaModel``.

HF stores every layer as ``backbone.layers.N.{norm, mixer}``, the mixer being a Mamba-2 mixer
(``M``), attention (``*``), a dense relu² MLP (``-``) or an MoE block (``E``), as the model's
``hybrid.layer_pattern`` says. Megatron names are those of the local (CPU) spec; on a model built
with the Transformer Engine spec ``spec_names.resolve_spec_names`` moves the per-layer norms to the
fused ``layer_norm_weight`` of the next linear, and the experts to the grouped-GEMM names.

Whole (TP=1) tensors map one to one, but for attention's q/k/v, packed per query group into
``linear_qkv``: Mamba's ``in_proj`` rows are [z | x | B | C | dt] and ``conv1d``'s are [x | B | C] in
both layouts. Megatron-Core's ``MambaMixer.sharded_state_dict`` stores each of those parts under its
own key (``in_proj.weight.z`` ...), so each is sharded over TP on its own.
"""

from __future__ import annotations

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.errors import ConversionError

_MAMBA_TENSORS = {  # Megatron mixer name -> HF mixer name
    "in_proj.weight": "in_proj.weight", "conv1d.weight": "conv1d.weight", "conv1d.bias": "conv1d.bias",
    "A_log": "A_log", "D": "D", "dt_bias": "dt_bias", "norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}


def layer_symbol(model: ModelConfig, layer: int) -> str:
    """The pattern symbol (M, *, -, E) of decoder layer ``layer``."""
    pattern = model.hybrid.layer_pattern or ""
    if len(pattern) != model.num_layers:
        raise ConversionError(f"model.hybrid.layer_pattern={pattern!r} does not have model.num_layers="
                              f"{model.num_layers} symbols")
    return pattern[layer]


def global_names(model: ModelConfig) -> dict[str, str]:
    """Megatron name -> HF name for the embedding, final norm and output layer."""
    names = {
        "embedding.word_embeddings.weight": "backbone.embeddings.weight",
        "decoder.final_norm.weight": "backbone.norm_f.weight",
    }
    if not model.tie_embeddings:
        names["output_layer.weight"] = "lm_head.weight"
    return names


def layer_names(model: ModelConfig, layer: int) -> dict[str, str]:
    """Megatron name -> HF name (``+``-joined for q/k/v) for decoder layer ``layer`` (local-spec names)."""
    m, h = f"decoder.layers.{layer}.", f"backbone.layers.{layer}."
    mixer, norm = h + "mixer.", h + "norm.weight"
    symbol = layer_symbol(model, layer)
    if symbol == "M":
        names = {m + "norm.weight": norm}
        names.update({f"{m}mixer.{meg}": mixer + hf for meg, hf in _MAMBA_TENSORS.items()})
        return names
    if symbol == "*":
        return {
            m + "input_layernorm.weight": norm,
            m + "self_attention.linear_qkv.weight": "+".join(f"{mixer}{p}_proj.weight" for p in "qkv"),
            m + "self_attention.linear_proj.weight": mixer + "o_proj.weight",
        }
    if symbol == "-":
        return {
            m + "pre_mlp_layernorm.weight": norm,
            m + "mlp.linear_fc1.weight": mixer + "up_proj.weight",
            m + "mlp.linear_fc2.weight": mixer + "down_proj.weight",
        }
    names = {
        m + "pre_mlp_layernorm.weight": norm,
        m + "mlp.router.weight": mixer + "gate.weight",
        m + "mlp.router.expert_bias": mixer + "gate.e_score_correction_bias",
    }
    for e in range(model.moe.num_experts or 0):
        src, dst = f"{mixer}experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
        names[dst + "linear_fc1.weight"] = src + "up_proj.weight"
        names[dst + "linear_fc2.weight"] = src + "down_proj.weight"
    if model.moe.shared_expert_intermediate_size:
        names[m + "mlp.shared_experts.linear_fc1.weight"] = mixer + "shared_experts.up_proj.weight"
        names[m + "mlp.shared_experts.linear_fc2.weight"] = mixer + "shared_experts.down_proj.weight"
    return names


def check_supported(model: ModelConfig) -> None:
    """Raise ``ConversionError`` (naming the key) if ``model`` has features Nemotron-H cannot express."""
    def refuse(what: str) -> None:
        raise ConversionError(f"{what}: not expressible as Hugging Face nemotron_h")

    if model.architecture != "hybrid":
        refuse(f"model.architecture={model.architecture!r} (nemotron_h is a hybrid model)")
    if model.normalization != "RMSNorm" or model.add_bias_linear or model.add_qkv_bias or model.qk_layernorm:
        refuse("model.normalization != RMSNorm, model.add_bias_linear, model.add_qkv_bias or model.qk_layernorm")
    if model.position_embedding_type != "none":
        refuse(f"model.position_embedding_type={model.position_embedding_type!r} (nemotron_h has none)")
    pattern = model.hybrid.layer_pattern or ""
    if ("-" in pattern or "E" in pattern) and model.activation != "squared_relu":
        refuse(f"model.activation={model.activation!r} (nemotron_h MLPs and experts are relu², squared_relu)")
    moe = model.moe
    if moe.num_experts and (moe.router_score_function != "sigmoid" or not moe.router_enable_expert_bias):
        refuse("model.moe.router_score_function must be sigmoid with model.moe.router_enable_expert_bias "
               "(the nemotron_h router)")
    if moe.num_experts and not moe.shared_expert_intermediate_size:
        refuse("model.moe.shared_expert_intermediate_size=null (every nemotron_h MoE layer has a shared expert)")
