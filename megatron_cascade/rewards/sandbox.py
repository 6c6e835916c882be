"""Process sandbox for running untrusted (model-written) programs.

Isolation layers, strongest available first (detected once, on first use, and logged):

``namespaces`` (needs ``unshare`` from util-linux, present on every Debian/Ubuntu, and
root or unprivileged user namespaces):
    ``unshare --net --pid --fork --kill-child --mount --mount-proc`` starts a small
    launcher (:mod:`._sandbox_init`) that remounts every mount read-only inside the
    private mount namespace except the program's private work dir, applies rlimits,
    drops to an unprivileged uid, sets ``no_new_privs`` and execs the program.
    Consequences: no network at all (fresh net namespace, only a downed loopback), the
    program only sees its own processes (``/proc`` of the new PID namespace; it cannot
    signal the parent or the trainer), every process it spawns -- including double-forked
    ``setsid`` daemons -- is SIGKILLed by the kernel when the namespace's init (the
    program) dies, and nothing outside the work dir is writable, not even world-writable
    ``/tmp`` or ``/dev/shm``.
    As root the program runs as a dedicated uid per pool slot (``uid_base + slot``, no
    passwd entry needed) so that ``RLIMIT_NPROC`` (counted per uid) caps a fork bomb
    without starving the other programs running in parallel. Without root, a user
    namespace (``--user --map-root-user``) is used instead and the uid is not changed.

``rlimits`` fallback (a WARNING is logged once), used when no namespace can be created:
    new session (``setsid``), rlimits, privilege drop if we are root, private work dir as
    cwd/HOME/TMPDIR, scrubbed environment, kill of the process group on timeout plus a
    psutil scan for escaped descendants (same uid). Not protected: network access, writes
    to world-writable directories, and a daemon that escapes the process group *and* is
    re-parented before the scan may survive. Do not use this mode for untrusted code in
    production: install util-linux (``unshare``) or run as root.

Bubblewrap (``bwrap``) is not required: ``unshare`` + the launcher provide the same
guarantees and util-linux is part of the base system.

Always applied: ``RLIMIT_CPU`` (timeout + 1 s), ``RLIMIT_AS`` (memory), ``RLIMIT_NPROC``
(only when a dedicated uid is used; per-uid counting would otherwise include the caller's
own processes), ``RLIMIT_FSIZE`` (also caps stdout/stderr, which go to files),
``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0; and a wall-clock timeout after which the whole
process tree is SIGKILLed (session process group + the namespace init).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import psutil

logger = logging.getLogger(__name__)

_LAUNCHER_SOURCE_PATH = os.path.join(os.path.dirname(__file__), "_sandbox_init.py")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_REAP_TIMEOUT_S = 5.0  # how long to wait for a SIGKILLed tree to be reaped


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one program.

    Attributes:
        timeout_s: wall-clock limit in seconds; the process tree is killed after it.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        max_processes: ``RLIMIT_NPROC`` (processes/threads of the sandbox uid).
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``) in MiB; also
            caps its stdout and stderr.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: bytes of stdout/stderr read back.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20


@dataclass(frozen=True)
class Program:
    """A program to run: Python ``source`` fed ``stdin`` (text)."""

    source: str
    stdin: str = ""


@dataclass
class SandboxResult:
    """Outcome of one run. ``wall_s`` is seconds from spawn to reap."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    skipped: bool = False

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 before the timeout."""
        return self.returncode == 0 and not self.timed_out and not self.skipped


@dataclass(frozen=True)
class _Backend:
    name: str  # "namespaces" or "rlimits"
    prefix: tuple[str, ...] = ()
    drop_uid: bool = False
    remount_ro: bool = False


@functools.lru_cache(maxsize=1)
def _launcher_source() -> str:
    with open(_LAUNCHER_SOURCE_PATH, encoding="utf-8") as f:
        return f.read()


def _is_root() -> bool:
    return os.geteuid() == 0


def _unshare_prefix(unshare: str, user_ns: bool) -> tuple[str, ...]:
    user = ("--user", "--map-root-user") if user_ns else ()
    return (unshare, *user, "--net", "--pid", "--fork", "--kill-child", "--mount",
            "--mount-proc", "--")


def _candidate_backends() -> list[_Backend]:
    candidates = []
    unshare = shutil.which("unshare", path=os.environ.get("PATH", "") + ":" + _SAFE_PATH)
    if unshare:
        root = _is_root()
        candidates.append(_Backend("namespaces", _unshare_prefix(unshare, not root),
                                   drop_uid=root, remount_ro=True))
    candidates.append(_Backend("rlimits", (), drop_uid=_is_root(), remount_ro=False))
    return candidates


_backend_lock = threading.Lock()
_backend: _Backend | None = None


def detect_backend(python: str | None = None) -> str:
    """Probe (once per process) the strongest working isolation; returns its name.

    Each candidate is tried with a real trivial program. The result is logged at INFO,
    or at WARNING when only the ``rlimits`` fallback works.
    """
    return _get_backend(python or program_python()).name


def _get_backend(python: str) -> _Backend:
    global _backend
    with _backend_lock:
        if _backend is None:
            _backend = _probe_backends(python)
        return _backend


def _probe_backends(python: str) -> _Backend:
    for backend in _candidate_backends():
        if backend.name == "rlimits":
            logger.warning(
                "code sandbox: no namespace isolation available (unshare missing or not "
                "permitted); using rlimits-only fallback: NO network isolation and no "
                "read-only file system. Install util-linux / run as root for full isolation.")
            return backend
        box = CodeSandbox(python=python, _backend=backend)
        # Isolated = the program sees no network interface but loopback (its own namespace's).
        # Asked of the kernel, not by sending traffic anywhere.
        probe = "import socket\nnames = [n for _, n in socket.if_nameindex()]\n" \
                "print('isolated' if names == ['lo'] else names)\n"
        res = box.run(Program(probe), SandboxLimits(timeout_s=10))
        if res.ok and res.stdout.strip() == "isolated":
            logger.info("code sandbox: using %s backend (%s)", backend.name,
                        " ".join(backend.prefix[:-1]))
            return backend
        logger.info("code sandbox: backend %s unusable (rc=%s): %s", backend.name,
                    res.returncode, res.stderr.strip()[-300:])
    raise AssertionError("unreachable: rlimits backend is always a candidate")


def _rlimits(limits: SandboxLimits, cap_nproc: bool) -> dict[str, int]:
    mib = 1 << 20
    out = {
        "RLIMIT_CPU": int(limits.timeout_s) + 1,
        "RLIMIT_AS": limits.memory_mb * mib,
        "RLIMIT_FSIZE": limits.max_file_mb * mib,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_CORE": 0,
    }
    if cap_nproc:
        out["RLIMIT_NPROC"] = limits.max_processes
    return out


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the program's whole tree and wait until it is gone.

    The namespace init (the program) is killed first and ``unshare`` is left alive to
    reap it: the kernel only lets the init finish exiting once every other process of its
    PID namespace is dead, so ``unshare`` exiting means the namespace is empty. Then the
    session group is killed (covers the rlimits backend and a stuck ``unshare``) and, for
    a dedicated uid, any process still running as that uid.
    """
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
    so a later ``killpg`` cannot hit an unrelated process group.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)  # short first sleeps: most programs end in ~50 ms


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


