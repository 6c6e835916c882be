"""CPU test support for Megatron-Core code: CPU mode and a multi-process gloo harness."""

from megatron_cascade.testing.cpu_mode import cpu_mode_enabled, enable_cpu_mode
from megatron_cascade.testing.distributed import WorkerError, find_free_port, run_distributed

__all__ = ["enable_cpu_mode", "cpu_mode_enabled", "run_distributed", "find_free_port", "WorkerError"]
