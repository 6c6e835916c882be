"""Run a function on N gloo worker processes and collect what each returns.

``run_distributed(fn, world_size, *args)`` is the multi-process harness of our tests, and users can
use it to test their own plugins: each worker gets the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), an initialised gloo process group and, by
default, Megatron-Core's CPU mode. Workers are forked from a fork server that has torch and
Megatron-Core imported (each spawned worker had spent ~9 s importing them: 290 -> 159 s for
``tests/training/test_train_invariance.py``), with the caller's environment, folder and ``sys.path``
of the call, as a spawned one would have. The first worker error is re-raised in the caller with the
worker's traceback; the other workers (blocked in a collective, typically) are then killed with
their whole process tree. Nothing outlives the call.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import psutil

from megatron_cascade.cascade.runtime import find_free_port


class WorkerError(RuntimeError):
    """A worker process raised, crashed or timed out; carries its rank and traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank


# What every worker imports anyway (~9 s of a 2-rank call on 2 cores): imported once, in the fork
# server, which forks each worker with them loaded.
_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
            "megatron_cascade.cpu_runtime", "megatron_cascade.model", "megatron_cascade.training")


@functools.lru_cache(maxsize=1)
def _worker_context() -> mp.context.BaseContext:
    """``forkserver`` with the heavy imports preloaded (one server per process, started on first use);
    ``spawn`` where there is no fork server (not Linux)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    world_size: int
    port: int
    cpu_mode: bool
    threads: int
    env: dict[str, str]  # the caller's whole environment at the call, then ``env``
    cwd: str
    sys_path: list[str]


def _worker_main(spec: _WorkerSpec, fn: Callable, args: tuple, kwargs: dict, results) -> None:
    # A fork server's child starts with the server's environment, folder and sys.path (from its
    # start): take the caller's of now, as a spawned process would.
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
    )
    try:
        from megatron_cascade.run_logging import silence_cpu_warnings

        silence_cpu_warnings()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
        if spec.cpu_mode:
            from megatron_cascade.cpu_runtime import enable_cpu_mode

            enable_cpu_mode()
        dist.init_process_group("gloo", rank=spec.rank, world_size=spec.world_size)
        try:
            out = fn(*args, **kwargs)
        finally:
            _teardown_parallel_state()
        # Plain pickle bytes: a tensor sent through the queue as-is would be shared by file
        # descriptor and vanish when this process exits.
        results.put((spec.rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((spec.rank, False, traceback.format_exc()))


def _teardown_parallel_state() -> None:
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - best effort: megatron may never have been initialised
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill_tree(proc: mp.process.BaseProcess) -> None:
    if proc.pid is None:
        return
    try:
        parent = psutil.Process(proc.pid)
        family = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    proc.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    cpu_mode: bool = True,
    threads_per_worker: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo processes; return results by rank.

    Args:
        fn: a picklable (module-level) function; it runs after ``init_process_group("gloo")``.
        world_size: number of processes.
        timeout_s: wall-clock limit for the whole call, in seconds.
        cpu_mode: enable Megatron-Core's CPU mode (see ``cpu_mode.py``) in each worker.
        threads_per_worker: torch intra-op threads per worker (default: cores / world_size).
        env: extra environment variables for the workers.

    Raises:
        WorkerError: the first worker that failed (with its traceback), or a timeout.
    """
    ctx = _worker_context()
    results = ctx.Queue()
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    port = find_free_port()
    procs = []
    try:
        for rank in range(world_size):
            spec = _WorkerSpec(rank, world_size, port, cpu_mode, threads, {**os.environ, **(env or {})}, os.getcwd(),
                               list(sys.path))
            # Not daemonic: workers may start children (the checkpoint writer starts a Manager).
            proc = ctx.Process(target=_worker_main, args=(spec, fn, args, kwargs, results))
            proc.start()
            procs.append(proc)
        return _collect(procs, results, timeout_s)
    finally:
        for proc in procs:
            _kill_tree(proc)
        results.close()


def _collect(procs: list, results, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    while len(out) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in out or proc.exitcode is None:
                    continue
                # A result put just before exiting may still be in the pipe: allow a grace period.
                if now - dead_since.setdefault(rank, now) > 2.0:
                    raise WorkerError(rank, f"process exited with code {proc.exitcode} without a result")
            if now > deadline:
                missing = [r for r in range(len(procs)) if r not in out]
                raise WorkerError(missing[0], f"timed out after {timeout_s:.0f}s (ranks {missing})")
            continue
        if not ok:
            raise WorkerError(rank, f"raised:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(len(procs))]
