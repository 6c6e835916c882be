"""The processes a sandboxed program runs as (``rewards/sandbox.py``): its uid, leased per program from
its rank's range; the interpreter; its rlimits, environment and seccomp filter; and the killing of its
whole tree."""

from __future__ import annotations

import fcntl
import functools
import grp
import logging
import os
import platform
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from megatron_cascade.rewards import _sandbox_seccomp
from megatron_cascade.rewards.sandbox_types import SandboxLimits, SandboxUnavailableError

logger = logging.getLogger("megatron_cascade.rewards.sandbox")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_REAP_TIMEOUT_S = 5.0  # how long to wait for a SIGKILLed tree to be reaped
_UID_WAIT_S = 600.0  # how long a program waits for a free uid of its rank's range


def _local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    try:
        rank = int(raw)
    except ValueError:
        raise SandboxUnavailableError(f"LOCAL_RANK={raw!r} is not an integer: cannot pick this rank's sandbox "
                                      "uid range") from None
    if rank < 0:
        raise SandboxUnavailableError(f"LOCAL_RANK={rank} is negative: cannot pick this rank's sandbox uid range")
    return rank


@functools.lru_cache(maxsize=1)
def _lock_dir() -> str:
    """A root-only folder for the uid lease files (shared by every process of the node)."""
    base = "/run" if os.path.isdir("/run") and os.access("/run", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, "megatron-cascade-sandbox-uids")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxUnavailableError(f"{path} (the sandbox's uid lease folder) must be a folder owned by uid "
                                      f"{os.geteuid()} with mode 0700; remove it and retry")
    return path


class _UidLeases:
    """Leases uids of this rank's range, one program per uid across every process of the node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._checked: set[int] = set()

    def acquire(self, uid_base: int, uids_per_rank: int) -> tuple[int, int]:
        """A free uid of the range ``uid_base + LOCAL_RANK * uids_per_rank ...`` and its lock's fd;
        waits while all of them are busy."""
        rank = _local_rank()
        first = uid_base + rank * uids_per_rank
        deadline = time.monotonic() + _UID_WAIT_S
        while True:
            for uid in range(first, first + uids_per_rank):
                with self._lock:
                    if uid in self._held:
                        continue
                    self._held.add(uid)
                fd = self._try_lock(uid, uid_base, rank, uids_per_rank)
                if fd is not None:
                    return uid, fd
                with self._lock:
                    self._held.discard(uid)
            if time.monotonic() > deadline:
                raise SandboxUnavailableError(f"no free sandbox uid in {first}..{first + uids_per_rank - 1} for "
                                              f"{_UID_WAIT_S:.0f} s: raise uids_per_rank")
            time.sleep(0.005)

    def release(self, uid: int, fd: int) -> None:
        os.close(fd)  # drops the flock
        with self._lock:
            self._held.discard(uid)

    def _try_lock(self, uid: int, uid_base: int, rank: int, uids_per_rank: int) -> int | None:
        if uid not in self._checked:
            try:
                _check_unused_uid(uid, uid_base, rank, uids_per_rank)
            except SandboxUnavailableError:
                with self._lock:
                    self._held.discard(uid)
                raise
            self._checked.add(uid)
        fd = os.open(os.path.join(_lock_dir(), str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            return None


def _check_unused_uid(uid: int, uid_base: int, rank: int, uids_per_rank: int) -> None:
    """Refuse a uid (or equal gid) that the user or group database knows: a real account's files
    and processes would be the program's."""
    where = (f"sandbox uid {uid} (uid_base {uid_base} + LOCAL_RANK {rank} x uids_per_rank {uids_per_rank} + "
             "slot)")
    for db, lookup in (("user", lambda: pwd.getpwuid(uid).pw_name), ("group", lambda: grp.getgrgid(uid).gr_name)):
        try:
            name = lookup()
        except KeyError:
            continue
        raise SandboxUnavailableError(f"{where} is {db} {name!r} in the {db} database: set the code reward's "
                                      "kwargs.uid_base to a free range")
    if uid >= 2**32 - 2:
        raise SandboxUnavailableError(f"{where} is past the largest uid: lower kwargs.uid_base")


_UIDS = _UidLeases()


