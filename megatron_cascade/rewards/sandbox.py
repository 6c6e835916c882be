"""Process sandbox for running untrusted (model-written) programs.

Isolated mode (the only one the code reward uses unless its config allows the unsafe one):
each program runs under :mod:`._sandbox_init`, which gives it the layers below -- as root with a
uid of its own per program, or, for a trainer that is not root, inside an unprivileged **user
namespace** that maps one uid (the trainer's own; see "Without root" below):

* **a minimal root**: a tmpfs holding read-only bind mounts of the interpreter and the system
  libraries only (``/usr/lib``, ``/lib*``, the stdlib), five ``/dev`` nodes, a fresh ``/proc``,
  and its writable work dir and ``/tmp``; the host's file system is detached (``pivot_root``), so
  host data -- a reward's hidden tests, other programs' files, sockets -- does not exist for it;
* **fresh namespaces**: mount, network (only a downed loopback: no network, no abstract Unix
  sockets), IPC (SysV/POSIX objects die with it and host ones are invisible), UTS and PID (it
  sees only its own processes; it is the namespace's init, so all it started dies with it);
* **a fresh session keyring** and **a seccomp filter** (:mod:`._sandbox_seccomp`: keyctl, ptrace,
  mount, bpf, unshare/setns, perf, io_uring, ... fail with EPERM; no user namespaces);
* **its own uid**, leased per program from a per-rank range (``uid_base + LOCAL_RANK x
  uids_per_rank``), each uid checked to be absent from the user and group databases and held
  with a ``flock`` so that no two programs of the node -- any rank, any process -- share it;
  ``no_new_privs``;
* **limits on the whole tree**, cgroup-free: ``RLIMIT_NPROC`` = ``max_processes`` counts every
  process and thread of its uid, and ``RLIMIT_AS`` = ``memory_mb / max_processes`` per process,
  so the tree's total address space stays under ``memory_mb``; the work dir and ``/tmp`` share one
  tmpfs of ``max_disk_mb`` (plus ``RLIMIT_FSIZE`` per file), so the tree holds at most
  ``memory_mb + max_disk_mb`` of memory;
* **death with the trainer**: ``PR_SET_PDEATHSIG`` on the launcher, the namespace init and
  the program (re-armed after every uid change), each checking that its parent still lives;
  and a wall-clock timeout after which the whole tree is SIGKILLed.

As root it needs CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID and CAP_CHOWN on x86_64 or aarch64 Linux
(a privileged container).

Without root (a workstation, a login node) the launcher first unshares a user namespace, which owns
the other namespaces and maps exactly one uid and gid: the trainer's own. Everything above holds
the same way, except: the program runs as the trainer's uid (but sees no file, process, socket or
IPC object of the host: they are outside its root and its namespaces), with an empty capability
bounding set and no capability in the namespace once it is exec'd; ``RLIMIT_NPROC`` counts per
(user namespace, uid) (Linux >= 5.14), so it is ``max_processes`` + 1 for the launcher, which
waits in the namespace; and programs of one node are not told apart by uid (each has its own
namespaces, so they cannot see each other either). It needs unprivileged user namespaces, on by
default on most distributions (off where ``kernel.unprivileged_userns_clone=0`` or
``user.max_user_namespaces=0``; Ubuntu >= 23.10's AppArmor leaves such namespaces without
capabilities unless ``kernel.apparmor_restrict_unprivileged_userns=0``).

Where neither can be had, :class:`CodeSandbox` raises
:class:`SandboxUnavailableError` naming what is missing (fail closed) unless it was built with
``allow_unsafe=True`` (the code reward's ``allow_unsafe_sandbox``), which warns once and falls back
to the unsafe mode: rlimits, a scrubbed environment, a private work dir and, as root, the
per-program uid -- no file-system, network, IPC or keyring isolation.
"""

from __future__ import annotations

