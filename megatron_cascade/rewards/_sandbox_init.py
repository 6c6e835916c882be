"""Launcher of one sandboxed program (stdlib only, runs as ``python -I -S -B -c <this source>``).

This file is *not* imported by the package; its source text is passed to a fresh interpreter with
``-c`` (so that the package folder, which holds ``math.py`` / ``code.py``, never lands on
``sys.path``). It starts as a child of the trainer -- as root, or (``userns``) as the trainer's own
unprivileged uid -- and:

1. arms ``PR_SET_PDEATHSIG`` = SIGKILL and checks that its parent is still the trainer (a trainer
   SIGKILLed a moment earlier must not leave it running);
2. ``isolate``: unshares the mount, network, IPC, UTS and PID namespaces -- and with ``userns`` a
   user namespace first, which owns them and maps exactly one uid and gid (the trainer's own, so
   nothing of the host gains a new owner) and gives the launcher the capabilities to build the box
   inside it only -- and forks the namespace's init, which re-arms the death signal (its parent is this launcher, which waits and passes the
   exit status on) and builds a minimal root on a size-capped tmpfs: read-only bind mounts of the
   interpreter and system libraries only, ``/dev/{null,zero,full,random,urandom}``, a fresh
   ``/proc``, the writable work dir and ``/tmp`` (both on that tmpfs, so ``disk_bytes`` caps
   them together); then ``pivot_root`` there and detaches the host's file system;
3. empties its capability bounding set, drops privileges to the per-program uid (as root; with
   ``userns`` the one mapped uid is not 0 there, so ``execve`` leaves it no capability), joins a
   fresh session keyring (the trainer's keys stay out of reach), sets ``no_new_privs``, re-arms the
   death signal (a uid change clears it), sets the rlimits, installs the seccomp filter (bytes built
   by ``_sandbox_seccomp``) and
4. ``execve``s the program with a scrubbed environment: it is the init of its PID namespace, so
   when it ends, is killed, or the trainer dies, every process it started dies with it.

Argument: one dict, ``marshal``-ed (format 2, which every Python 3 reads) and hex-encoded, in
``sys.argv[1]`` (see ``sandbox.CodeSandbox._launcher_config``). Imports are builtin modules and
``ctypes`` only: ``json``, ``platform``, ``shutil`` and ``signal`` (``re``, ``enum``, ...) took 35 ms of a
~75 ms program run.
Exit status 126 with ``sandbox-init: ...`` on stderr means the sandbox could not be set up (the
program did not run: fail closed).
"""

import ctypes
import marshal
import os
import resource
import select
import sys

import _signal  # not signal: its enums (enum, re) cost 8 ms per run

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 22, 24, 38
# Mount flags a user namespace may not clear from a mount it did not make (statvfs's ST_* = MS_*):
# a bind's remount must repeat them (nosuid, nodev, noexec, read-only, the atime flags).
_LOCKED_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096
SECCOMP_MODE_FILTER = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
_SYSCALLS = {"x86_64": {"pivot_root": 155, "keyctl": 250}, "aarch64": {"pivot_root": 41, "keyctl": 219}}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _die(msg):
    sys.stderr.write("sandbox-init: " + msg + "\n")
    sys.stderr.flush()
    os._exit(126)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           "mount %s on %s" % (src or fstype, target))


def _syscall(name, *args):
    _check(0 if _libc.syscall(_SYSCALLS[os.uname().machine][name], *args) >= 0 else -1, name)


