"""Hugging Face (config.json + safetensors) -> Megatron distributed checkpoint, streamed per layer."""

from __future__ import annotations

import os

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.convert.dist_writer import DistCheckpointWriter
from megatron_cascade.convert.hf_config import TORCH_DTYPES, model_config_from_hf
from megatron_cascade.convert.hf_files import HF_SUBDIR, copy_side_files, read_hf_config
from megatron_cascade.convert.layout import validate_layout
from megatron_cascade.convert.runtime import build_skeleton, megatron_runtime
from megatron_cascade.convert.safetensors_io import SafetensorsReader
from megatron_cascade.convert.spec_names import resolve_spec_names
from megatron_cascade.convert.tensor_dtypes import write_source_dtypes
from megatron_cascade.convert.tensor_maps import to_megatron
from megatron_cascade.model.weights_checkpoint import write_file_record
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.models.family import ModelFamily
from megatron_cascade.models.hf_keys import hf_precision

# Tensors HF checkpoints may carry that the model recomputes (ignored on import).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_to_megatron(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    make_vocab_size_divisible_by: int = 128,
    precision: str | None = None,
) -> ModelConfig:
    """Convert the HF checkpoint in ``hf_dir`` into a Megatron distributed checkpoint in ``out_dir``.

    The checkpoint loads at any TP/PP/EP layout; ``tp``/``pp``/``ep`` are only validated against the
    config (so a layout that cannot work fails now, not at training time). Embedding and output
    rows are zero-padded from ``vocab_size`` to the padded vocab size. ``precision`` (fp32|bf16|fp16)
    casts the weights; default: the HF config's dtype. ``out_dir/hf/`` keeps config.json, the
    tokenizer files and the dtypes of tensors stored in another dtype (``tensor_dtypes``) for the way back. Returns the model config written to ``model_config.json``.
    Peak memory: about one decoder layer (plus the embedding when it is written).
    """
    config, config_path = read_hf_config(hf_dir)
    family, model = model_config_from_hf(config, config_path, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                         precision=precision)
    family.check_supported(model)
    validate_layout(model, tp, pp, ep)
    weights = SafetensorsReader(hf_dir)
    _check_names(weights, family, model, hf_dir)
    with megatron_runtime():
        skeleton = build_skeleton(model)
        writer = DistCheckpointWriter(out_dir, skeleton, model, TORCH_DTYPES[model.precision])
        for meg, hf in resolve_spec_names(family.global_names(model), skeleton.tensors).items():
            writer.write(_convert({meg: hf}, weights, model))
        for layer in range(model.num_layers):
            writer.write(_convert(resolve_spec_names(family.layer_names(model, layer), skeleton.tensors), weights,
                                  model))
        writer.finish()
    copy_side_files(hf_dir, os.path.join(out_dir, HF_SUBDIR), include_config=True)
    write_source_dtypes(weights, family.all_hf_names(model), TORCH_DTYPES[hf_precision(config, config_path)],
                        TORCH_DTYPES[model.precision], out_dir)
    write_file_record(out_dir)  # every load verifies each byte against it
    return model


def _convert(names: dict[str, str], weights: SafetensorsReader, model: ModelConfig) -> dict:
    return {meg: to_megatron(meg, [weights.get(h) for h in hf.split("+")], model) for meg, hf in names.items()}


def _check_names(weights: SafetensorsReader, family: ModelFamily, model: ModelConfig, hf_dir: str) -> None:
    expected = family.all_hf_names(model)
    present = {n for n in weights.tensors if not n.endswith(_IGNORED_SUFFIXES)}
    if model.tie_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store it
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ConversionError(
            f"the tensors in {hf_dir} do not match its config.json ({family.architecture}): "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
