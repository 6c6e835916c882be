"""What the code sandbox (``rewards/sandbox.py``) takes and gives: a program, its limits, its result."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_cascade.config.rules import MAX_TIMEOUT_S

_MIN_PROCESS_MB = 24  # address space a Python process needs to start (VmPeak ~14 MiB)


class SandboxUnavailableError(RuntimeError):
    """The isolated sandbox cannot run here (or its uid range is unusable); the message says why."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one program and everything it starts.

    Attributes:
        timeout_s: wall-clock limit in seconds; the process tree is killed after it.
        memory_mb: memory of the whole process tree in MiB: each process gets an address-space
            limit (``RLIMIT_AS``) of ``memory_mb / max_processes``.
        max_processes: processes and threads of the tree (``RLIMIT_NPROC`` of its own uid).
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``) in MiB; also
            caps its stdout and stderr.
        max_disk_mb: size in MiB of the tmpfs holding its work dir, ``/tmp`` and ``/dev/shm``.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: bytes of stdout/stderr read back.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 4
    max_file_mb: int = 16
    max_disk_mb: int = 64
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.timeout_s}")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_disk_mb", "max_open_files",
                     "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.memory_mb // self.max_processes < _MIN_PROCESS_MB:
            raise ValueError(f"memory_mb / max_processes = {self.memory_mb} / {self.max_processes} MiB is below "
                             f"the {_MIN_PROCESS_MB} MiB a Python process needs: raise memory_mb")

    @property
    def process_memory_bytes(self) -> int:
        """``RLIMIT_AS`` of each process (bytes)."""
        return (self.memory_mb << 20) // self.max_processes


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