def _arm_death_signal(parent_alive):
    """SIGKILL us when our parent dies; exit now if it already did (the signal would never come)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if not parent_alive():
        os._exit(137)


def _pipe_open(fd):
    """The parent holds the write end: end of file (or an error) on ``fd`` means it is gone."""
    return lambda: not select.select([fd], [], [], 0)[0]


def _bind(source, target, kind, readonly):
    if kind == "symlink":
        os.symlink(source, target)
        return
    if kind == "dir":
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY | MS_NODEV if readonly else 0)
    _mount(None, target, None, flags | os.statvfs(target).f_flag & _LOCKED_FLAGS)


def _copy_file(source, target):
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(src.read())


def _build_root(cfg):
    """The minimal root on a tmpfs at ``cfg['root']``; returns nothing, raises OSError."""
    root, uid = cfg["root"], cfg["uid"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV,
           "size=%d,nr_inodes=%d,mode=755" % (cfg["disk_bytes"], cfg["inodes"]))
    inside = lambda path: root + path  # noqa: E731  (absolute paths only)
    for source, kind in cfg["binds"]:
        _bind(os.readlink(source) if kind == "symlink" else source, inside(source), kind, readonly=True)
    for dev in cfg["devices"]:
        _bind(dev, inside(dev), "file", readonly=False)
    for folder in ("/tmp", "/dev/shm"):
        os.makedirs(inside(folder), exist_ok=True)
        os.chmod(inside(folder), 0o1777)
    work = inside(cfg["workdir"])
    os.makedirs(work, mode=0o755, exist_ok=True)
    os.chmod(work, 0o700)
    _copy_file(cfg["source"], os.path.join(work, "main.py"))
    for path in (work, os.path.join(work, "main.py")):
        os.chown(path, uid, cfg["gid"])
    os.makedirs(inside("/proc"), exist_ok=True)
    _mount("proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _syscall("pivot_root", b".", b".")  # the old root now sits under the new one at "."
    _check(_libc.umount2(b".", MNT_DETACH), "umount2(old root)")
    os.chdir("/")


def _map_own_ids(uid, gid):
    """In a fresh user namespace: map the one uid and gid we are outside to the same ids inside."""
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                       ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def _empty_bounding_set():
    """No capability can be gained back (file capabilities, setuid binaries) after the drop."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(CAPBSET_DROP)")


def _drop_privileges(uid, gid):
    if uid < 0:
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        _die("privilege drop failed")


def _install_seccomp(program_hex):
    program = bytes.fromhex(program_hex)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def _set_rlimits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _exec_program(cfg, parent_alive):
    """Steps 3-4 (in the namespaces when isolating); never returns."""
    os.chdir(cfg["workdir"])
    if cfg["isolate"]:
        _empty_bounding_set()
    _drop_privileges(cfg["uid"], cfg["gid"])
    if cfg["isolate"]:
        _syscall("keyctl", KEYCTL_JOIN_SESSION_KEYRING, None)  # fresh, anonymous: no trainer keys
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _arm_death_signal(parent_alive)  # cleared by the uid change
    _set_rlimits(cfg["rlimits"])
    if cfg["seccomp"]:
        _install_seccomp(cfg["seccomp"])
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def _wait_and_pass_on(pid):
    """Wait for the namespace init and exit as it did (a signal is re-raised on ourselves)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _signal.signal(sig, _signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128)


def main():
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    try:
        _arm_death_signal(lambda: os.getppid() == cfg["parent_pid"])
        if not cfg["isolate"]:
            _exec_program(cfg, lambda: os.getppid() == cfg["parent_pid"])
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
        outside = (os.geteuid(), os.getegid())
        try:
            _check(_libc.unshare(flags | (CLONE_NEWUSER if cfg["userns"] else 0)), "unshare")
        except OSError as e:
            _die("cannot create the %smount/network/IPC/UTS/PID namespaces (%s): needs %s and a seccomp "
                 "profile that allows unshare" % (("user/", e, "unprivileged user namespaces") if cfg["userns"]
                                                   else ("", e, "CAP_SYS_ADMIN")))
        if cfg["userns"]:
            _map_own_ids(*outside)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid:
            os.close(read_end)
            _wait_and_pass_on(pid)
        os.close(write_end)
        parent_alive = _pipe_open(read_end)
        _arm_death_signal(parent_alive)
        _build_root(cfg)
        _exec_program(cfg, parent_alive)
    except OSError as e:
        _die("setup failed: %s" % e)


main()
