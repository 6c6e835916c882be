"""Process setup for a run: torch.distributed from the launcher's environment, CPU mode, signals,
and the Slurm job's time limit."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from datetime import datetime, timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from megatron_cascade.config.schema import CheckpointConfig, DistributedConfig

log = logging.getLogger(__name__)

#: Exit code of a run stopped by a preemption signal after checkpointing: "requeue me" (EX_TEMPFAIL).
EXIT_REQUEUE = 75
#: Collective timeout when a caller gives none (the schema's default: ``distributed.timeout_minutes``).
DEFAULT_TIMEOUT_MINUTES = DistributedConfig().timeout_minutes


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """Join the process group the launcher describes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as set
    by torchrun or slurm/stage.sbatch), or make a one-process group; nccl on GPU, gloo on CPU.

    ``timeout_minutes`` bounds every collective of the group (``distributed.timeout_minutes``): a
    rank waiting longer than that for the others (a hung peer) raises instead of waiting forever.
    """
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(find_free_port()))
    timeout = timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Small bookkeeping collectives (counts, metrics, flags) use CPU tensors: gloo carries
        # those, NCCL the CUDA tensors of the model.
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    else:
        from megatron_cascade.cpu_runtime import enable_cpu_mode

        enable_cpu_mode()
        dist.init_process_group("gloo", timeout=timeout)


def shutdown_distributed() -> None:
    """Tear down Megatron's groups and the process group (idempotent)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -- the Slurm job's end time -------------------------------------------------------------------
def _squeue_end_time(job_id: str) -> str:
    # SLURM_TIME_FORMAT=standard: ISO timestamps whatever the user's own format setting.
    env = {**os.environ, "SLURM_TIME_FORMAT": "standard"}
    res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=60,
                         env=env)
    return res.stdout.strip() if res.returncode == 0 else ""


def slurm_job_end_time(env: Mapping[str, str] | None = None,
                       query: Callable[[str], str] = _squeue_end_time) -> float | None:
    """Unix time (s) at which Slurm will end this job, or ``None`` (not a Slurm job, no time limit,
    or Slurm could not say).

    ``SLURM_JOB_END_TIME`` (unix seconds) where the Slurm version sets it, else one
    ``squeue -h -j $SLURM_JOB_ID -o %e``, which prints the job's end in this machine's local time
    (ISO format), or N/A / NONE / Unknown when there is no limit.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    value = env.get("SLURM_JOB_END_TIME", "")
    if value.isdigit() and int(value) > 0:
        log.info("job %s end time from SLURM_JOB_END_TIME", job_id)
        return float(value)
    try:
        text = query(job_id)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot ask Slurm for job %s's end time (%s): time-limit checkpoints rely on the signal",
                    job_id, exc)
        return None
    try:
        end = datetime.fromisoformat(text).timestamp()
    except ValueError:
        if text.upper() not in ("N/A", "NONE", "UNKNOWN", "UNLIMITED", ""):
            log.warning("squeue printed an end time %r this code cannot read; ignoring it", text)
        return None
    log.info("job %s end time from squeue: %s", job_id, text)
    return end


def _agreed_end_time() -> float | None:
    """Rank 0 asks Slurm once (one query per job, not per rank) and tells every rank."""
    end = slurm_job_end_time() if is_main_rank() else None
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return end
    value = torch.tensor([end if end is not None else -1.0], dtype=torch.float64)
    dist.broadcast(value, src=0)
    return float(value) if value.item() > 0 else None


# -- preemption and time limit -------------------------------------------------------------------
class Preempted(Exception):
    """Raised after a checkpoint was saved because the job was asked to stop (SIGUSR1/SIGTERM), or
    because the next step would not finish before the job's time limit."""


class PreemptionWatch:
    """Decides at each step end whether to checkpoint and exit (collective: ranks agree).

    Two reasons: a SIGUSR1/SIGTERM was received (by any rank), or the job's end time is too close
    for another step. ``requested()`` is called once per step end, so the time between two calls is
    a step's duration (including a periodic checkpoint when one was written). The next step is
    estimated as the longest of the last ``window`` steps; it is not started when
    ``now + estimate + margin_s`` passes the end time (``margin_s``: ``checkpoint.time_limit_margin_s``,
    room for the final checkpoint and exit). A step can take longer than Slurm's ``--signal`` lead
    time, so the signal alone may come too late.

    Args:
        end_time: unix time the job ends; ``"slurm"`` (default) asks Slurm (rank 0, once); ``None``
            disables the time-limit check.
        margin_s: seconds kept free before ``end_time``.
        clock: seconds since the epoch (``time.time``; tests pass a fake clock).
        window: number of recent steps the estimate looks at.
    """

    def __init__(self, end_time: float | None | str = "slurm",
                 margin_s: float = CheckpointConfig().time_limit_margin_s,
                 clock: Callable[[], float] = time.time, window: int = 3) -> None:
        self._requested = False
        self.end_time = _agreed_end_time() if end_time == "slurm" else end_time
        self.margin_s = margin_s
        self._clock = clock
        self._steps: deque[float] = deque(maxlen=window)
        self._last: float | None = clock()
        if self.end_time is not None and is_main_rank():
            log.info("job ends at %s: steps that cannot finish %.0f s before it are not started",
                     datetime.fromtimestamp(self.end_time).isoformat(timespec="seconds"), margin_s)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        log.warning("received signal %d: will checkpoint at the end of this step and exit", signum)
        self._requested = True

    def start_stage(self) -> None:
        """Forget step times (a new stage's steps differ); the first interval then also covers the
        stage's setup (model build, weight loading), which errs toward stopping early."""
        self._steps.clear()
        self._last = self._clock()

    def next_step_estimate(self) -> float | None:
        """Seconds the next step is expected to take (longest recent step), or None before any."""
        return max(self._steps) if self._steps else None

    def out_of_time(self, now: float) -> bool:
        """Whether a step started at ``now`` (then a checkpoint) would run past the job's end."""
        if self.end_time is None:
            return False
        estimate = self.next_step_estimate() or 0.0
        return now + estimate + self.margin_s > self.end_time

    def requested(self) -> bool:
        """Whether to checkpoint and stop now: any rank was signalled, or the next step would not
        finish in time (collective; call once per step end)."""
        now = self._clock()
        if self._last is not None:
            self._steps.append(now - self._last)
        stop_for_time = self.out_of_time(now)
        if stop_for_time and not self._requested:
            log.warning("job ends in %.0f s; the next step may take %.0f s (+ %.0f s margin): checkpointing now",
                        self.end_time - now, self.next_step_estimate() or 0.0, self.margin_s)
        flag = torch.tensor(1.0 if (self._requested or stop_for_time) else 0.0)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._last = self._clock()
        return bool(flag)
