"""In-namespace launcher for the code sandbox (stdlib only, runs with ``python -I -S -c``).

This file is *not* imported by the package at run time in the parent; its source text is
passed to a fresh interpreter with ``-c`` (so that the script directory, which contains
``math.py`` / ``code.py``, never lands on ``sys.path``). It runs as the first process of
the new PID/mount/network namespaces created by ``unshare`` (or directly under the
rlimits-only fallback), still privileged, and then:

1. optionally makes every mount read-only inside the private mount namespace, except the
   sandbox work dir, which is bind-mounted onto itself first so it stays writable;
2. sets the resource limits (after the mounts: ``RLIMIT_NOFILE`` etc. must not hinder us);
3. drops privileges (groups, gid, uid) and sets ``no_new_privs`` so set-uid binaries are inert;
4. re-arms ``PR_SET_PDEATHSIG`` (the kernel clears it on a uid change) so the program dies
   with the ``unshare`` process that the parent kills on timeout;
5. ``execve``s the program with a scrubbed environment.

Argument: one JSON object in ``sys.argv[1]`` with keys ``workdir``, ``uid``, ``gid``,
``rlimits`` (name -> int), ``argv``, ``env``, ``remount_ro``, ``pdeathsig``.
Exit status 126 with a message on stderr means the sandbox could not be set up (fail closed).
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_RELATIME = 1 << 21
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
_FLAG_NAMES = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
# Pseudo file systems whose read-only remount is pointless or refused; nobody cannot
# write through them anyway (and /proc is the fresh one of the new PID namespace).
_SKIP_FSTYPES = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "bpf",
                 "tracefs", "debugfs", "securityfs", "pstore", "configfs", "fusectl",
                 "binfmt_misc", "autofs", "hugetlbfs", "efivarfs"}

_libc = ctypes.CDLL(None, use_errno=True)


def _die(msg):
    sys.stderr.write("sandbox-init: " + msg + "\n")
    sys.stderr.flush()
    os._exit(126)


def _mount(src, target, flags):
    if _libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _unescape(path):
    # mountinfo escapes space, tab, newline and backslash as octal.
    return (path.replace("\\040", " ").replace("\\011", "\t")
            .replace("\\012", "\n").replace("\\134", "\\"))


def _mounts():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype = right.split()[0]
            yield _unescape(fields[4]), fields[5].split(","), fstype


def _remount_all_readonly(workdir):
    _mount(workdir.encode(), workdir, MS_BIND | MS_REC)
    for mountpoint, opts, fstype in _mounts():
        if mountpoint == workdir or fstype in _SKIP_FSTYPES:
            continue
        # Keep the existing per-mount flags: in a user namespace they are locked and
        # dropping one makes the remount fail with EPERM.
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts:
            flags |= _FLAG_NAMES.get(opt, 0)
        try:
            _mount(None, mountpoint, flags)
        except OSError as e:
            if not os.path.exists(mountpoint):  # stale/overmounted entry
                continue
            _die("cannot remount %s read-only: %s" % (mountpoint, e))


def _set_rlimits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _drop_privileges(uid, gid):
    if uid < 0:
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        _die("privilege drop failed")


def main():
    cfg = json.loads(sys.argv[1])
    workdir = cfg["workdir"]
    try:
        if cfg.get("remount_ro"):
            _remount_all_readonly(workdir)
        os.chdir(workdir)
        _drop_privileges(cfg["uid"], cfg["gid"])
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            _die("prctl(NO_NEW_PRIVS) failed")
        if cfg.get("pdeathsig"):
            _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() == 1 and os.getpid() != 1:
                os._exit(137)  # our parent already died: do not run unsupervised
        _set_rlimits(cfg["rlimits"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as e:
        _die("setup failed: %s" % e)


main()