import functools
import json
import logging
import marshal
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_cascade.rewards import _sandbox_seccomp
from megatron_cascade.rewards.sandbox_processes import (
    _UIDS, _clean_env, _kill_tree, _read_capped, _rlimits, _seccomp_hex, _wait_exited, program_python,
)
from megatron_cascade.rewards.sandbox_types import Program, SandboxLimits, SandboxResult, SandboxUnavailableError

__all__ = ["CodeSandbox", "Program", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "isolation_kind",
           "isolation_problem", "program_python"]

logger = logging.getLogger(__name__)

_LAUNCHER_SOURCE_PATH = os.path.join(os.path.dirname(__file__), "_sandbox_init.py")
_SYSTEM_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32",
                        "/libx32")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Capabilities the launcher uses: namespaces/mounts, the uid and gid drop, the work dir's owner.
_NEEDED_CAPS = {"CAP_SYS_ADMIN": 21, "CAP_SETUID": 7, "CAP_SETGID": 6, "CAP_CHOWN": 0}


@functools.lru_cache(maxsize=1)
def _launcher_source() -> str:
    with open(_LAUNCHER_SOURCE_PATH, encoding="utf-8") as f:
        return f.read()


# -- what the isolated mode needs, and whether it works here ------------------------------------------------------


def _missing_capabilities() -> list[str]:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("CapEff:"))
    effective = int(line.split()[1], 16)
    return [name for name, bit in _NEEDED_CAPS.items() if not effective >> bit & 1]


@functools.lru_cache(maxsize=None)
def _interpreter_binds(python: str) -> tuple[tuple[str, str], ...]:
    """Host paths the programs' root gets read-only, as ``(path, "dir" | "file" | "symlink")``.

    The interpreter binary, its stdlib (and shared-library) folders, the linker cache and the
    system's shared libraries: of ``/usr/lib`` and ``/lib*`` only the multiarch folder where
    there is one (Debian/Ubuntu: ``/usr/lib/x86_64-linux-gnu``), else the whole folder (Fedora's
    ``/usr/lib64``); symlinks (merged ``/usr``) are recreated as symlinks.
    """
    query = ("import json, os, sys, sysconfig\n"
             "v = sysconfig.get_config_var\n"
             "paths = [sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib')]\n"
             "paths += [v('LIBDIR')] if v('Py_ENABLE_SHARED') else []\n"
             "print(json.dumps([os.path.realpath(sys.executable), [os.path.realpath(p) for p in paths if p],"
             " v('MULTIARCH') or '']))")
    out = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, text=True, timeout=60, check=True)
    executable, folders, multiarch = json.loads(out.stdout)
    binds: list[tuple[str, str]] = []
    for path in _SYSTEM_LIBRARY_DIRS:
        if os.path.islink(path):
            binds.append((path, "symlink"))
        elif multiarch and os.path.isdir(os.path.join(path, multiarch)):
            binds.append((os.path.join(path, multiarch), "dir"))
        elif os.path.isdir(path):
            binds.append((path, "dir"))
    dirs = [p for p, kind in binds if kind == "dir"]
    covered = lambda path: any(path == d or path.startswith(d + "/") for d in dirs)  # noqa: E731
    for folder in folders:
        if os.path.isdir(folder) and not covered(folder):
            binds.append((folder, "dir"))
            dirs.append(folder)
    for path in (executable, "/etc/ld.so.cache"):
        if os.path.isfile(path) and not covered(path):
            binds.append((path, "file"))
    return tuple(sorted(binds))


_PROBE = """import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({"ifs": [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]],
                  "uid": os.getuid(),
                  "caps": [int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd")],
                  "seccomp": status["Seccomp"].strip(), "nnp": status["NoNewPrivs"].strip(),
                  "root": sorted(os.listdir("/")), "cwd_writable": os.access(".", os.W_OK)}))
"""


