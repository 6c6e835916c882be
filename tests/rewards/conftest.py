"""Shared fixtures for reward tests: sandbox instance, the sandbox's trainer side as root and as a
normal user, and a leftover-process check."""

from __future__ import annotations

import grp
import multiprocessing
import os
import pwd
import shutil
import signal
import tempfile
import uuid
from typing import Any, Callable

import psutil
import pytest

from megatron_cascade.rewards import build_reward
from megatron_cascade.rewards.sandbox import (CodeSandbox, Program, SandboxLimits, SandboxResult,
                                              SandboxUnavailableError, program_python)


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture(name="processes_with")
def processes_with_fixture():
    """The :func:`processes_with` helper (test modules cannot import conftest)."""
    return processes_with


@pytest.fixture(scope="session")
def sandbox() -> CodeSandbox:
    return CodeSandbox()


@pytest.fixture
def marker() -> str:
    """A unique string embedded in attack programs' command lines."""
    return f"mcmarker{uuid.uuid4().hex}"


@pytest.fixture
def no_leftovers():
    """After the test: no process of this test's sandbox runs is alive. The test's sandboxes make
    their folders (mc-sandbox-*, named on their command lines) in a private temporary folder, so the
    check sees (and kills) only theirs, never another run's on the machine."""
    before, folder = tempfile.tempdir, tempfile.mkdtemp(prefix="mc-reward-test-")
    os.chmod(folder, 0o1733)  # as /tmp, not listable: the non-root trainer makes its folders here too
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = before
    leftovers = processes_with(os.path.join(folder, "mc-sandbox-"))
    for p in leftovers:  # clean up before failing, so one failure does not cascade
        try:
            p.kill()
        except psutil.Error:
            pass
    shutil.rmtree(folder, ignore_errors=True)
    assert not leftovers, [p.info for p in leftovers]


# -- the sandbox's trainer side, as root and as a normal user -------------------------------------------------------


def score_program(program: str, expected: str, kwargs: dict) -> float:
    """Code-reward score of ``program`` when only printing ``expected`` passes."""
    reward = build_reward("code", kwargs)
    return reward(f"```python\n{program}\n```", {"tests": [{"input": "", "output": expected}]})


def _free_uid(start: int = 59000) -> int:
    """A uid (and gid) that no account or group has: the non-root trainer's."""
    for uid in range(start, start + 1000):
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free uid for the non-root trainer")


class SandboxTrainer:
    """What scores model-written programs: this test process (``this``), or (``user``) a forked copy
    of it (root) that dropped root for a uid of its own -- a normal user's trainer, whose sandbox is
    the user-namespace one. Calls run in the trainer with this process's current temporary folder
    and environment (so ``no_leftovers`` and ``monkeypatch.setenv`` reach it)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.uid = os.geteuid() if kind == "this" else _free_uid()
        self._conn = self._proc = None
        if kind == "user":
            python = program_python()  # one a normal user may run (this one may sit under /root)
            ctx = multiprocessing.get_context("fork")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve_as_user, args=(child, self.uid, python), daemon=True)
            self._proc.start()
            child.close()

    @property
    def pid(self) -> int:
        return os.getpid() if self._proc is None else self._proc.pid

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the trainer (a module-level function: it is pickled by name)."""
        if self._conn is None:
            return fn(*args)
        _send(self._conn, fn, tempfile.gettempdir(), dict(os.environ), args)
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def call_in_child(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a throwaway fork of the trainer (for changes to the process itself,
        e.g. its session keyring)."""
        return self.call(run_in_fork, fn, *args)

    def run(self, program: Program, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
        return self.call(_run_program, program, limits)

    def score(self, program: str, expected: str, **kwargs: Any) -> float:
        return self.call(score_program, program, expected, kwargs)

    def own(self, path: str) -> str:
        """Give ``path`` to the trainer's uid (its own files are what its programs must not reach)."""
        os.chown(path, self.uid, self.uid)
        return path

    def kill(self) -> None:
        """SIGKILL the trainer (a ``user`` one: the other is this process)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(10)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            _send(self._conn, None)
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


def _send(conn, fn: Callable[..., Any] | None, *payload: Any) -> None:
    """This file's functions travel by name (every ``conftest.py`` is a module called ``conftest``,
    so pickle's lookup by module name would find another); others (test modules') by pickle."""
    here = getattr(getattr(fn, "__code__", None), "co_filename", None) == __file__
    conn.send(None if fn is None else (*payload, fn.__name__ if here else fn))


def run_in_fork(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child of this process; its result (or exception) comes back."""
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    pid = os.fork()  # not a multiprocessing.Process: the normal-user trainer is a daemonic one
    if pid == 0:
        try:
            here.close()
            _answer(there, fn, args)
        finally:
            os._exit(0)
    there.close()
    try:
        ok, value = here.recv()
    finally:
        os.waitpid(pid, 0)
    if not ok:
        raise value
    return value


def _answer(conn, fn: Callable[..., Any], args: tuple) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 -- handed to the caller
        conn.send((False, exc))


def _run_program(program: Program, limits: SandboxLimits) -> SandboxResult:
    return CodeSandbox().run(program, limits)


def _serve_as_user(conn, uid: int, python: str) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    import megatron_cascade.rewards.sandbox as sandbox

    sandbox.program_python = lambda: python  # noqa: the fork's own interpreter sits behind /root
    while True:
        request = conn.recv()
        if request is None:
            return
        tempdir, environ, args, fn = request
        fn = globals()[fn] if isinstance(fn, str) else fn
        tempfile.tempdir = tempdir
        os.environ.clear()
        os.environ.update(environ)
        _answer(conn, fn, args)


def start_trainer(kind: str) -> SandboxTrainer:
    """A trainer of ``kind`` whose isolated sandbox works here (else the test skips)."""
    trainer = SandboxTrainer(kind)
    try:
        trainer.call(_require_isolation)
    except SandboxUnavailableError as e:
        trainer.close()
        pytest.skip(f"isolated sandbox unavailable here for a {kind} trainer: {e}")
    return trainer


def _require_isolation() -> None:
    CodeSandbox().require_isolation()


@pytest.fixture(name="new_trainer")
def new_trainer_fixture():
    """:class:`SandboxTrainer` (test modules cannot import conftest)."""
    return SandboxTrainer


@pytest.fixture(scope="session", params=["this", "user"], ids=["trainer-as-test-process", "trainer-as-normal-user"])
def trainer(request) -> SandboxTrainer:
    """The trainer side: this process (root in CI: a uid per program) and a normal user's (a user
    namespace; made by dropping root, so only where this process is root)."""
    if request.param == "user" and os.geteuid() != 0:
        pytest.skip("the normal-user trainer is a fork of a root test process (this one is not root: "
                    "the test-process trainer is the normal user's)")
    started = start_trainer(request.param)
    yield started
    started.close()
