"""megatron-cascade: Cascade RL (GRPO stage by stage) and MOPD on top of Megatron-Core."""

__version__ = "0.1.0"
