"""Test support for Megatron-Core code: a multi-process gloo harness (CPU mode itself lives in
:mod:`megatron_cascade.cpu_runtime`, which the trainer uses too; re-exported here for plugin tests)."""

from megatron_cascade.cpu_runtime import cpu_mode_enabled, enable_cpu_mode
from megatron_cascade.testing.distributed import WorkerError, find_free_port, run_distributed

__all__ = ["enable_cpu_mode", "cpu_mode_enabled", "run_distributed", "find_free_port", "WorkerError"]