def _probe_failure(result: SandboxResult, workdir_top: str) -> str | None:
    """Why the probe's view from inside is not the isolated one (None when it is)."""
    if not result.ok:
        return f"the isolation probe failed (exit {result.returncode}): {result.stderr.strip()[-500:]}"
    seen = json.loads(result.stdout)
    allowed_root = {os.path.basename(p) for p in _SYSTEM_LIBRARY_DIRS} | {"usr", "etc", "dev", "proc", "tmp",
                                                                          workdir_top}
    checks = {"network namespace (only lo)": seen["ifs"] == ["lo"], "own uid": seen["uid"] != 0,
              "empty capability sets": seen["caps"] == [0, 0, 0],
              "seccomp filter": seen["seccomp"] == "2", "no_new_privs": seen["nnp"] == "1",
              "minimal root": set(seen["root"]) <= allowed_root, "writable work dir": seen["cwd_writable"]}
    failed = [name for name, ok in checks.items() if not ok]
    return f"the isolation probe saw no {', '.join(failed)}: {seen}" if failed else None


_isolation_lock = threading.Lock()
_isolation_problems: dict[tuple[str, int, int, int], str | None] = {}


def isolation_problem(python: str, uid_base: int = 61000, uids_per_rank: int = 256) -> str | None:
    """What keeps the isolated mode from working here (None: it works); probed once per process
    and configuration.

    Checked: as root the capabilities the launcher uses, else that unprivileged user namespaces are
    on; a seccomp syscall table for this machine; then a real probe program through the whole
    launcher (as root under a uid of the given range), asked from inside what it sees.

    Raises:
        SandboxUnavailableError: the uid range holds a real user's or group's id.
    """
    key = (python, uid_base, uids_per_rank, os.geteuid())
    with _isolation_lock:
        if key not in _isolation_problems:
            _isolation_problems[key] = _find_isolation_problem(*key[:3])
            if _isolation_problems[key] is None:
                logger.info("code sandbox: isolated mode works (minimal root, namespaces, seccomp; %s)",
                            "own uids" if isolation_kind() == "root" else "in a user namespace")
        return _isolation_problems[key]


def isolation_kind() -> str:
    """How the isolated mode tells programs apart here: ``root`` (a uid per program) or ``user
    namespace`` (a trainer that is not root: one mapped uid, the trainer's own)."""
    return "root" if os.geteuid() == 0 else "user namespace"


def _user_namespace_problem() -> str | None:
    """Why this kernel refuses unprivileged user namespaces (None: nothing says it does)."""
    for path in ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces"):
        try:
            with open(path) as f:
                disabled = f.read().strip() == "0"
        except OSError:
            continue
        if disabled:
            return (f"the trainer does not run as root (euid {os.geteuid()}) and unprivileged user namespaces are "
                    f"off ({path} = 0)")
    return None


def _apparmor_hint() -> str:
    try:
        with open("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") as f:
            restricted = f.read().strip() == "1"
    except OSError:
        return ""
    return (" (AppArmor gives unprivileged user namespaces no capabilities here: "
            "kernel.apparmor_restrict_unprivileged_userns=1)") if restricted else ""


def _find_isolation_problem(python: str, uid_base: int, uids_per_rank: int) -> str | None:
    if os.geteuid() != 0:
        problem = _user_namespace_problem()
        if problem is not None:
            return problem
    else:
        missing = _missing_capabilities()
        if missing:
            return f"the trainer lacks {', '.join(missing)} (Docker drops CAP_SYS_ADMIN by default)"
    if platform.machine() not in _sandbox_seccomp.supported_machines():
        return (f"no seccomp syscall table for this machine ({platform.machine()}; supported: "
                f"{', '.join(_sandbox_seccomp.supported_machines())})")
    box = CodeSandbox(python=python, uid_base=uid_base, uids_per_rank=uids_per_rank, _backend="isolated")
    try:
        result = box.run(Program(_PROBE), SandboxLimits(timeout_s=30))
    except (OSError, subprocess.SubprocessError) as e:
        return f"the isolation probe could not start: {e}"
    problem = _probe_failure(result, tempfile.gettempdir().strip("/").split("/")[0])
    if problem is not None and os.geteuid() != 0:
        problem = f"the trainer does not run as root and its user-namespace sandbox failed: {problem}{_apparmor_hint()}"
    return problem


