"""Reward calls in persistent worker processes that are killed at their deadline.

Why: a verifier in a thread cannot be stopped. SymPy evaluating ``\\boxed{9^{9^{9^{9}}}}`` spends
minutes in C big-integer code holding the GIL, so neither the scoring timeout nor generation (the
trainer's other threads) can run. In a process the call is killed (SIGKILL) at its deadline and
the process replaced.

Which rewards run here: those marked with :func:`megatron_cascade.rewards.registry.run_in_process`
(every built-in verifier); :class:`megatron_cascade.rewards.scoring.ScoringPool` routes their calls
to :func:`verifier_pool`. Other plain rewards keep running in threads (their state, e.g. a cache,
stays in the trainer), where a timeout abandons the thread but cannot stop GIL-holding C code.

Workers are fresh interpreters (``subprocess``), not forks of the trainer: a fork would inherit
CUDA/NCCL state and locks held by other threads. A worker is kept for later calls: start-up plus
importing SymPy costs about half a second, a call well under a millisecond more than in a thread
(``benchmarks/verifier_processes.py``). At most ``max_processes`` run at
once; a call waits for a free one, and its deadline counts from the moment the worker has the
reward loaded (importing a module is not the response's fault; loading has its own limit,
:data:`LOAD_TIMEOUT_S`). Workers die with the trainer: PR_SET_PDEATHSIG relative to the pool's
spawner thread, which lives as long as the trainer, and EOF on their pipe when idle.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from megatron_cascade.rewards.outcome import ResponseTimeout

LOAD_TIMEOUT_S = 120.0  # importing a reward's module in a fresh worker (SymPy: ~0.5 s)
# Heap (RLIMIT_DATA: private writable memory; shared libraries do not count) of one worker: a response
# whose verification would allocate more (a huge power SymPy expands) gets MemoryError -- a response
# fault, i.e. score 0 -- instead of taking the node's memory (8 workers x unbounded).
VERIFIER_MEMORY_MB = 4096
_DEFAULT_MAX_PROCESSES = 8  # per trainer process; verifier calls take milliseconds
_BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
              "from megatron_cascade.rewards._verifier_worker import main; main(*map(int, sys.argv[2:]))")


def reward_payload(fn: Callable[..., Any]) -> bytes:
    """What a worker needs to load ``fn``: the pickled callable (module-level functions pickle by
    reference), else for a :class:`BoundReward` its registry name and kwargs (rebuilt there).

    Raises:
        TypeError: ``fn`` can be neither pickled nor rebuilt by name.
    """
    try:
        return pickle.dumps(("pickled", fn))
    except Exception as e:  # noqa: BLE001 - lambdas, closures, local functions
        name, kwargs = getattr(fn, "name", None), getattr(fn, "kwargs", None)
        if isinstance(name, str) and kwargs is not None:
            return pickle.dumps(("named", name, dict(kwargs)))
        raise TypeError(f"reward {fn!r} cannot be sent to a verifier process ({e}); "
                        "define it at module level") from e


@dataclass
class _Worker:
    proc: subprocess.Popen
    send: Connection  # parent -> worker
    recv: Connection  # worker -> parent

    def wait(self, timeout_s: float) -> Optional[tuple]:
        """The worker's next message, or None when none came within ``timeout_s``.

        Raises:
            EOFError: the worker died.
        """
        if not self.recv.poll(max(0.0, timeout_s)):
            return None
        return self.recv.recv()

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for conn in (self.send, self.recv):
            conn.close()

    def exit_text(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"


def _usable_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux: the CPUs this rank may run on
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _start_worker(memory_mb: int) -> _Worker:
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(to_r), str(from_w), str(os.getpid()),
             str(memory_mb)],
            pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL)
    except BaseException:
        for fd in (to_w, from_r):
            os.close(fd)
        raise
    finally:  # the child's ends
        os.close(to_r)
        os.close(from_w)
    return _Worker(proc, Connection(to_w, readable=False), Connection(from_r, writable=False))


class _Spawner:
    """Starts workers from one thread that lives as long as the trainer: PR_SET_PDEATHSIG fires
    when the *thread* that started a process ends, and scoring threads end after each call."""

    def __init__(self, memory_mb: int) -> None:
        self._memory_mb = memory_mb
        self._requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="verifier-spawner").start()

    def spawn(self) -> _Worker:
        future: Future = Future()
        self._requests.put(future)
        return future.result()

    def _loop(self) -> None:
        while True:
            future = self._requests.get()
            try:
                future.set_result(_start_worker(self._memory_mb))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                future.set_exception(e)


class VerifierProcessPool:
    """Up to ``max_processes`` worker processes, started on demand and reused; thread-safe.

    Args:
        max_processes: workers alive at once (default ``min(8, usable CPUs)``).
        memory_mb: heap limit of each worker in MiB (``RLIMIT_DATA``).
    """

    def __init__(self, max_processes: Optional[int] = None, memory_mb: int = VERIFIER_MEMORY_MB) -> None:
        if max_processes is not None and max_processes < 1:
            raise ValueError(f"max_processes must be >= 1, got {max_processes}")
        if memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (the interpreter and SymPy), got {memory_mb}")
        self.max_processes = max_processes or min(_DEFAULT_MAX_PROCESSES, _usable_cpus())
        self.memory_mb = memory_mb
        self._idle: list[_Worker] = []
        self._live = 0
        self._closed = False
        self._cond = threading.Condition()
        self._spawner: Optional[_Spawner] = None

    def call(self, fn: Callable[[str, dict], Any], response: str, sample: dict, timeout_s: float,
             on_start: Optional[Callable[[float], None]] = None) -> Any:
        """``fn(response, sample)`` in a worker: its float, or (returned, not raised) the exception
        it raised, a :class:`~megatron_cascade.rewards.outcome.ResponseTimeout` when it ran past
        ``timeout_s`` seconds (the worker is killed), or a RuntimeError / TimeoutError when the worker
        died or could not load ``fn`` (infrastructure).

        ``on_start(t)`` is called with the ``time.monotonic()`` at which the deadline started.
        """
        try:
            payload = reward_payload(fn)
            worker = self._acquire()
        except Exception as e:  # noqa: BLE001 - this item's error
            return e
        healthy = False
        try:
            value, healthy = self._run(worker, payload, response, sample, timeout_s, on_start)
            return value
        finally:
            self._release(worker, healthy)

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed when their call returns (idempotent)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    @property
    def live(self) -> int:
        """Worker processes alive now (idle or busy)."""
        with self._cond:
            return self._live

    # -- internals ----------------------------------------------------------------------------------
    def _acquire(self) -> _Worker:
        with self._cond:
            dead = [w for w in self._idle if w.proc.poll() is not None]  # e.g. the OOM killer's: not an item's fault
            self._idle = [w for w in self._idle if w not in dead]
            self._live -= len(dead)
            while not self._idle and self._live >= self.max_processes and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("verifier process pool is closed")
            if self._idle:
                return self._idle.pop()
            self._live += 1  # reserve the slot, start the process outside the lock
            if self._spawner is None:
                self._spawner = _Spawner(self.memory_mb)
            spawner = self._spawner
        try:
            return spawner.spawn()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._cond:
            keep = healthy and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._live -= 1
            self._cond.notify()
        if not keep:
            worker.kill()

    @staticmethod
    def _run(worker: _Worker, payload: bytes, response: str, sample: dict, timeout_s: float,
             on_start: Optional[Callable[[float], None]]) -> tuple[Any, bool]:
        """(value, whether the worker can be reused)."""
        try:
            worker.send.send(("call", payload, response, sample))
            message = worker.wait(LOAD_TIMEOUT_S)
            if message is None:
                return TimeoutError(f"loading the reward in a verifier process took over {LOAD_TIMEOUT_S:.0f} s"), False
            if message[0] == "started":
                start = time.monotonic()
                if on_start is not None:
                    on_start(start)
                message = worker.wait(start + timeout_s - time.monotonic())
                if message is None:
                    # The verifier judged only the response: the response's own timeout (a verdict).
                    return ResponseTimeout.after(timeout_s), False
            return message[1], True
        except (EOFError, OSError) as e:
            try:
                worker.proc.wait(timeout=5)  # for its exit status in the message
            except subprocess.TimeoutExpired:
                pass
            return RuntimeError(f"verifier process died ({worker.exit_text()}): {type(e).__name__}"), False
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable sample or reply
            return e, False


_POOL: Optional[VerifierProcessPool] = None
_POOL_LOCK = threading.Lock()


def verifier_pool() -> VerifierProcessPool:
    """The trainer process's shared pool (created on first use, closed at exit)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = VerifierProcessPool()
            atexit.register(_POOL.close)
        return _POOL
