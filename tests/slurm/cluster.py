"""A private, throw-away one-node Slurm cluster for the launch tests.

Everything lives in one temporary directory: the munge key and socket, ``slurm.conf``,
the controller state, the slurmd spool, the daemon logs and the job logs.  Nothing is
written to /etc.  Client commands are pointed at the private config through the
``SLURM_CONF`` environment variable (see :attr:`SlurmCluster.env`); the daemons get it
with ``-f`` and the munge socket through ``AuthInfo=socket=...``.

Usage::

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["--wrap", "hostname"])
        assert cluster.wait_job(job, timeout=30) == "COMPLETED"

Daemons run in the foreground (``-D`` / ``-F``) as child processes of the test process,
so they are stopped exactly by PID (SIGTERM, then SIGKILL).  Job steps are started by
slurmd through ``slurmstepd``, which daemonises; those (and the job's own processes)
are found by the unique ``SLURM_CONF`` path in their environment, which every process
of this cluster inherits and no other process can have.

Requirements (Debian): ``apt-get install -y slurm-wlm munge`` and running as root
(slurmd must run as root to launch jobs).  :func:`missing_requirements` says what is
missing so callers can skip.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SLURM_DIR = REPO / "slurm"

# The trainer command the fake-trainer tests run (MEGATRON_CASCADE_CMD); CASCADE_TEST_TRAINER_CMD
# swaps it. test_slurm_real_trainer.py always runs the real CLI (megatron-cascade of this Python).
FAKE_TRAINER_CMD = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_trainer.py'))}"
TRAINER_CMD = os.environ.get("CASCADE_TEST_TRAINER_CMD", FAKE_TRAINER_CMD)

# sbatch options turning the 8-GPU H100 defaults of stage.sbatch into a CPU-only 2-rank job.
# The header's --signal=B:USR1@600 would fire at once with a limit under 10 minutes: warn 60 s
# before a 10-minute limit instead (only the time-limit test wants that signal).
CPU_SBATCH_ARGS = "--ntasks-per-node=2 --gpus-per-node=0 --time=10 --signal=B:USR1@60"

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin", "/usr/bin") if (p := Path(d, name)).exists()),
        None,
    )


def missing_requirements() -> list[str]:
    """Names of the programs / conditions this cluster needs but does not have."""
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd must run as root)")
    return missing


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(_free_port())
    return sorted(ports)


def _set_child_subreaper(on: bool) -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER); False where unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1 if on else 0, 0, 0, 0) == 0  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """Context manager that runs munged + slurmctld + slurmd on this machine."""

    def __init__(
        self,
        cpus: int | None = None,
        base_dir: str | os.PathLike | None = None,
        keep: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        self.nodename = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self._base_dir = base_dir
        self.keep = keep or bool(os.environ.get("SLURM_TEST_KEEP"))
        self.start_timeout = start_timeout
        self.dir: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ setup
    def _write_files(self) -> None:
        d = self.dir
        assert d is not None
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (d / sub).mkdir(parents=True, exist_ok=True)
            (d / sub).chmod(0o755)  # munged wants its socket dir world-executable, not writable
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (d / "plugstack.conf").write_text("")
        self.munge_socket = d / "munge" / "munge.socket"
        ctld_port, slurmd_port = _free_ports(2)
        self.conf_path = d / "slurm.conf"
        self.conf_path.write_text(
            f"""\
