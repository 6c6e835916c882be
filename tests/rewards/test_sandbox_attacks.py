"""The sandbox under attack: every attack scores 0, ends in time, leaves the host intact -- for a
trainer that runs as root (a uid per program) and for one that runs as a normal user (a user
namespace: the programs share the trainer's own uid, so its files and processes are the targets)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
import tempfile
import time

import pytest

from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits, isolation_kind

TIMEOUT_S = 2.0
SLACK_S = 2.0  # the brief: done within timeout + 2 s


def _attack_score(trainer, body: str) -> tuple[float, float]:
    """Score of ``body`` under the code reward when only printing PWNED would pass."""
    start = time.monotonic()
    score = trainer.score(body, "PWNED", timeout_s=TIMEOUT_S)
    return score, time.monotonic() - start


def _check(trainer, body: str) -> None:
    score, elapsed = _attack_score(trainer, body)
    assert score == 0.0
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed


@pytest.fixture
def world_dir():
    """A world-writable directory (only a read-only mount protects it from the sandbox)."""
    path = tempfile.mkdtemp(prefix="mc-attack-")
    os.chmod(path, 0o777)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


@pytest.fixture
def trainer_dir(trainer):
    """A folder of the trainer's own (0700): it may write and delete there, its programs may not."""
    path = tempfile.mkdtemp(prefix="mc-trainer-own-", dir="/tmp")
    trainer.own(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _mode() -> tuple[str, str]:
    return CodeSandbox().backend, isolation_kind()


def test_backend_is_detected(trainer):
    assert trainer.call(_mode) == ("isolated", "root" if trainer.uid == 0 else "user namespace")


def test_infinite_loop(trainer, no_leftovers):
    _check(trainer, "while True:\n    pass\nprint('PWNED')")


def test_fork_bomb(trainer, no_leftovers):
    _check(trainer, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")


def test_memory_bomb(trainer, no_leftovers):
    _check(trainer, "chunks = []\nwhile True:\n    chunks.append(bytearray(100 << 20))\nprint('PWNED')")


def test_write_outside_private_dir(trainer, trainer_dir, no_leftovers):
    target = os.path.join(trainer_dir, "written.txt")
    _check(trainer, f"open({target!r}, 'w').write('x')\nprint('PWNED')")
    assert not os.path.exists(target)


def test_write_world_writable_dir(trainer, world_dir, no_leftovers):
    target = os.path.join(world_dir, "w.txt")
    _check(trainer, f"open({target!r}, 'w').write('x')\nprint('PWNED')")
    assert not os.path.exists(target)
    # The program has a /dev/shm of its own (on its size-capped tmpfs: multiprocessing needs one),
    # so its write there may succeed; the host's /dev/shm stays untouched.
    target = "/dev/shm/mc-attack-w.txt"
    _attack_score(trainer, f"open({target!r}, 'w').write('x')\nprint('PWNED')")
    assert not os.path.exists(target)


def test_delete_files(trainer, trainer_dir, no_leftovers):
    victim = os.path.join(trainer_dir, "victim.txt")
    with open(victim, "w") as f:
        f.write("precious")
    trainer.own(victim)
    _check(trainer, f"import os\nos.remove({victim!r})\nprint('PWNED')")
    with open(victim) as f:
        assert f.read() == "precious"


def test_delete_world_writable_file(trainer, world_dir, no_leftovers):
    victim = os.path.join(world_dir, "victim.txt")
    with open(victim, "w") as f:
        f.write("precious")
    os.chmod(victim, 0o666)
    _check(trainer, f"import os\nos.remove({victim!r})\nprint('PWNED')")
    with open(victim) as f:
        assert f.read() == "precious"


def test_network_connection(trainer, no_leftovers):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        _check(trainer, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)\nprint('PWNED')")
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()


def test_environment_secrets(trainer, monkeypatch, no_leftovers):
    secret = "mc-secret-value-42"
    monkeypatch.setenv("MC_TEST_SECRET_TOKEN", secret)
    result = trainer.run(Program("import os\nprint(dict(os.environ))"), SandboxLimits(timeout_s=TIMEOUT_S))
    assert result.ok
    assert "HOME" in result.stdout
    assert secret not in result.stdout and "MC_TEST_SECRET_TOKEN" not in result.stdout
    _check(trainer, f"import os\nif os.environ.get('MC_TEST_SECRET_TOKEN'):\n    print('PWNED')")


def test_kill_parent_and_test_process(trainer, no_leftovers):
    """Its parent, the trainer (by pid, its group, and every process it may signal: kill(-1)) --
    for a normal user's trainer, a process of the program's own uid."""
    me = trainer.pid
    body = (
        "import os, signal\n"
        "for pid in (os.getppid(), %d, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    os.killpg(os.getpgid(%d), signal.SIGKILL)\n"
        "except OSError:\n"
        "    pass\n"
        "print('PWNED')" % (me, me)
    )
    score, elapsed = _attack_score(trainer, body)
    assert elapsed < TIMEOUT_S + SLACK_S
    assert trainer.call(os.getpid) == me  # the trainer still answers (a SIGKILL would have ended it)
    # Reaching "PWNED" is fine only if nothing was killed; the real check is that we live.
    assert score in (0.0, 1.0)


def _daemon_body(marker: str, flag: str, then: str) -> str:
    child = f"import time; time.sleep(3); open({flag!r}, 'w').write('x')  # {marker}"
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {child!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        f"{then}\n"
    )


@pytest.mark.parametrize("then", ["pass", "while True:\n    pass"], ids=["exits", "hangs"])
def test_daemon_does_not_outlive(trainer, world_dir, marker, then, processes_with, no_leftovers):
    flag = os.path.join(world_dir, "daemon.txt")
    score, elapsed = _attack_score(trainer, _daemon_body(marker, flag, then))
    assert score == 0.0 and elapsed < TIMEOUT_S + SLACK_S
    assert processes_with(marker) == []
    time.sleep(3.5 - (elapsed if then == "pass" else TIMEOUT_S))
    assert not os.path.exists(flag)
    assert processes_with(marker) == []


def test_daemon_really_would_run_unsandboxed(tmp_path, marker, processes_with):
    """Control for the daemon test: the same program, unsandboxed, leaves a live daemon."""
    import subprocess

    flag = tmp_path / "daemon.txt"
    body = _daemon_body(marker, str(flag), "pass").replace("time.sleep(3)", "time.sleep(0.5)")
    subprocess.run([sys.executable, "-c", body], check=True, timeout=10)
    try:
        assert processes_with(marker)
    finally:
        for p in processes_with(marker):
            p.kill()
    assert stat.S_ISDIR(os.stat(tmp_path).st_mode)


def test_rlimits_fallback_still_contains_basics(tmp_path, monkeypatch, no_leftovers):
    """The unsafe mode (allow_unsafe_sandbox): timeout, env scrubbing, privilege drop still hold."""
    box = CodeSandbox(_backend="unsafe")
    monkeypatch.setenv("MC_TEST_SECRET_TOKEN", "mc-secret-value-42")
    limits = SandboxLimits(timeout_s=1)
    start = time.monotonic()
    assert box.run(Program("while True:\n    pass"), limits).timed_out
    assert time.monotonic() - start < 1 + SLACK_S
    res = box.run(Program("import os\nprint(dict(os.environ))"), limits)
    assert res.ok and "mc-secret-value-42" not in res.stdout
    if os.geteuid() == 0:
        victim = tmp_path / "v.txt"
        victim.write_text("keep")
        res = box.run(Program(f"import os\nos.remove({str(victim)!r})"), limits)
        assert not res.ok and victim.read_text() == "keep"
