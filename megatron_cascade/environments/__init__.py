"""Multi-turn environments: the protocol (``base``), the single-turn adapter of today's rewards, tool
calling, and the episode runner that drives the policy through them."""

from megatron_cascade.environments.base import (
    ENVIRONMENTS,
    EnvStep,
    Environment,
    build_environment,
    register_environment,
)

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "build_environment", "register_environment"]
