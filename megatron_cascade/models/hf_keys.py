"""Hugging Face ``config.json`` keys every family reads or writes the same way: RoPE, dtype.

Accepts both the classic keys (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the
transformers 5 ones (``rope_parameters``, ``dtype``).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_cascade.models.errors import ConversionError

HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_TO_HF = {v: k for k, v in HF_DTYPES.items()}


def rope(hf: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope theta, the RoPE scaling dict or None for plain RoPE)."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def set_rope_theta(hf: dict[str, Any], theta: float) -> None:
    value = int(theta) if float(theta).is_integer() else theta
    if "rope_parameters" in hf:
        hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": value}
    else:
        hf["rope_theta"] = value


def hf_precision(hf: dict[str, Any], source: str) -> str:
    """The precision (fp32|bf16|fp16) of an HF config's ``torch_dtype`` / ``dtype`` (default float32)."""
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in HF_DTYPES:
        raise ConversionError(f"{source}: dtype {dtype!r} is not one of {list(HF_DTYPES)}; pass --precision")
    return HF_DTYPES[dtype]


def set_dtype(hf: dict[str, Any], template: Optional[dict[str, Any]], dtype: str) -> None:
    """The dtype key: ``torch_dtype`` unless the template used transformers 5's ``dtype``."""
    hf.pop("dtype", None)
    hf["torch_dtype" if template is None or "torch_dtype" in template else "dtype"] = PRECISION_TO_HF[dtype]
