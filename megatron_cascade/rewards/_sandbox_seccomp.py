"""The code sandbox's seccomp filter, built as classic BPF in pure Python.

The parent builds the filter (:func:`build_filter`) and hands its bytes to the in-namespace
launcher, which installs it right before ``execve`` (``prctl(PR_SET_SECCOMP)``, after
``no_new_privs``). The filter:

* kills the process for any other syscall ABI than the native one (on x86_64 also the x32
  ABI), so that a denied syscall cannot be reached through another table;
* answers ``EPERM`` to every syscall in :data:`DENIED` -- the kernel keyring, tracing other
  processes, mounts and namespaces, bpf, perf, module/kexec/reboot and clock control, io_uring
  (its own path to syscalls);
* refuses ``prctl(PR_SET_PDEATHSIG)``: the program must not clear the death signal that ends it
  with the trainer;
* answers ``EPERM`` to SysV IPC and memfd files (memory outside the sandbox's limits) and
  ``EAFNOSUPPORT`` to sockets of any family but Unix and inet (no AF_VSOCK to the host);
* refuses ``clone`` with any ``CLONE_NEW*`` flag (a user namespace would hand the program
  capabilities there) and answers ``clone3`` with ``ENOSYS`` (its flags sit in memory the
  filter cannot read; libc then falls back to ``clone``, as under Docker's default profile);
* allows everything else: programs are ordinary Python with threads and subprocesses.
"""

from __future__ import annotations

import errno
import struct

# Syscall numbers: asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64).
_NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "syslog": 103, "vhangup": 153, "pivot_root": 155,
        "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
        "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
        "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
        "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246, "add_key": 248,
        "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
        "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438,
        "mount_setattr": 442, "clone": 56, "clone3": 435, "prctl": 157,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66,
        "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "memfd_create": 319,
        "memfd_secret": 447, "socket": 41, "socketpair": 53,
    },
    "aarch64": {
        "ptrace": 117, "syslog": 116, "vhangup": 58, "pivot_root": 41,
        "adjtimex": 171, "chroot": 51, "acct": 89, "settimeofday": 170, "mount": 40, "umount2": 39,
        "swapon": 224, "swapoff": 225, "reboot": 142, "sethostname": 161, "setdomainname": 162,
        "init_module": 105, "delete_module": 106, "quotactl": 60, "lookup_dcookie": 18,
        "clock_settime": 112, "kexec_load": 104, "add_key": 217, "request_key": 218, "keyctl": 219,
        "unshare": 97, "perf_event_open": 241, "fanotify_init": 262, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "clock_adjtime": 266, "setns": 268, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "kexec_file_load": 294, "bpf": 280,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442, "clone": 220, "clone3": 435, "prctl": 167,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191,
        "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "memfd_create": 279, "memfd_secret": 447, "socket": 198, "socketpair": 199,
    },
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

DENIED: tuple[str, ...] = (
    "keyctl", "add_key", "request_key",  # the kernel keyring (the trainer's secrets)
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at",  # file systems
    "unshare", "setns",  # namespaces (a user namespace grants capabilities inside it)
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init", "lookup_dcookie", "syslog", "vhangup", "acct", "quotactl", "swapon", "swapoff",
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "iopl", "ioperm",
    # Memory outside the sandbox's limits: SysV shared memory (1,280 MiB committed under a 256 MiB
    # limit), message queues and semaphores live in the kernel, not in the process's address space;
    # memfd files are anonymous tmpfs memory outside the sized tmpfs. (POSIX shm and semaphores, which
    # multiprocessing uses, are files of the sandbox's own /dev/shm: counted.)
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
    "msgrcv", "msgctl", "memfd_create", "memfd_secret",
)
# Socket families a program may open (socket, socketpair); others get EAFNOSUPPORT: AF_VSOCK reaches the
# hypervisor's host side, AF_ALG/AF_KEY/AF_PACKET/AF_NETLINK/... are kernel attack surface it needs
# not. Inet sockets see only the sandbox's own network namespace (a downed loopback).
ALLOWED_SOCKET_FAMILIES: tuple[int, ...] = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (not NEWTIME: 0x80 is part
# of the exit-signal byte in clone's flags).
_PR_SET_PDEATHSIG = 1
_CLONE_NEW_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LOW = 0, 4, 16  # little-endian: the low half of args[0] comes first


class UnsupportedArchitecture(RuntimeError):
    """No syscall table for this machine: the sandbox cannot install its filter."""


def supported_machines() -> tuple[str, ...]:
    """``platform.machine()`` values the filter knows the syscall numbers of."""
    return tuple(_NUMBERS)


def build_filter(machine: str) -> bytes:
    """The filter for ``machine`` (``platform.machine()``) as packed ``struct sock_filter[]``.

    Raises:
        UnsupportedArchitecture: no syscall table for ``machine``.
    """
    if machine not in _NUMBERS:
        raise UnsupportedArchitecture(f"no seccomp syscall table for {machine!r} "
                                      f"(supported: {', '.join(_NUMBERS)})")
    nr = _NUMBERS[machine]
    # Instructions as (code, jump-if-true label, jump-if-false label, k); labels resolve below.
    prog: list[tuple[int, object, object, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 0, "kill", _AUDIT_ARCH[machine]),
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if machine == "x86_64":
        prog.append((_JGE_K, "kill", 0, _X32_SYSCALL_BIT))
    prog += [(_JEQ_K, "deny", 0, nr[name]) for name in DENIED]
    prog += [
        (_JEQ_K, "enosys", 0, nr["clone3"]),
        (_JEQ_K, "clone", 0, nr["clone"]),
        (_JEQ_K, "prctl", 0, nr["prctl"]),
        (_JEQ_K, "socket", 0, nr["socket"]),
        (_JEQ_K, "socket", 0, nr["socketpair"]),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    labels = {"clone": len(prog)}
    prog += [(_LD_W_ABS, 0, 0, _OFF_ARG0_LOW), (_JSET_K, "deny", 0, _CLONE_NEW_MASK), (_RET_K, 0, 0, _RET_ALLOW)]
    labels["prctl"] = len(prog)
    prog += [(_LD_W_ABS, 0, 0, _OFF_ARG0_LOW), (_JEQ_K, "deny", 0, _PR_SET_PDEATHSIG), (_RET_K, 0, 0, _RET_ALLOW)]
    labels["socket"] = len(prog)
    prog += [(_LD_W_ABS, 0, 0, _OFF_ARG0_LOW)]
    prog += [(_JEQ_K, "allow", 0, family) for family in ALLOWED_SOCKET_FAMILIES]
    prog += [(_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT)]
    for name, ret in (("allow", _RET_ALLOW), ("deny", _RET_ERRNO | errno.EPERM),
                      ("enosys", _RET_ERRNO | errno.ENOSYS), ("kill", _RET_KILL_PROCESS)):
        labels[name] = len(prog)
        prog.append((_RET_K, 0, 0, ret))

    def offset(i: int, target: object) -> int:
        if isinstance(target, int):
            return target
        jump = labels[str(target)] - (i + 1)
        assert 0 <= jump <= 255, (target, jump)  # classic BPF jumps are forward, 8 bit
        return jump

    return b"".join(struct.pack("=HBBI", code, offset(i, jt), offset(i, jf), k)
                    for i, (code, jt, jf, k) in enumerate(prog))
