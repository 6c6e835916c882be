"""Config schema (dataclasses: the one home of every default), YAML loading and overrides."""

from megatron_cascade.config.model import ConfigError, FP8Config, ModelConfig, MoEConfig, ParallelConfig

__all__ = ["ConfigError", "ModelConfig", "MoEConfig", "FP8Config", "ParallelConfig"]
