"""The sandbox under the attacks of issue 13: each was reproduced against the old sandbox (it broke),
then held. Every program here would pass its test only by getting out of the box -- run by a root
trainer (a uid per program) and by a normal user's (a user namespace, the trainer's own uid).

These need the isolated sandbox; where it cannot be had they skip, and
``test_sandbox_fail_closed.py`` checks that the reward refuses instead.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest

from megatron_cascade.rewards import build_reward
from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits, SandboxUnavailableError

TIMEOUT_S = 3.0
# The syscalls of the attacks, by architecture (asm/unistd_64.h, asm-generic/unistd.h).
_NR = {
    "x86_64": {"ptrace": 101, "mount": 165, "unshare": 272, "setns": 308, "bpf": 321,
               "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249},
    "aarch64": {"ptrace": 117, "mount": 40, "unshare": 97, "setns": 268, "bpf": 280,
                "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218},
}


@pytest.fixture(scope="module")
def box() -> CodeSandbox:
    """The root mode's sandbox (its per-program uid leases); the tests of both modes take ``trainer``."""
    if os.geteuid() != 0:
        pytest.skip("per-program uids are the root mode's (a normal user's programs share its uid)")
    sandbox = CodeSandbox()
    try:
        sandbox.require_isolation()
    except SandboxUnavailableError as e:
        pytest.skip(f"isolated sandbox unavailable here: {e}")
    return sandbox


