"""Describe a checkpoint directory from its metadata only: config, tensor names, shapes, dtypes, totals.

Recognises Hugging Face directories (config.json + safetensors), megatron-cascade distributed
checkpoints (.metadata + model_config.json) and NeMo 2 directories (context/ + weights/).
No tensor data is read.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

from megatron_cascade.convert.dist_reader import read_dist_metadata
from megatron_cascade.convert.dist_writer import METADATA_FILE
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.hf_config import model_config_from_hf
from megatron_cascade.convert.hf_files import CONFIG_FILE, read_hf_config
from megatron_cascade.convert.safetensors_io import DTYPES, SafetensorsReader
from megatron_cascade.model.weights_checkpoint import MODEL_CONFIG_FILE, read_model_config
from megatron_cascade.models.architectures import ARCHITECTURES

_DTYPE_SIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


@dataclass
class CheckpointSummary:
    """What ``inspect_checkpoint`` reports; ``tensors`` holds (name, shape, dtype) of every tensor."""

    kind: str  # huggingface | megatron | nemo2
    path: str
    config: dict[str, Any]
    model_config: dict[str, Any] | None
    model_config_error: str | None
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    total_parameters: int = 0
    total_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tensors as objects)."""
        out = asdict(self)
        out["tensors"] = [{"name": n, "shape": list(s), "dtype": d} for n, s, d in self.tensors]
        return out


def detect_kind(path: str) -> str:
    """huggingface | megatron | nemo2, or ConversionError if ``path`` is none of them."""
    if os.path.isdir(os.path.join(path, "weights")) and os.path.isdir(os.path.join(path, "context")):
        return "nemo2"
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return "megatron"
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return "huggingface"
    raise ConversionError(f"{path} is not a Hugging Face, Megatron or NeMo 2 checkpoint directory "
                          f"(no {CONFIG_FILE}, {METADATA_FILE} or context/+weights/)")


def inspect_checkpoint(path: str) -> CheckpointSummary:
    """A ``CheckpointSummary`` of the checkpoint directory ``path`` (metadata only)."""
    kind = detect_kind(path)
    if kind == "huggingface":
        return _inspect_hf(path)
    return _inspect_dist(path, kind)


def _inspect_hf(path: str) -> CheckpointSummary:
    config, source = read_hf_config(path)
    model, error = None, None
    try:
        model = asdict(model_config_from_hf(config, source)[1])
    except ConversionError as exc:
        error = str(exc)
    reader = SafetensorsReader(path)
    tensors = [(i.name, i.shape, i.dtype) for i in sorted(reader.tensors.values(), key=lambda i: i.name)]
    nbytes = sum(i.end - i.start for i in reader.tensors.values())
    return CheckpointSummary("huggingface", path, config, model, error, tensors, reader.total_parameters(), nbytes)


def _inspect_dist(path: str, kind: str) -> CheckpointSummary:
    if kind == "nemo2":
        from megatron_cascade.convert.nemo2 import model_config_from_nemo, read_nemo_config

        config, source = read_nemo_config(path)
        weights = os.path.join(path, "weights")
        model, error = None, None
        try:
            model = asdict(model_config_from_nemo(config, source))
        except ConversionError as exc:
            error = str(exc)
    else:
        config = read_model_config(path) if os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE)) else {}
        weights = path
        model = config.get("config")
        error = None if model else f"{MODEL_CONFIG_FILE} missing: not written by megatron-cascade"
    meta = read_dist_metadata(weights).state_dict_metadata
    tensors = []
    for key, item in sorted(meta.items()):
        if hasattr(item, "size"):
            dtype = str(item.properties.dtype).replace("torch.", "")
            tensors.append((key, tuple(item.size), dtype))
    total = sum(prod(s) for _, s, _ in tensors)
    nbytes = sum(prod(meta[k].size) * meta[k].properties.dtype.itemsize for k, _, _ in tensors)
    return CheckpointSummary(kind, path, config, model, error, tensors, total, nbytes)


def _architecture_text(m: dict) -> str:
    """The architecture's own sizes (a hybrid model's pattern and Mamba-2 sizes) of a saved model config."""
    architecture = ARCHITECTURES.get(str(m.get("architecture")))
    return architecture.describe(m) if architecture is not None else ""


def format_summary(summary: CheckpointSummary, *, show_tensors: bool = True) -> str:
    """Human-readable text of a summary."""
    lines = [f"{summary.kind} checkpoint: {summary.path}"]
    if summary.model_config is not None:
        m = summary.model_config
        moe = m.get("moe", {}) or {}
        lines.append(
            f"model: layers={m['num_layers']} hidden={m['hidden_size']} ffn={m['ffn_hidden_size']} "
            f"heads={m['num_attention_heads']} kv_heads={m['num_query_groups']} head_dim={m['kv_channels']} "
            f"vocab={m['vocab_size']} (padded to a multiple of {m['make_vocab_size_divisible_by']}) "
            f"tied={m['tie_embeddings']} precision={m['precision']}"
            + (f" experts={moe['num_experts']} top{moe['router_topk']}" if moe.get("num_experts") else "")
            + (f" shared_expert={moe['shared_expert_intermediate_size']}"
               if moe.get("shared_expert_intermediate_size") else "")
            + _architecture_text(m)
        )
    if summary.model_config_error:
        lines.append(f"model config: not convertible: {summary.model_config_error}")
    lines.append(f"tensors: {len(summary.tensors)}  parameters: {summary.total_parameters:,}  "
                 f"bytes: {summary.total_bytes:,}")
    if summary.kind != "huggingface":
        lines.append("(Megatron keys stack layers/experts on leading axes; embedding rows include vocab padding)")
    if show_tensors:
        width = max((len(n) for n, _, _ in summary.tensors), default=0)
        lines += [f"  {n:<{width}}  {str(list(s)):<24} {d}" for n, s, d in summary.tensors]
    return "\n".join(lines)
