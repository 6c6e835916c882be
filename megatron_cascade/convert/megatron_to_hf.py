"""Megatron distributed checkpoint -> Hugging Face (config.json + safetensors shards), streamed per layer."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.convert.dist_reader import DistCheckpointReader
from megatron_cascade.convert.dist_writer import ensure_empty_dir
from megatron_cascade.convert.hf_config import TORCH_DTYPES, hf_config_from_model
from megatron_cascade.convert.hf_files import HF_SUBDIR, CONFIG_FILE, copy_side_files, write_hf_config
from megatron_cascade.convert.runtime import build_skeleton, megatron_runtime
from megatron_cascade.convert.safetensors_io import ShardedSafetensorsWriter, parse_size
from megatron_cascade.convert.spec_names import resolve_spec_names
from megatron_cascade.convert.tensor_dtypes import DtypeRecord, read_source_dtypes
from megatron_cascade.convert.tensor_maps import to_hf
from megatron_cascade.model.weights_checkpoint import CheckpointError, check_file_record, read_model_config
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.models.registry import family_by_architecture, family_of_model


def load_model_config(ckpt_dir: str) -> ModelConfig:
    """The ``ModelConfig`` recorded in a weights directory's ``model_config.json``, once every file of the
    directory matches its ``files.json`` (where it has one)."""
    try:
        check_file_record(ckpt_dir)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    try:
        raw = dict(read_model_config(ckpt_dir)["config"])
    except (CheckpointError, KeyError) as exc:
        raise ConversionError(f"{ckpt_dir}: no usable model_config.json ({exc}); "
                              "it was not written by megatron-cascade") from exc
    for f in dataclasses.fields(ModelConfig):  # nested sections (moe, fp8, hybrid) back into dataclasses
        if f.default_factory is not dataclasses.MISSING and isinstance(raw.get(f.name), dict):
            raw[f.name] = type(f.default_factory())(**raw[f.name])
    return ModelConfig(**raw)


def _source_hf_config(ckpt_dir: str) -> dict | None:
    path = os.path.join(ckpt_dir, HF_SUBDIR, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def megatron_to_hf(ckpt_dir: str, out_dir: str, *, dtype: str | None = None, max_shard_size: str | int = "5GB") -> str:
    """Convert the Megatron checkpoint in ``ckpt_dir`` to a Hugging Face checkpoint in ``out_dir``.

    ``dtype`` (fp32|bf16|fp16) casts every tensor; default: each tensor in the dtype the HF import
    recorded for it (``tensor_dtypes``), else in the dtype it is stored in. Vocab padding rows are dropped. Shards hold at most ``max_shard_size`` bytes ('5GB', '500MB', int).
    The family comes from the HF config recorded at import (``ckpt_dir/hf/config.json``), else
    from the model config (MoE -> Qwen3-MoE, q/k norm -> Qwen3, qkv bias -> Qwen2, else Llama).
    Returns the architecture written. Peak memory: one shard plus one decoder layer.
    """
    model = load_model_config(ckpt_dir)
    template = _source_hf_config(ckpt_dir)
    family = family_by_architecture(template["architectures"][0], CONFIG_FILE) if template else family_of_model(model)
    family.check_supported(model)
    ensure_empty_dir(out_dir)
    with megatron_runtime():
        reader = DistCheckpointReader(ckpt_dir, build_skeleton(model))
        stored = reader.dtype_of("embedding.word_embeddings.weight")
        target = TORCH_DTYPES[dtype] if dtype else stored
        dtypes = _DtypeRule(TORCH_DTYPES[dtype] if dtype else None, read_source_dtypes(ckpt_dir))
        writer = ShardedSafetensorsWriter(out_dir, parse_size(max_shard_size))
        tensors = reader.skeleton.tensors
        for meg, hf in resolve_spec_names(family.global_names(model), tensors).items():
            _export({meg: hf}, reader, writer, model, dtypes)
        for layer in range(model.num_layers):
            _export(resolve_spec_names(family.layer_names(model, layer), tensors), reader, writer, model, dtypes)
        writer.finish()
    precision = {v: k for k, v in TORCH_DTYPES.items()}[target]
    write_hf_config(out_dir, hf_config_from_model(model, family, template, precision))
    copy_side_files(os.path.join(ckpt_dir, HF_SUBDIR), out_dir)
    return family.architecture


@dataclass(frozen=True)
class _DtypeRule:
    """The dtype each HF tensor is written in: ``forced`` (``--dtype``), else the one the HF import
    recorded, else the dtype it is stored in (lossless: float32 where Megatron keeps float32)."""

    forced: torch.dtype | None
    recorded: DtypeRecord | None

    def of(self, hf_name: str, stored: torch.dtype) -> torch.dtype:
        if self.forced is not None:
            return self.forced
        return self.recorded.of(hf_name) if self.recorded is not None else stored


def _export(names: dict[str, str], reader: DistCheckpointReader, writer: ShardedSafetensorsWriter,
            model: ModelConfig, dtypes: _DtypeRule) -> None:
    tensors = reader.read(list(names))
    for meg, joined in names.items():
        hf_names = joined.split("+")
        for name, part in zip(hf_names, to_hf(meg, tensors[meg], len(hf_names), model)):
            writer.add(name, part.to(dtypes.of(name, part.dtype)))