@pytest.fixture
def host_dir():
    """A host folder that every user may read and write (only the sandbox's root hides it)."""
    path = tempfile.mkdtemp(prefix="mc-host-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_host_test_data_is_invisible(trainer, host_dir, no_leftovers):
    """Issue: a program read the reward's test data (readable by others) and scored 10/10. Here the
    data is the trainer's own file (0600): a normal user's programs share its uid."""
    data = os.path.join(host_dir, "hidden_tests.json")
    with open(data, "w") as f:
        f.write("ANSWER-4242")
    os.chmod(data, 0o600)
    trainer.own(data)
    assert trainer.score(f"print(open({data!r}).read())", "ANSWER-4242", timeout_s=TIMEOUT_S) == 0.0
    # Nothing of the host but the interpreter: not the repository, not /etc, not /root, no other
    # process (not the trainer's /proc/PID/environ).
    here = os.path.abspath(__file__)
    probe = (f"import os\nfor p in ({here!r}, '/etc/passwd', '/etc/hostname', '/root', {host_dir!r}, "
             f"'/proc/{trainer.pid}/environ', '/proc/{os.getpid()}'):\n"
             "    print(p, os.path.exists(p))\n"
             "print('pids', [p for p in os.listdir('/proc') if p.isdigit()])\n")
    res = trainer.run(Program(probe), SandboxLimits(timeout_s=TIMEOUT_S))
    assert res.ok, res.stderr
    assert "True" not in res.stdout, res.stdout
    assert res.stdout.strip().splitlines()[-1] == "pids ['1']", res.stdout


def _keyring_attack(program: str) -> dict | None:
    """A 'trainer' with a secret in its session keyring scores ``program`` (given the key id); None
    where this kernel gives the trainer no keyring."""
    nr = _NR[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(nr["keyctl"], 1, b"mc-trainer-session") <= 0:  # JOIN_SESSION_KEYRING
        return None
    key = libc.syscall(nr["add_key"], b"user", b"mc-secret", b"TOKEN-SECRET-99", 15, ctypes.c_long(-3))
    assert key > 0, ctypes.get_errno()
    reward = build_reward("code", {"timeout_s": TIMEOUT_S})
    response = f"```python\n{program.replace('KEY', str(key))}\n```"
    score = reward(response, {"tests": [{"input": "", "output": "TOKEN-SECRET-99"}]})
    buf = ctypes.create_string_buffer(64)
    still = libc.syscall(nr["keyctl"], 11, ctypes.c_long(key), buf, 64)  # KEYCTL_READ
    return {"score": score, "key_readable_after": still == 15}


def test_trainer_keyring_is_out_of_reach(trainer, no_leftovers):
    """Issue: a program read -- and revoked -- a secret in the trainer's session keyring."""
    nr = _NR[platform.machine()]
    program = (
        "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.syscall.restype = ctypes.c_long\n"
        "buf = ctypes.create_string_buffer(64)\n"
        f"n = libc.syscall({nr['keyctl']}, 11, ctypes.c_long(KEY), buf, 64)\n"
        f"libc.syscall({nr['keyctl']}, 3, ctypes.c_long(KEY))\n"  # KEYCTL_REVOKE
        "print(buf.value.decode() if n > 0 else 'no access')\n")
    result = trainer.call_in_child(_keyring_attack, program)
    if result is None:
        pytest.skip("no kernel keyring for the trainer here")
    assert result == {"score": 0.0, "key_readable_after": True}


def test_dangerous_syscalls_are_refused(trainer, no_leftovers):
    """Fresh keyring aside, seccomp refuses keyctl, ptrace, mount, bpf, namespaces, perf (EPERM)."""
    nr = _NR[platform.machine()]
    program = textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        calls = {{
            "ptrace": ({nr['ptrace']}, 0, 0, 0, 0),                       # PTRACE_TRACEME
            "mount": ({nr['mount']}, b"none", b"/tmp", b"tmpfs", 0, 0),
            "unshare_user": ({nr['unshare']}, 0x10000000),               # CLONE_NEWUSER
            "unshare_net": ({nr['unshare']}, 0x40000000),
            "setns": ({nr['setns']}, 0, 0),
            "bpf": ({nr['bpf']}, 0, 0, 0),
            "perf_event_open": ({nr['perf_event_open']}, 0, 0, -1, -1, 0),
            "keyctl": ({nr['keyctl']}, 0, ctypes.c_long(-3), 0),          # GET_KEYRING_ID @s
            "add_key": ({nr['add_key']}, b"user", b"k", b"v", 1, ctypes.c_long(-3)),
            "request_key": ({nr['request_key']}, b"user", b"k", 0, 0),
        }}
        for name, args in calls.items():
            ctypes.set_errno(0)
            rc = libc.syscall(*args)
            print(name, rc, os.strerror(ctypes.get_errno()) if rc < 0 else "SUCCEEDED", flush=True)
        pid = os.fork() if hasattr(os, "fork") else 0
        if pid == 0:
            # clone(CLONE_NEWUSER) through the fork path: a user namespace gives the program caps.
            rc = libc.syscall({56 if platform.machine() == 'x86_64' else 220}, 0x10000000 | 17, 0, 0, 0, 0)
            if rc == 0:
                os._exit(0)
            print("clone_newuser", rc, os.strerror(ctypes.get_errno()) if rc < 0 else "SUCCEEDED", flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """).replace("platform.machine()", repr(platform.machine()))
    res = trainer.run(Program(program), SandboxLimits(timeout_s=TIMEOUT_S))
    assert res.ok, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 11, res.stdout
    for line in lines:
        assert line.endswith("Operation not permitted"), line


def _sysv_ipc(key: int) -> list[str]:
    with open("/proc/sysvipc/shm") as f:
        return [line for line in f if line.split()[0] == str(key)]


def test_ipc_objects_do_not_outlive_or_cross(trainer, no_leftovers):
    """Issue: SysV/POSIX IPC objects outlived the run (no IPC namespace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    leak_key, host_key = 0x4D430001, 0x4D430002
    host_id = libc.shmget(host_key, 4096, 0o1666)  # IPC_CREAT | rw for all: only a namespace hides it
    assert host_id >= 0, ctypes.get_errno()
    try:
        program = (
            "import ctypes\nlibc = ctypes.CDLL(None)\n"
            f"print('made', libc.shmget({leak_key}, 4096, 0o1666) >= 0)\n"
            f"print('host seen', libc.shmget({host_key}, 0, 0) >= 0)\n")
        res = trainer.run(Program(program), SandboxLimits(timeout_s=TIMEOUT_S))
        assert res.ok, res.stderr
        # SysV IPC is refused outright now (seccomp, below); the IPC namespace stays underneath.
        assert res.stdout.split("\n")[:2] == ["made False", "host seen False"], res.stdout
        assert _sysv_ipc(leak_key) == []
    finally:
        for key in (leak_key, host_key):
            for line in _sysv_ipc(key):
                libc.shmctl(int(line.split()[1]), 0, None)  # IPC_RMID


def test_memory_outside_the_limits_and_host_sockets_are_refused(trainer, no_leftovers):
    """Issue 29: SysV shared memory (1,280 MiB committed under a 256 MiB limit) and memfd files (960 MiB)
    escaped the memory and disk limits; AF_VSOCK sockets (the hypervisor's host) could be created.
    What programs do need still works: inet and Unix sockets, socketpair, multiprocessing's queue."""
    program = textwrap.dedent("""
        import ctypes, multiprocessing, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        committed = 0
        for i in range(80):  # 80 segments of 16 MiB, each attached, touched and detached (RLIMIT_AS
            ident = libc.shmget(0x4D431000 + i, 16 << 20, 0o1600)  # counts only what is attached)
            if ident < 0:
                break
            address = libc.shmat(ident, None, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                break
            ctypes.memset(address, 1, 16 << 20)
            libc.shmdt(ctypes.c_void_p(address))
            committed += 16
        print("sysv MiB", committed, os.strerror(ctypes.get_errno()))
        try:
            fd = os.memfd_create("big")
            print("memfd made")
        except OSError as e:
            print("memfd", e.errno)
        for family, kind in ((40, socket.SOCK_STREAM), (38, socket.SOCK_SEQPACKET), (16, socket.SOCK_RAW),
                             (17, socket.SOCK_RAW)):  # AF_VSOCK, AF_ALG, AF_NETLINK, AF_PACKET
            try:
                socket.socket(family, kind)
                print(family, "made")
            except OSError as e:
                print(family, e.errno)
        socket.socket(); socket.socket(socket.AF_INET6); socket.socket(socket.AF_UNIX); socket.socketpair()
        q = multiprocessing.Queue(); q.put("needed ones work"); print(q.get())
    """)
    res = trainer.run(Program(program), SandboxLimits(timeout_s=10, memory_mb=256))
    assert res.ok, res.stderr
    assert res.stdout.splitlines() == ["sysv MiB 0 Operation not permitted", "memfd 1", "40 97", "38 97", "16 97",
                                       "17 97", "needed ones work"], res.stdout


def test_host_unix_socket_is_unreachable(trainer, host_dir, no_leftovers):
    """Issue: a file-system Unix socket on the host was reachable."""
    path = os.path.join(host_dir, "service.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(1)
        program = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(1)\n"
                   f"s.connect({path!r})\nprint('PWNED')")
        assert trainer.score(program, "PWNED", timeout_s=TIMEOUT_S) == 0.0
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()


def test_memory_limit_covers_the_process_tree(trainer, no_leftovers):
    """Issue: the memory limit was per process with 64 processes allowed (633 MiB under 160 MiB)."""
    program = textwrap.dedent("""
        import os, time
        CHUNK = 20 << 20
        r, w = os.pipe()
        for _ in range(16):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                try:
                    block = bytearray(CHUNK)
                    block[::4096] = b"x" * len(block[::4096])
                    os.write(w, b"1")
                except MemoryError:
                    pass
                time.sleep(3)
                os._exit(0)
        os.close(w)
        time.sleep(1.0)
        os.set_blocking(r, False)
        try:
            got = len(os.read(r, 100))
        except BlockingIOError:
            got = 0
        print(got * 20)
    """)
    res = trainer.run(Program(program), SandboxLimits(timeout_s=TIMEOUT_S, memory_mb=160))
    assert res.ok, res.stderr
    assert int(res.stdout.strip()) <= 160, res.stdout


def test_disk_limit_covers_workdir_and_tmp(trainer, no_leftovers):
    """Issue: /tmp (and the work dir) filled past the per-file cap."""
    program = textwrap.dedent("""
        import os
        total = 0
        for i in range(12):
            for folder in (".", "/tmp"):
                try:
                    with open(os.path.join(folder, f"f{i}"), "wb") as f:
                        for _ in range(16):
                            f.write(b"x" * (1 << 20))
                            f.flush()
                            total += 1
                except OSError:
                    pass
        print(total)
    """)
    limits = SandboxLimits(timeout_s=10)
    res = trainer.run(Program(program), limits)
    assert res.ok, res.stderr
    assert 0 < int(res.stdout.strip()) <= limits.max_disk_mb, res.stdout


def _argv(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# A program that also tries to clear its own death signal (seccomp refuses prctl(PR_SET_PDEATHSIG)).
_CLEARS_DEATH_SIGNAL = "import ctypes\nctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a zombie is dead (whoever inherited it reaps it in its own time)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _start_sleeper(source: str) -> None:
    """In the trainer: run ``source`` in the sandbox on a thread of its own (returns at once)."""
    box = CodeSandbox(_backend="isolated")  # the fixture checked: no probe, so the one main.py is this program
    threading.Thread(target=box.run, args=(Program(source), SandboxLimits(timeout_s=60)), daemon=True).start()


_SLEEPING_TRAINER = """
import sys, time
from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits
CodeSandbox(_backend="isolated").run(Program(sys.argv[1]), SandboxLimits(timeout_s=60))
"""


@pytest.mark.parametrize("prelude", ["", _CLEARS_DEATH_SIGNAL], ids=["plain", "clears-pdeathsig"])
def test_programs_die_with_the_trainer(trainer, prelude, marker, processes_with, new_trainer):
    """Issue: when the trainer is SIGKILLed, sandboxed programs lived on."""
    source = f"{prelude}import time\ntime.sleep(60)  # {marker}"
    if trainer.kind == "this":  # a trainer of our kind to kill: a child process
        proc = subprocess.Popen([sys.executable, "-c", _SLEEPING_TRAINER, source])
        pid, alive, reap = proc.pid, lambda: proc.poll() is None, lambda: proc.wait(timeout=10)
    else:  # a normal user's trainer of its own (the shared one serves other tests)
        victim = new_trainer("user")
        victim.call(_start_sleeper, source)
        pid, alive, reap = victim.pid, lambda: victim._proc.is_alive(), lambda: victim._proc.join(10)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        # Wait for the program itself (its argv ends in main.py), a descendant of this trainer.
        while not any(_argv(p)[-1:] and _argv(p)[-1].endswith("main.py") for p in tree):
            assert time.monotonic() < deadline and alive(), "the program never started"
            time.sleep(0.05)
            tree = psutil.Process(pid).children(recursive=True)
        time.sleep(1.0)  # the program's prelude has run
        os.kill(pid, signal.SIGKILL)
        reap()
        deadline = time.monotonic() + 5
        while _running(tree):
            assert time.monotonic() < deadline, [_argv(p) for p in _running(tree)]
            time.sleep(0.05)
    finally:
        if alive():
            os.kill(pid, signal.SIGKILL)
        # This test's sandbox tree only, never another run's sandboxes on the machine; one may exit
        # between the listing and the kill.
        for p in tree + processes_with(marker):
            try:
                p.kill()
            except psutil.Error:
                pass


def _uid_of_program(local_rank: str) -> int:
    script = ("from megatron_cascade.rewards.sandbox import CodeSandbox, Program\n"
              "print(CodeSandbox().run(Program('import os; print(os.getuid())')).stdout.strip())\n")
    env = {**os.environ, "LOCAL_RANK": local_rank}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_ranks_of_a_node_never_share_a_uid(box, no_leftovers):
    """Issue: every rank of a node used the same sandbox uids (one rank's fork hog zeroed another)."""
    uids = {_uid_of_program("0"), _uid_of_program("1")}
    assert len(uids) == 2, uids


def test_uid_of_a_real_user_is_refused(box):
    """Issue: sandbox uids were not checked against the user database."""
    with pytest.raises(SandboxUnavailableError, match="uid_base.*root"):
        CodeSandbox(uid_base=0).run(Program("print(1)"))


def test_a_uid_held_by_another_process_is_not_reused(box, no_leftovers):
    """Two processes of one rank (e.g. reward workers) lease uids through flock, not a local counter."""
    from megatron_cascade.rewards.sandbox_processes import _lock_dir

    first = box.run(Program("import os; print(os.getuid())")).stdout.strip()
    fd = os.open(os.path.join(_lock_dir(), first), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)  # as another process of this rank holding that uid would
        res = box.run(Program("import os; print(os.getuid())"))
        assert res.ok and res.stdout.strip() != first, (first, res.stdout)
    finally:
        os.close(fd)


def test_process_limit_is_exact(trainer, no_leftovers):
    """max_processes counts the program and all it starts, for either trainer (a user namespace's
    launcher counts there too, so its limit is one higher)."""
    program = ("import os, time\nn = 0\nfor _ in range(20):\n    try:\n        if os.fork() == 0:\n"
               "            time.sleep(1)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
               "        break\nprint(n)\n")
    for processes in (3, 6):
        res = trainer.call(_run_in_fresh_uids, Program(program), SandboxLimits(timeout_s=TIMEOUT_S,
                                                                               max_processes=processes))
        assert res.ok and res.stdout.strip() == str(processes - 1), (processes, res)


def _run_in_fresh_uids(program: Program, limits: SandboxLimits):
    # As root the count is per uid, machine-wide: another test's killed program may still be a
    # zombie of the default range (PID 1 reaps it in its own time).
    return CodeSandbox(uid_base=62000, uids_per_rank=16).run(program, limits)


def _hog_and_neighbours() -> list[str]:
    hog = ("import os, time\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
           "            time.sleep(2)\n            os._exit(0)\n    except OSError:\n        pass\ntime.sleep(2)\n")
    good = "import time\ntime.sleep(0.3)\nprint(int(input()) * 2)"
    programs = [Program(hog)] + [Program(good, "21")] * 2
    results = CodeSandbox(max_workers=3).run_many(programs, SandboxLimits(timeout_s=TIMEOUT_S))
    return [r.stdout.strip() for r in results[1:]]


def test_fork_hog_does_not_zero_a_neighbour(trainer, no_leftovers):
    """Issue: one program's fork hog (same uid) zeroed another's correct answer."""
    assert trainer.call(_hog_and_neighbours) == ["42", "42"]
