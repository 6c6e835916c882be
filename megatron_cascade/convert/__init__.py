"""Checkpoint conversion on CPU: Hugging Face <-> Megatron distributed checkpoints, resharding, NeMo 2 import.

Conversions stream: they never build a model with weights, and hold about one decoder layer (plus
one output shard when writing safetensors) in memory. Megatron checkpoints are ``torch_dist``
distributed checkpoints with ``model_config.json``, loadable with
``megatron_cascade.model.load_model_weights`` at any TP/PP/EP layout.
"""

from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.hf_config import hf_config_from_model, model_config_from_hf
from megatron_cascade.convert.hf_to_megatron import hf_to_megatron
from megatron_cascade.convert.inspect import CheckpointSummary, format_summary, inspect_checkpoint
from megatron_cascade.convert.layout import validate_layout
from megatron_cascade.convert.megatron_to_hf import load_model_config, megatron_to_hf
from megatron_cascade.convert.nemo2 import model_config_from_nemo, nemo2_to_megatron
from megatron_cascade.convert.reshard import reshard

__all__ = [
    "ConversionError", "hf_to_megatron", "megatron_to_hf", "reshard", "nemo2_to_megatron", "inspect_checkpoint",
    "format_summary", "CheckpointSummary", "model_config_from_hf", "hf_config_from_model", "model_config_from_nemo",
    "load_model_config", "validate_layout",
]
