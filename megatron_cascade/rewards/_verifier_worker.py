"""Worker process of :mod:`megatron_cascade.rewards.isolation`: runs reward calls sent over a pipe.

Started as ``python -c <bootstrap> SYS_PATH FD_IN FD_OUT PARENT_PID MEMORY_MB`` (the bootstrap sets
``sys.path`` to the trainer's, so that user reward modules import here as there). Protocol, one
pickled tuple per message (``multiprocessing.connection`` framing) on two private pipes:

* parent -> worker: ``("call", payload, response, sample)``; ``payload`` is
  :func:`megatron_cascade.rewards.isolation.reward_payload` of the reward;
* worker -> parent: ``("started",)`` once the reward is loaded (the call's deadline starts here),
  then ``("result", value)`` where ``value`` is a float or the exception the reward raised.

A failure to load the reward answers ``("result", exception)`` without ``("started",)``.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the trainer's spawner thread (hence the trainer) ends: a worker
    stuck in C code (SymPy) would otherwise outlive a killed trainer. Linux only; elsewhere an idle
    worker still ends at EOF on its pipe."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _load(payload: bytes) -> Callable[[str, dict], Any]:
    kind, *rest = pickle.loads(payload)
    if kind == "pickled":
        return rest[0]
    from megatron_cascade.rewards.registry import build_reward  # by name: the fn itself did not pickle

    name, kwargs = rest
    return build_reward(name, kwargs)


def _as_score(value: Any) -> Any:
    """A float (the parent applies the finite / [0, 1] rules), or the exception that makes the
    item an error: a returned object need not pickle, its number does."""
    if isinstance(value, BaseException):
        return value
    try:
        return float(value)
    except Exception as e:  # noqa: BLE001 - any failure to convert is this item's error
        return TypeError(f"reward returned {type(value).__name__}, not a number: {_text(e)}")


def _picklable(value: Any) -> Any:
    """``value`` if the parent can unpickle it, else a RuntimeError with its text (some library
    exceptions take constructor arguments that pickle does not record)."""
    try:
        pickle.loads(pickle.dumps(value))
        return value
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(value).__name__}: {_text(value)}")


def _text(e: Any) -> str:
    try:
        return str(e)[:2000]
    except Exception:  # noqa: BLE001 - a broken __str__ must not kill the worker
        return "<unprintable>"


def serve(conn_in: Connection, conn_out: Connection) -> None:
    """Answer calls until the parent closes the pipe."""
    loaded: dict[bytes, Callable[[str, dict], Any]] = {}
    while True:
        try:
            message = conn_in.recv()
        except (EOFError, OSError):
            return
        _, payload, response, sample = message
        try:
            fn = loaded.get(payload) or loaded.setdefault(payload, _load(payload))
        except BaseException as e:  # noqa: BLE001 - reported as this item's error
            conn_out.send(("result", _picklable(RuntimeError(f"cannot load the reward in a verifier process: "
                                                             f"{type(e).__name__}: {_text(e)}"))))
            continue
        conn_out.send(("started",))
        try:
            value = _as_score(fn(response, sample))
        except BaseException as e:  # noqa: BLE001 - SystemExit too: the worker must answer
            value = e
        conn_out.send(("result", _picklable(value)))


def main(fd_in: int, fd_out: int, parent_pid: int, memory_mb: int) -> None:
    _die_with_parent(parent_pid)
    import resource

    limit = memory_mb << 20  # heap: what a response can make a verifier allocate (MemoryError past it)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which ends the pool
    serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False))
