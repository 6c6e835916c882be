"""Megatron-Core model construction (GPTModel, hybrid MambaModel), parallel layout and weight checkpoints."""

from megatron_cascade.model.builder import build_gpt_model, build_model, transformer_config, validate_model_config
from megatron_cascade.model.weights_checkpoint import CheckpointError, load_model_weights, save_model_weights
from megatron_cascade.model.parallel import Layout, initialize_model_parallel, resolve_layout

__all__ = [
    "build_model", "build_gpt_model", "transformer_config", "validate_model_config", "Layout", "resolve_layout",
    "initialize_model_parallel", "CheckpointError", "save_model_weights", "load_model_weights",
]