def _kill_tree(proc: subprocess.Popen, isolate: bool, uid: int | None) -> None:
    """SIGKILL the program's whole tree and wait until it is gone.

    Isolated: the namespace init (the program) and its tree are killed and the launcher is left
    alive to reap it: the kernel only lets the init finish exiting once every other process of
    its PID namespace is dead, so the launcher exiting means the namespace is empty. Unsafe: the
    launcher *is* the program (it exec'd), so its session group goes first. Then the session
    group is killed (a stuck launcher) and, for a dedicated uid, any process still running as it.
    """
    if not isolate:
        _quiet_killpg(proc.pid)
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        victims = []
    for child in victims:
        _quiet_kill(child.pid)
    if not _wait_exited(proc.pid, _REAP_TIMEOUT_S):
        logger.warning("code sandbox: pid %d did not exit %.0f s after SIGKILL of its tree",
                       proc.pid, _REAP_TIMEOUT_S)
    _quiet_killpg(proc.pid)
    if uid is not None:
        _kill_uid(uid)


def _wait_exited(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for child ``pid`` to exit, *without* reaping it.

    Keeping the zombie keeps its pid (= our session/process-group id) from being reused,
    so a later ``killpg`` cannot hit an unrelated process group. A pidfd (Linux >= 5.3) wakes us
    the moment it exits; without one, we poll (sleeps of up to 20 ms: ~10 ms lost per program).
    """
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return _poll_exited(pid, timeout_s)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not _exited(pid):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(max(1, int(remaining * 1000) + 1))
        return True
    finally:
        os.close(pidfd)


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None


def _poll_exited(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not _exited(pid):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)  # short first sleeps: most programs end in ~50 ms
    return True


def _quiet_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _quiet_killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_uid(uid: int) -> None:
    # Dedicated sandbox uids are owned by exactly one pool slot at a time, so anything
    # still running as that uid after the run is a leftover (e.g. an escaped daemon).
    for p in psutil.process_iter(["uids"]):
        uids = p.info.get("uids")
        if uids is not None and uid in (uids.real, uids.effective):
            _quiet_kill(p.pid)


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _runnable_by_anyone(path: str) -> bool:
    """Whether an unprivileged uid can exec ``path``: every folder on the way o+x, the file o+rx."""
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        return False
    folders = []
    head = os.path.dirname(real)
    while head and head != os.path.dirname(head):
        folders.append(head)
        head = os.path.dirname(head)
    try:
        if any(not os.stat(d).st_mode & stat.S_IXOTH for d in folders):
            return False
        mode = os.stat(real).st_mode
    except OSError:  # a folder on the way we may not search
        return False
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


def program_python() -> str:
    """The interpreter for sandboxed programs.

    As root the programs run under an unprivileged uid, which cannot exec an interpreter behind a
    private folder (e.g. a pyenv build under /root, which a virtualenv links to): then the
    system's python3 is used (programs need only the standard library).
    """
    if os.geteuid() != 0 and os.access(sys.executable, os.X_OK):
        return sys.executable  # the programs run as our own uid
    if _runnable_by_anyone(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and _runnable_by_anyone(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"no Python interpreter that an unprivileged user can run (checked {sys.executable} and "
                       "python3 on PATH): install the system python3 package for the code sandbox")



@functools.lru_cache(maxsize=1)
def _seccomp_hex() -> str:
    return _sandbox_seccomp.build_filter(platform.machine()).hex()


def _rlimits(limits: SandboxLimits, nproc: int | None) -> dict[str, int]:
    mib = 1 << 20
    out = {
        "RLIMIT_CPU": int(limits.timeout_s) + 1,
        "RLIMIT_AS": limits.process_memory_bytes,
        "RLIMIT_FSIZE": limits.max_file_mb * mib,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_CORE": 0,
    }
    if nproc is not None:
        out["RLIMIT_NPROC"] = nproc
    return out


def _clean_env(workdir: str) -> dict[str, str]:
    """A fresh environment: nothing of the parent's (tokens, keys) leaks into programs."""
    return {
        "PATH": _SAFE_PATH,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One malloc arena: a thread's own arena reserves 64 MiB of address space, which
        # RLIMIT_AS (the per-process share of memory_mb) would count as used.
        "MALLOC_ARENA_MAX": "1",
    }
