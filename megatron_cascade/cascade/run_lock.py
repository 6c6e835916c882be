"""One run per output directory: an exclusive ``flock`` on ``OUTPUT_DIR/.megatron-cascade.lock``.

Rank 0 of a run takes it before it reads or writes anything in the directory and keeps it until the
run ends. The kernel drops a ``flock`` when its holder dies, SIGKILL included, so a crashed run
never leaves a stale lock; the file itself stays (removing a lock file races with its next taker)
and holds the holder's host, pid, start time and Slurm job as JSON, for the refusal message.

Shared file systems: NFS (the Linux client turns ``flock`` into NFS byte-range locks) and Lustre
mounted with ``-o flock`` lock across nodes; a file system that refuses ``flock`` is an error (a run
there could not be protected). A node that dies while holding the lock keeps it on NFS until the
server's lease expires (~90 s): a requeued Slurm job (same job id, higher ``SLURM_RESTART_COUNT``)
therefore waits for its previous incarnation for up to ``requeue_wait_s`` instead of failing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from datetime import datetime, timezone
from typing import Optional

log = logging.getLogger(__name__)

LOCK_FILE = ".megatron-cascade.lock"
REQUEUE_WAIT_S = 300.0

# Descriptors of locks this process holds: closed in forked children (multiprocessing workers), so
# that a child outliving its parent does not keep the run's lock (a flock lasts while any
# descriptor of its open file is open; closing the child's copy leaves the parent's lock alone).
_HELD: set[int] = set()


def _close_in_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLockError(RuntimeError):
    """The output directory is held by another run, or cannot be locked; the message names why."""


class RunLock:
    """A held lock on an output directory; ``release()`` (or leaving a ``with`` block) frees it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: Optional[int] = fd

    def release(self) -> None:
        """Unlock and close (idempotent); the lock file stays."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _slurm_job() -> tuple[Optional[str], int]:
    return os.environ.get("SLURM_JOB_ID") or None, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def _holder_record() -> dict:
    job, restart = _slurm_job()
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "slurm_job_id": job, "slurm_restart_count": restart, "command": " ".join(sys.argv)[:400]}


def read_holder(path: str) -> dict:
    """What the lock file at ``path`` says about its last holder ({} if unreadable or empty)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict, path: str) -> str:
    if not holder:
        return "a run that has not yet written its name (it is starting)"
    text = f"host {holder.get('host')} pid {holder.get('pid')}, started {holder.get('started')}"
    if holder.get("slurm_job_id"):
        text += f", Slurm job {holder['slurm_job_id']}"
    if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
        text += (" (that process has exited; a process it started still holds the lock: "
                 f"find it with `fuser -v {path}`)")
    return text


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _is_previous_incarnation(holder: dict) -> bool:
    """The holder is this Slurm job before its requeue (same job id, lower restart count)."""
    job, restart = _slurm_job()
    return (job is not None and holder.get("slurm_job_id") == job
            and int(holder.get("slurm_restart_count") or 0) < restart)


def _try_lock(fd: int, path: str) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        raise RunLockError(
            f"cannot lock {path}: {exc.strerror} (errno {errno.errorcode.get(exc.errno, exc.errno)}): its file "
            "system does not support flock, so two runs on this output_dir could not be kept apart. Put "
            "output_dir on a file system that does (local disk, NFS, Lustre mounted with -o flock)") from None


def acquire_run_lock(output_dir: str, requeue_wait_s: float = REQUEUE_WAIT_S) -> RunLock:
    """Take the exclusive lock of ``output_dir`` (created if missing) or raise ``RunLockError``
    naming the holder. A requeued Slurm job waits up to ``requeue_wait_s`` seconds for its own
    previous incarnation to let go; any other holder is refused at once."""
    path = os.path.join(os.path.abspath(output_dir), LOCK_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunLockError(f"cannot create the lock file {path}: {exc.strerror}; output_dir must be a writable "
                           "folder") from None
    try:
        deadline, warned = time.monotonic() + requeue_wait_s, False
        while not _try_lock(fd, path):
            holder = read_holder(path)
            if _is_previous_incarnation(holder) and time.monotonic() < deadline:
                if not warned:
                    log.warning("%s is still held by this Slurm job's previous run (%s); waiting up to %.0f s for "
                                "it to exit", path, _describe(holder, path), requeue_wait_s)
                    warned = True
                time.sleep(0.5)
                continue
            raise RunLockError(f"output_dir {output_dir} is in use by another run: {_describe(holder, path)} holds "
                               f"{path}. Wait for it to finish, stop it, or give this run another output_dir "
                               "(two runs in one directory would mix their checkpoints)")
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
    _HELD.add(fd)
    return RunLock(path, fd)
