"""Hugging Face ``config.json`` <-> ``ModelConfig``, refusing features the model builder lacks
(``nemotron_h``: ``nemotron_h_config``).

Accepts both the classic keys (``rope_theta``, ``rope_scaling``, ``torch_dtype``, ``num_experts``)
and the transformers 5 ones (``rope_parameters``, ``dtype``, ``num_local_experts``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.convert.errors import ConversionError
from megatron_cascade.convert.families import QWEN3_MOE, Family, family_by_architecture
from megatron_cascade.convert.nemotron_h_config import nemotron_h_hf_config, nemotron_h_model_config

HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_TO_HF = {v: k for k, v in HF_DTYPES.items()}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _refuse_unsupported(hf: dict[str, Any], family: Family, source: str) -> None:
    def refuse(what: str) -> None:
        raise ConversionError(f"{source}: {what} is not supported by the Megatron model builder; "
                              "convert a model without it or extend megatron_cascade.model first")

    theta, scaling = _rope(hf)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        refuse(f"RoPE scaling (rope_scaling type {kind!r})")
    if theta != int(theta):
        refuse(f"a non-integer rope_theta={theta}")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        refuse("sliding-window attention (use_sliding_window / layer_types)")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={hf.get('hidden_act')!r} (only silu/SwiGLU)")
    if hf.get("attention_bias") and not family.qkv_bias:
        refuse("attention_bias=true")
    if hf.get("mlp_bias"):
        refuse("mlp_bias=true")
    if hf.get("pretraining_tp", 1) != 1:
        refuse(f"pretraining_tp={hf.get('pretraining_tp')}")
    if family.moe:
        if hf.get("mlp_only_layers"):
            refuse(f"mlp_only_layers={hf['mlp_only_layers']} (dense layers between MoE layers)")
        if hf.get("decoder_sparse_step", 1) != 1:
            refuse(f"decoder_sparse_step={hf['decoder_sparse_step']} (MoE only every k-th layer)")
        if hf.get("shared_expert_intermediate_size"):
            refuse("shared experts")


def read_architecture(hf: dict[str, Any], source: str) -> Family:
    """The family named by ``architectures[0]`` (else ``model_type``) of an HF config."""
    archs = hf.get("architectures") or [hf.get("model_type")]
    if not archs or archs[0] is None:
        raise ConversionError(f"{source}: neither 'architectures' nor 'model_type' is set")
    return family_by_architecture(archs[0], source)


def model_config_from_hf(
    hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int = 128, precision: str | None = None
) -> tuple[Family, ModelConfig]:
    """Map an HF config dict (read from ``source``) to its family and our ``ModelConfig``.

    ``precision`` (fp32|bf16|fp16) overrides the config's dtype; the default keeps it.
    """
    family = read_architecture(hf, source)
    if family.hybrid:
        return family, nemotron_h_model_config(hf, source, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                               precision=precision or hf_precision(hf, source))
    _refuse_unsupported(hf, family, source)
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        cfg = ModelConfig(
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            kv_channels=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rotary_base=_rope(hf)[0],
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            add_qkv_bias=family.qkv_bias,
            qk_layernorm=family.qk_norm,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            precision=precision or hf_precision(hf, source),
        )
        if family.moe:
            cfg.moe = MoEConfig(
                num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                router_topk=int(hf["num_experts_per_tok"]),
                ffn_hidden_size=int(hf["moe_intermediate_size"]),
                router_pre_softmax=not hf.get("norm_topk_prob", False),
                router_load_balancing_type="none",
            )
    except KeyError as exc:
        raise ConversionError(f"{source}: required key {exc} is missing") from exc
    return family, cfg


def hf_precision(hf: dict[str, Any], source: str) -> str:
    """The precision (fp32|bf16|fp16) of an HF config's ``torch_dtype`` / ``dtype`` (default float32)."""
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in HF_DTYPES:
        raise ConversionError(f"{source}: dtype {dtype!r} is not one of {list(HF_DTYPES)}; pass --precision")
    return HF_DTYPES[dtype]


def hf_config_from_model(
    model: ModelConfig, family: Family, template: dict[str, Any] | None, dtype: str
) -> dict[str, Any]:
    """The HF config dict for ``model``: ``template`` (the config imported from, if any) updated.

    ``dtype`` is the precision of the written tensors (fp32|bf16|fp16).
    """
    if family.hybrid:
        hf = nemotron_h_hf_config(model, template)
        _set_dtype(hf, template, dtype)
        return hf
    hf = copy.deepcopy(template) if template else {}
    hf.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        num_hidden_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size or 4 * model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=model.tie_embeddings,
        hidden_act="silu",
    )
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    if template is None or "head_dim" in template or head_dim * model.num_attention_heads != model.hidden_size:
        hf["head_dim"] = head_dim
    _set_rope_theta(hf, model.rotary_base)
    _set_dtype(hf, template, dtype)
    if family is QWEN3_MOE:
        experts_key = "num_local_experts" if "num_local_experts" in hf and "num_experts" not in hf else "num_experts"
        hf[experts_key] = model.moe.num_experts
        hf.update(num_experts_per_tok=model.moe.router_topk, moe_intermediate_size=model.moe.ffn_hidden_size,
                  norm_topk_prob=not model.moe.router_pre_softmax, decoder_sparse_step=1, mlp_only_layers=[])
    return hf


def _set_dtype(hf: dict[str, Any], template: dict[str, Any] | None, dtype: str) -> None:
    """The dtype key: ``torch_dtype`` unless the template used transformers 5's ``dtype``."""
    hf.pop("dtype", None)
    hf["torch_dtype" if template is None or "torch_dtype" in template else "dtype"] = PRECISION_TO_HF[dtype]


def _set_rope_theta(hf: dict[str, Any], theta: float) -> None:
    value = int(theta) if float(theta).is_integer() else theta
    if "rope_parameters" in hf:
        hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": value}
    else:
        hf["rope_theta"] = value