class _SlotPool:
    """Hands out pool-slot indices so concurrent programs get distinct uids."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


_SLOTS = _SlotPool()


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
    if any(not os.stat(d).st_mode & stat.S_IXOTH for d in folders):
        return False
    mode = os.stat(real).st_mode
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


def program_python() -> str:
    """The interpreter for sandboxed programs.

    As root the programs run under an unprivileged uid, which cannot exec an interpreter behind a
    private folder (e.g. a pyenv build under /root, which a virtualenv links to): then the
    system's python3 is used (programs need only the standard library).
    """
    if os.geteuid() != 0 or _runnable_by_anyone(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and _runnable_by_anyone(candidate):
            return candidate
    raise RuntimeError(f"no Python interpreter that an unprivileged user can run (checked {sys.executable} and "
                       "python3 on PATH): install the system python3 package for the code sandbox")


@dataclass
class CodeSandbox:
    """Runs Python programs in isolation; see the module docstring for the layers.

    Args:
        python: interpreter used for the programs (default: ``program_python()``).
        uid_base: first uid used for programs when running as root (slot i -> base + i).
        max_workers: pool size of :meth:`run_many` (default ``os.cpu_count()``).
    """

    python: str = field(default_factory=program_python)
    uid_base: int = 61000
    max_workers: int | None = None
    _backend: _Backend | None = None

    @property
    def backend(self) -> str:
        """Name of the isolation backend in use (``namespaces`` or ``rlimits``)."""
        return self._resolve_backend().name

    def _resolve_backend(self) -> _Backend:
        return self._backend or _get_backend(self.python)

    def run(self, program: Program, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
        """Run one program; never raises for anything the program does."""
        backend = self._resolve_backend()
        slot = _SLOTS.acquire()
        uid = self.uid_base + slot if backend.drop_uid else None
        root = tempfile.mkdtemp(prefix="mc-sandbox-")
        try:
            return self._run_in(root, program, limits, backend, uid)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            _SLOTS.release(slot)

    def run_many(self, programs: Sequence[Program], limits: SandboxLimits = SandboxLimits(),
                 should_run: Callable[[int], bool] | None = None,
                 on_result: Callable[[int, SandboxResult], None] | None = None
                 ) -> list[SandboxResult]:
        """Run programs in parallel on a pool of ``max_workers`` threads (one subprocess each).

        ``should_run(i)`` is consulted right before program ``i`` starts; returning False
        skips it (``SandboxResult.skipped``), e.g. once a sibling test already failed.
        ``on_result(i, result)`` is called from the worker thread as soon as program ``i``
        finished. Results are in input order.
        """
        self._resolve_backend()  # probe once, before the threads race for it
        workers = self.max_workers or os.cpu_count() or 1

        def job(i: int) -> SandboxResult:
            if should_run is not None and not should_run(i):
                result = SandboxResult(None, "", "", False, 0.0, skipped=True)
            else:
                result = self.run(programs[i], limits)
            if on_result is not None:
                on_result(i, result)
            return result

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(job, range(len(programs))))

    def _run_in(self, root: str, program: Program, limits: SandboxLimits, backend: _Backend,
                uid: int | None) -> SandboxResult:
        workdir, iodir = os.path.join(root, "work"), os.path.join(root, "io")
        os.mkdir(workdir, 0o700)
        os.mkdir(iodir, 0o700)  # stays root-only: the program cannot touch its io files
        os.chmod(root, 0o711)  # traversable, not listable, for the sandbox uid
        if uid is not None:
            os.chown(workdir, uid, uid)
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(program.source)
        with open(os.path.join(iodir, "stdin"), "w", encoding="utf-8") as f:
            f.write(program.stdin)
        argv = self._argv(backend, workdir, uid, limits)
        return self._spawn(argv, iodir, workdir, limits, backend, uid)

    def _argv(self, backend: _Backend, workdir: str, uid: int | None,
              limits: SandboxLimits) -> list[str]:
        cfg = {
            "workdir": workdir,
            "uid": -1 if uid is None else uid,
            "gid": -1 if uid is None else uid,
            "rlimits": _rlimits(limits, cap_nproc=uid is not None),
            "argv": [self.python, "-I", "-B", os.path.join(workdir, "main.py")],
            "env": _clean_env(workdir),
            "remount_ro": backend.remount_ro,
            "pdeathsig": True,
        }
        launcher = [self.python, "-I", "-S", "-B", "-c", _launcher_source(), json.dumps(cfg)]
        return [*backend.prefix, *launcher]

    def _spawn(self, argv: list[str], iodir: str, workdir: str, limits: SandboxLimits,
               backend: _Backend, uid: int | None) -> SandboxResult:
        out_path, err_path = os.path.join(iodir, "stdout"), os.path.join(iodir, "stderr")
        start = time.monotonic()
        with open(os.path.join(iodir, "stdin"), "rb") as fin, \
                open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            # start_new_session: setsid, so killpg reaches everything that did not itself
            # call setsid; the namespace init handles the rest.
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=workdir,
                                    env=_clean_env(workdir), start_new_session=True,
                                    close_fds=True)
        timed_out = not _wait_exited(proc.pid, limits.timeout_s)
        if timed_out or backend.name == "rlimits":
            # After a normal exit from a PID namespace the kernel has already killed
            # everything; otherwise hunt the tree down (and same-uid strays without one).
            _kill_tree(proc, uid if backend.name == "rlimits" else None)
        proc.wait()
        wall = time.monotonic() - start
        rc = proc.returncode
        return SandboxResult(None if timed_out else rc,
                             _read_capped(out_path, limits.max_output_bytes),
                             _read_capped(err_path, limits.max_output_bytes), timed_out, wall)


def _clean_env(workdir: str) -> dict[str, str]:
    """A fresh environment: nothing of the parent's (tokens, keys) leaks into programs."""
    return {
        "PATH": _SAFE_PATH,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
