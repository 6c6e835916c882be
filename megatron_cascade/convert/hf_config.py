"""Hugging Face ``config.json`` <-> ``ModelConfig``: the family the config names does the mapping
(``models/<family>/``), refusing features the model builder lacks."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.family import ModelFamily
from megatron_cascade.models.hf_keys import hf_precision, set_dtype
from megatron_cascade.models.registry import read_architecture

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_config_from_hf(hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int = 128,
                         precision: Optional[str] = None) -> tuple[ModelFamily, ModelConfig]:
    """Map an HF config dict (read from ``source``) to its family and our ``ModelConfig``.

    ``precision`` (fp32|bf16|fp16) overrides the config's dtype; the default keeps it.
    """
    family = read_architecture(hf, source)
    return family, family.model_config(hf, source, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                       precision=precision or hf_precision(hf, source))


def hf_config_from_model(model: ModelConfig, family: ModelFamily, template: Optional[dict[str, Any]],
                         dtype: str) -> dict[str, Any]:
    """The HF config dict for ``model``: ``template`` (the config imported from, if any) updated;
    ``dtype`` is the precision of the written tensors (fp32|bf16|fp16)."""
    hf = family.hf_config(model, template)
    set_dtype(hf, template, dtype)
    return hf