# Private one-node test cluster written by tests/slurm/cluster.py
ClusterName=cascadetest
SlurmctldHost={self.nodename}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again
# (default 120 s); short here so the requeue test stays fast.
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/slurmd-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=100000
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
# Requeue support (the stage script requeues itself after a preemption checkpoint).
JobRequeue=1
MaxJobCount=10000
# Keep finished jobs visible to `scontrol show job` (no slurmdbd here).
MinJobAge=86400
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
OverTimeLimit=0
NodeName={self.nodename} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.nodename} Default=YES MaxTime=INFINITE State=UP
"""
        )
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf_path),
            # Never inherit job context from an outer Slurm allocation.
        }
        for k in list(self.env):
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.dir / "log" / f"{name}.stdout", "wb")  # noqa: SIM115
        try:
            self.procs[name] = subprocess.Popen(
                list(argv),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_for(self, what: str, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode} while waiting for {what}\n" + self.logs())
            if predicate():
                return
            time.sleep(0.2)
        raise SlurmError(f"timed out after {timeout}s waiting for {what}\n" + self.logs())

    def start(self) -> "SlurmCluster":
        missing = missing_requirements()
        if missing:
            raise SlurmError("missing: " + ", ".join(missing))
        # slurmstepd daemonises; make its orphans our children (not PID 1's, which in a
        # container may never reap them) so stop() can reap them: no <defunct> leftovers.
        self._subreaper = _set_child_subreaper(True)
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-test-", dir=self._base_dir))
        self.dir.chmod(0o755)  # jobs write their logs below it; munged wants no group/world write
        try:
            self._write_files()
            d = self.dir
            self._spawn(
                "munged",
                [
                    _which("munged"),
                    "-F",
                    f"--socket={self.munge_socket}",
                    f"--key-file={d}/munge/munge.key",
                    f"--pid-file={d}/munge/munged.pid",
                    f"--log-file={d}/log/munged.log",
                    f"--seed-file={d}/munge/munged.seed",
                    "--num-threads=4",
                ],
            )
            self._wait_for("munge socket", self.munge_socket.exists, 20)
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf_path)])
            self._wait_for("slurmctld", lambda: self._run_ok(["scontrol", "ping"], "UP"), self.start_timeout)
            self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.nodename, "-f", str(self.conf_path)])
            self._wait_for("node idle", self._node_idle, self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _run_ok(self, argv: Sequence[str], needle: str) -> bool:
        try:
            out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0 and needle in out.stdout

    def _node_idle(self) -> bool:
        try:
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
        except subprocess.TimeoutExpired:
            return False
        return bool(out) and all(s.rstrip("*") == "idle" for s in out)

    # --------------------------------------------------------------- teardown
    def our_pids(self) -> list[int]:
        """PIDs of every live process carrying this cluster's SLURM_CONF (daemons, steps, jobs)."""
        if self.dir is None:
            return []
        needle = f"SLURM_CONF={self.conf_path}".encode()
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                environ = (p / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                try:
                    stat = (p / "stat").read_text()
                except OSError:
                    continue
                if stat.rsplit(")", 1)[-1].split()[0] != "Z":
                    pids.append(int(p.name))
        return pids

    def job_pids(self, grace: float = 5.0) -> list[int]:
        """Processes of this cluster other than its daemons (slurmstepd, job scripts, ranks).

        Finished jobs' slurmstepd may need a moment to exit, so this waits up to ``grace``
        seconds for the list to become empty and returns what is left.
        """
        daemons = {p.pid for p in self.procs.values() if p.poll() is None}
        deadline = time.monotonic() + grace
        while True:
            left = []
            for pid in self.our_pids():
                if pid in daemons:
                    continue
                try:
                    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid in daemons and self.procs.get("slurmctld") and ppid == self.procs["slurmctld"].pid:
                    continue  # slurmctld's own helper (slurmscriptd)
                left.append(pid)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    @staticmethod
    def _reap_orphans(timeout: float = 5.0) -> None:
        """Reap slurmstepd processes that were re-parented to us (see start())."""
        me = os.getpid()
        deadline = time.monotonic() + timeout
        while True:
            orphans = []
            for p in Path("/proc").iterdir():
                if not p.name.isdigit():
                    continue
                try:
                    stat = (p / "stat").read_text()
                except OSError:
                    continue
                name = stat[stat.find("(") + 1 : stat.rfind(")")]
                fields = stat.rsplit(")", 1)[-1].split()
                if name == "slurmstepd" and int(fields[1]) == me:
                    orphans.append((int(p.name), fields[0]))
            for pid, state in orphans:
                if state == "Z":
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
            if not orphans or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    @staticmethod
    def _kill(pids: Iterable[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.dir is None:
            return
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:  # cancel every job of this private cluster, let slurmd clean up steps
                subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.run(
                    ["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i"], check=False
                ).stdout.strip():
                    time.sleep(0.3)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # Job steps and job processes daemonise away from us; they all carry our SLURM_CONF.
        leftovers = self.our_pids()
        if leftovers:
            self._kill(leftovers, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.our_pids():
                time.sleep(0.1)
            self._kill(self.our_pids(), signal.SIGKILL)
        self._reap_orphans()
        if getattr(self, "_subreaper", False):
            _set_child_subreaper(False)
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir_removed = not self.keep

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- helpers
    @property
    def job_dir(self) -> Path:
        """A scratch directory for job logs and files (removed on exit)."""
        assert self.dir is not None
        return self.dir / "jobs"

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command against this cluster (SLURM_CONF set); text output captured."""
        full_env = {**self.env, **(env or {})}
        out = subprocess.run(
            list(argv), env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, argv))} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def sbatch(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> int:
        """Submit with ``sbatch --parsable ARGS``; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd or self.job_dir)
        return int(out.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, StdOut, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if out.returncode != 0:
            return {}
        info: dict[str, str] = {}
        # key=value pairs separated by spaces; values may not contain '=' except Command/WorkDir
        for m in re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)", out.stdout.strip()):
            info[m.group(1)] = m.group(2)
        return info

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: int, timeout: float = 60) -> str:
        """Wait until the job reaches a terminal state; returns it (e.g. COMPLETED, FAILED)."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(0.3)
        raise SlurmError(f"job {job_id} still {state} after {timeout}s\n{self.job_info(job_id)}")

    def wait_state(self, job_id: int, states: Iterable[str], timeout: float = 60) -> str:
        wanted = set(states)
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in wanted:
                return state
            time.sleep(0.2)
        raise SlurmError(f"job {job_id} never reached {wanted} (last {state})")

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until no job of this cluster is pending or running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                return
            time.sleep(0.3)
        raise SlurmError("jobs still queued:\n" + self.run(["squeue"], check=False).stdout)

    def logs(self) -> str:
        if self.dir is None:
            return ""
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            try:
                tail = f.read_text(errors="replace").splitlines()[-30:]
            except OSError:
                continue
            parts.append(f"==> {f.name} <==\n" + "\n".join(tail))
        return "\n".join(parts)
