"""Import a NeMo 2 checkpoint directory (``context/`` + ``weights/``) as a megatron-cascade checkpoint.

Assumed layout (NeMo 2 ``nemo.lightning`` checkpoints, e.g. from ``llm.import_ckpt``):

* ``weights/``: a Megatron ``torch_dist`` distributed checkpoint whose keys carry the prefix
  ``module.`` (``module.decoder.layers.self_attention.linear_qkv.weight``, ...).
* ``context/model.yaml``: the model serialised by NeMo's io layer, the config under ``config:``
  with ``_target_: nemo.collections.llm.gpt.model.<module>.<ConfigClass>`` and Megatron
  ``TransformerConfig`` field names (``num_layers``, ``hidden_size``, ``ffn_hidden_size``,
  ``num_attention_heads``, ``num_query_groups``, ``kv_channels``, ``seq_length``,
  ``share_embeddings_and_output_weights``, ``normalization``, ``layernorm_epsilon``,
  ``rotary_base``, ``vocab_size``, ``add_qkv_bias``, ``qk_layernorm``, ``num_moe_experts``...).
  A flat file (config fields at the top level) is accepted too. ``context/io.json`` (the fiddle
  graph) is not parsed.
* ``context/nemo_tokenizer/``: Hugging Face tokenizer files, copied when present.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.convert.dist_copy import copy_dist_checkpoint
from megatron_cascade.convert.dist_reader import read_dist_metadata
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.hf_files import HF_SUBDIR, copy_side_files
from megatron_cascade.convert.layout import validate_layout
from megatron_cascade.model.weights_checkpoint import write_file_record

PREFIX = "module."
# Config classes (by module) we can map; Llama 3.1+/3.2/3.3 configs use RoPE scaling, which the builder lacks.
_SUPPORTED_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "base")
_ROPE_SCALED = ("Llama31", "Llama32", "Llama33", "Llama4")


def read_nemo_config(nemo_dir: str) -> tuple[dict[str, Any], str]:
    """(model config dict, path) from ``context/model.yaml``."""
    import yaml

    path = os.path.join(nemo_dir, "context", "model.yaml")
    if not os.path.isfile(path):
        raise ConversionError(f"{nemo_dir} is not a NeMo 2 checkpoint: context/model.yaml missing "
                              "(only context/model.yaml is read, not io.json)")
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    cfg = doc.get("config", doc) if isinstance(doc.get("config"), dict) else doc
    return cfg, path


def _check_target(cfg: dict[str, Any], source: str) -> None:
    target = str(cfg.get("_target_", ""))
    parts = target.split(".")
    ok = target.startswith("nemo.collections.llm.gpt.model.") and len(parts) >= 2 and parts[-2] in _SUPPORTED_MODULES
    if not ok:
        raise ConversionError(f"{source}: model config class {target or '(no _target_)'} is not supported; "
                              f"supported: nemo.collections.llm.gpt.model.{{{','.join(_SUPPORTED_MODULES)}}}.*")
    if parts[-1].startswith(_ROPE_SCALED) or cfg.get("seq_len_interpolation_factor") or cfg.get("scale_factor"):
        raise ConversionError(f"{source}: {parts[-1]} uses RoPE scaling, which the Megatron model builder does "
                              "not support")


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("activation_func", "silu")
    text = str(act.get("_target_", act) if isinstance(act, dict) else act).lower()
    gated = cfg.get("gated_linear_unit", True)
    if "silu" in text and gated:
        return "swiglu"
    if "gelu" in text and not gated:
        return "gelu"
    raise ConversionError(f"activation {text} with gated_linear_unit={gated} is not supported")


def model_config_from_nemo(cfg: dict[str, Any], source: str, *, vocab_rows: int | None = None) -> ModelConfig:
    """Map a NeMo 2 GPT config dict (from ``source``) to ``ModelConfig``.

    ``vocab_rows`` (embedding rows in the weights) stands in for a missing ``vocab_size``.
    """
    _check_target(cfg, source)
    try:
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg.get("vocab_size") or vocab_rows or 0)
        if not vocab:
            raise KeyError("vocab_size")
        model = ModelConfig(
            num_layers=int(cfg["num_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["ffn_hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_query_groups") or heads),
            kv_channels=int(cfg.get("kv_channels") or cfg["hidden_size"] // heads),
            vocab_size=vocab,
            make_vocab_size_divisible_by=int(cfg.get("make_vocab_size_divisible_by", 128)),
            max_position_embeddings=int(cfg.get("seq_length", 4096)),
            position_embedding_type=cfg.get("position_embedding_type", "rope"),
            rotary_base=float(cfg.get("rotary_base", 10000)),
            rotary_percent=float(cfg.get("rotary_percent", 1.0)),
            normalization=cfg.get("normalization", "RMSNorm"),
            norm_epsilon=float(cfg.get("layernorm_epsilon", 1e-5)),
            activation=_activation(cfg),
            add_bias_linear=bool(cfg.get("add_bias_linear", False)),
            add_qkv_bias=bool(cfg.get("add_qkv_bias", False)),
            qk_layernorm=bool(cfg.get("qk_layernorm", False)),
            tie_embeddings=bool(cfg.get("share_embeddings_and_output_weights", False)),
        )
        if cfg.get("num_moe_experts"):
            model.moe = MoEConfig(
                num_experts=int(cfg["num_moe_experts"]),
                router_topk=int(cfg.get("moe_router_topk", 2)),
                ffn_hidden_size=int(cfg.get("moe_ffn_hidden_size") or model.ffn_hidden_size),
                shared_expert_intermediate_size=cfg.get("moe_shared_expert_intermediate_size"),
                router_pre_softmax=bool(cfg.get("moe_router_pre_softmax", False)),
            )
    except KeyError as exc:
        raise ConversionError(f"{source}: required field {exc} is missing") from exc
    return model


def nemo2_to_megatron(nemo_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1) -> ModelConfig:
    """Convert the NeMo 2 checkpoint in ``nemo_dir`` into a megatron-cascade checkpoint in ``out_dir``.

    Strips the ``module.`` key prefix, records ``model_config.json`` and copies the tokenizer files
    to ``out_dir/hf/``; ``tp``/``pp``/``ep`` are validated only (the checkpoint loads at any layout).
    """
    cfg, source = read_nemo_config(nemo_dir)
    weights = os.path.join(nemo_dir, "weights")
    meta = read_dist_metadata(weights).state_dict_metadata
    emb = meta.get(PREFIX + "embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError(f"{weights}: no tensor {PREFIX}embedding.word_embeddings.weight; "
                              "not a NeMo 2 GPT checkpoint")
    model = model_config_from_nemo(cfg, source, vocab_rows=emb.size[0])
    if model.padded_vocab_size != emb.size[0]:
        raise ConversionError(f"{source}: vocab_size={model.vocab_size} pads to {model.padded_vocab_size} rows "
                              f"(make_vocab_size_divisible_by={model.make_vocab_size_divisible_by}), but the "
                              f"embedding in {weights} has {emb.size[0]}; set make_vocab_size_divisible_by in model.yaml")
    validate_layout(model, tp, pp, ep)
    copy_dist_checkpoint(weights, out_dir, model, src_prefix=PREFIX)
    copy_side_files(os.path.join(nemo_dir, "context", "nemo_tokenizer"), os.path.join(out_dir, HF_SUBDIR))
    write_file_record(out_dir)  # every load verifies each byte against it
    return model