def _refusal(problem: str) -> str:
    return (f"code sandbox unavailable: {problem}. Isolation needs x86_64/aarch64 Linux and either, as a normal "
            "user, unprivileged user namespaces (on by default on most distributions), or root with CAP_SYS_ADMIN, "
            "CAP_SETUID, CAP_SETGID and CAP_CHOWN, with unshare and mount allowed (a privileged container, or docker "
            "run --cap-add SYS_ADMIN --security-opt seccomp=unconfined). Refusing to run "
            "model-written programs without it. To run them unisolated anyway (trusted data only), set the code "
            "reward's `kwargs: {allow_unsafe_sandbox: true}`.")


_unsafe_lock = threading.Lock()
_unsafe_warned = False


def _warn_unsafe_once(problem: str) -> None:
    global _unsafe_warned
    with _unsafe_lock:
        if _unsafe_warned:
            return
        _unsafe_warned = True
        logger.warning("code sandbox: UNSAFE mode (allow_unsafe_sandbox) because %s. Model-written programs run "
                       "with rlimits only: they can read the host's files (including reward test data), reach "
                       "the network and IPC, and may outlive the trainer.", problem)


@dataclass
class CodeSandbox:
    """Runs Python programs in isolation; see the module docstring for the layers.

    Args:
        python: interpreter used for the programs (default: ``program_python()``).
        uid_base: first uid of rank 0's range; rank ``r`` (``LOCAL_RANK``) uses
            ``uid_base + r * uids_per_rank`` ... ``+ uids_per_rank - 1``. None of them may be in
            the user or group database.
        uids_per_rank: uids per rank = programs of one rank running at once (more wait).
        max_workers: pool size of :meth:`run_many` (default ``os.cpu_count()``).
        allow_unsafe: where isolation cannot be had, run with rlimits only (warned once)
            instead of raising :class:`SandboxUnavailableError`.
    """

    python: str = field(default_factory=program_python)
    uid_base: int = 61000
    uids_per_rank: int = 256
    max_workers: int | None = None
    allow_unsafe: bool = False
    _backend: str | None = None  # "isolated" or "unsafe": skips the probe (tests, the probe itself)

    def __post_init__(self) -> None:
        for name in ("uid_base", "uids_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "uids_per_rank" else 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'uids_per_rank' else 'non-negative'} "
                                 f"integer, got {value!r}")

    @property
    def backend(self) -> str:
        """``isolated``, or ``unsafe`` where allowed and isolation cannot be had (may raise
        :class:`SandboxUnavailableError`)."""
        return self.resolve_backend()

    def require_isolation(self) -> None:
        """Raise :class:`SandboxUnavailableError` (what is missing) unless the isolated mode works."""
        problem = isolation_problem(self.python, self.uid_base, self.uids_per_rank)
        if problem is not None:
            raise SandboxUnavailableError(_refusal(problem))

    def resolve_backend(self) -> str:
        """The mode programs will run in (probed once per process): ``isolated``, or ``unsafe``
        (warned once) where isolation cannot be had and ``allow_unsafe`` is set.

        Raises:
            SandboxUnavailableError: isolation cannot be had and ``allow_unsafe`` is off.
        """
        if self._backend is not None:
            return self._backend
        problem = isolation_problem(self.python, self.uid_base, self.uids_per_rank)
        if problem is None:
            return "isolated"
        if not self.allow_unsafe:
            raise SandboxUnavailableError(_refusal(problem))
        _warn_unsafe_once(problem)
        return "unsafe"

    def run(self, program: Program, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
        """Run one program; never raises for anything the program does (raises
        :class:`SandboxUnavailableError` when it may not run at all)."""
        backend = self.resolve_backend()
        lease = _UIDS.acquire(self.uid_base, self.uids_per_rank) if os.geteuid() == 0 else None
        root = tempfile.mkdtemp(prefix="mc-sandbox-")
        try:
            return self._run_in(root, program, limits, backend == "isolated", lease[0] if lease else None)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if lease is not None:
                _UIDS.release(*lease)

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
        self.resolve_backend()  # probe once (and refuse, if so) before the threads race for it
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

    def _run_in(self, root: str, program: Program, limits: SandboxLimits, isolate: bool,
                uid: int | None) -> SandboxResult:
        # root (0700, ours): src/ and io/ stay out of the program's reach; the work dir is built
        # inside the sandbox's own root (isolated) or here, owned by the program's uid (unsafe).
        workdir, srcdir, iodir = (os.path.join(root, name) for name in ("work", "src", "io"))
        os.mkdir(srcdir, 0o700)
        os.mkdir(iodir, 0o700)
        source = os.path.join(srcdir if isolate else workdir, "main.py")
        if isolate:
            os.mkdir(os.path.join(root, "newroot"), 0o700)
        else:
            os.mkdir(workdir, 0o700)
            os.chmod(root, 0o711)  # traversable, not listable, for the program's uid
            if uid is not None:
                os.chown(workdir, uid, uid)
        with open(source, "w", encoding="utf-8") as f:
            f.write(program.source)
        with open(os.path.join(iodir, "stdin"), "w", encoding="utf-8") as f:
            f.write(program.stdin)
        cfg = self._launcher_config(root, workdir, source, limits, isolate, uid)
        argv = [self.python, "-I", "-S", "-B", "-c", _launcher_source(), marshal.dumps(cfg, 2).hex()]
        return self._spawn(argv, iodir, root, limits, isolate, uid)

    def _launcher_config(self, root: str, workdir: str, source: str, limits: SandboxLimits, isolate: bool,
                         uid: int | None) -> dict:
        python = os.path.realpath(self.python)
        userns = isolate and uid is None  # isolated without root (``run`` leases a uid as root)
        cfg = {
            "parent_pid": os.getpid(),
            "isolate": isolate,
            "userns": userns,
            "uid": -1 if uid is None else uid,
            "gid": -1 if uid is None else uid,
            # Counted per uid (per user namespace and uid: the launcher there counts too); without
            # either, the trainer's own processes would count.
            "rlimits": _rlimits(limits, nproc=limits.max_processes + userns if uid is not None or userns else None),
            "argv": [python, "-I", "-B", os.path.join(workdir, "main.py")],
            "env": _clean_env(workdir),
            "workdir": workdir,
            "source": source,
            "seccomp": "",
        }
        if isolate:
            cfg.update(root=os.path.join(root, "newroot"), binds=_interpreter_binds(python),
                       devices=[d for d in _DEVICES if os.path.exists(d)], disk_bytes=limits.max_disk_mb << 20,
                       inodes=4096, seccomp=_seccomp_hex())
        return cfg

    def _spawn(self, argv: list[str], iodir: str, cwd: str, limits: SandboxLimits, isolate: bool,
               uid: int | None) -> SandboxResult:
        out_path, err_path = os.path.join(iodir, "stdout"), os.path.join(iodir, "stderr")
        start = time.monotonic()
        with open(os.path.join(iodir, "stdin"), "rb") as fin, \
                open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            # start_new_session: setsid, so killpg reaches everything that did not itself
            # call setsid; the namespace init handles the rest.
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd,
                                    env=_clean_env(cwd), start_new_session=True, close_fds=True)
        timed_out = not _wait_exited(proc.pid, limits.timeout_s)
        if timed_out or not isolate:
            # After a normal exit from a PID namespace the kernel has already killed
            # everything; otherwise hunt the tree down (and same-uid strays without one).
            _kill_tree(proc, isolate, None if isolate else uid)
        proc.wait()
        wall = time.monotonic() - start
        rc = proc.returncode
        return SandboxResult(None if timed_out else rc,
                             _read_capped(out_path, limits.max_output_bytes),
                             _read_capped(err_path, limits.max_output_bytes), timed_out, wall)
