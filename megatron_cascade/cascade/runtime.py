"""Process setup for a run: torch.distributed from the launcher's environment, CPU mode, signals."""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Exit code of a run stopped by a preemption signal after checkpointing: "requeue me" (EX_TEMPFAIL).
EXIT_REQUEUE = 75


def init_distributed() -> None:
    """Join the process group the launcher describes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as set
    by torchrun or slurm/stage.sbatch), or make a one-process group; nccl on GPU, gloo on CPU."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        from megatron_cascade.testing.distributed import find_free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(find_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Small bookkeeping collectives (counts, metrics, flags) use CPU tensors: gloo carries
        # those, NCCL the CUDA tensors of the model.
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        from megatron_cascade.testing.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
        dist.init_process_group("gloo")


def shutdown_distributed() -> None:
    """Tear down Megatron's groups and the process group (idempotent)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Preempted(Exception):
    """Raised after a checkpoint was saved because the job was asked to stop (SIGUSR1/SIGTERM)."""


class PreemptionWatch:
    """Remembers SIGUSR1/SIGTERM; ranks agree at step boundaries (one may get it before another)."""

    def __init__(self) -> None:
        self._requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        log.warning("received signal %d: will checkpoint at the end of this step and exit", signum)
        self._requested = True

    def requested(self) -> bool:
        """Whether any rank was signalled (collective)."""
        flag = torch.tensor(1.0 if self._requested else 0.0)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)
