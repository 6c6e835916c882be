"""Config schema (dataclasses: the one home of every default), YAML loading and overrides."""

from megatron_cascade.config.loader import load_config, resolve_stage, to_yaml, validate_run
from megatron_cascade.config.model import ConfigError, FP8Config, ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.schema import (
    ClusterConfig, DomainConfig, EvalConfig, ResolvedStage, RewardSpec, RolloutConfig, RunConfig, StageConfig,
)
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig

__all__ = [
    "ConfigError", "ModelConfig", "MoEConfig", "FP8Config", "ParallelConfig", "LossConfig", "OptimizerConfig",
    "TrainingConfig", "RolloutConfig", "RewardSpec", "DomainConfig", "EvalConfig", "ClusterConfig", "StageConfig",
    "RunConfig", "ResolvedStage", "load_config", "resolve_stage", "validate_run", "to_yaml",
]
