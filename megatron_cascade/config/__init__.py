"""Config schema (dataclasses: the one home of every default and of each field's valid values),
YAML loading and overrides. Importing it needs neither torch nor Megatron."""

from megatron_cascade.config.loader import load_config, resolve_stage, to_yaml, validate_run
from megatron_cascade.config.model import FP8Config, ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.rules import Choice, ConfigError, validate_tree
from megatron_cascade.config.schema import (
    ClusterConfig, DomainConfig, EvalConfig, ResolvedStage, RewardSpec, RolloutConfig, RunConfig, StageConfig,
)
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig, validate_optimizer_config

__all__ = [
    "ConfigError", "Choice", "ModelConfig", "MoEConfig", "FP8Config", "ParallelConfig", "LossConfig",
    "OptimizerConfig", "TrainingConfig", "RolloutConfig", "RewardSpec", "DomainConfig", "EvalConfig", "ClusterConfig",
    "StageConfig", "RunConfig", "ResolvedStage", "load_config", "resolve_stage", "validate_run", "validate_tree",
    "validate_optimizer_config", "to_yaml",
]
