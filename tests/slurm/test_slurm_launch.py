"""Launch tests against a private one-node Slurm: stage.sbatch, submit_cascade.sh, requeue."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cluster import CPU_SBATCH_ARGS, SLURM_DIR

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STAGE_SCRIPT = SLURM_DIR / "stage.sbatch"
SUBMIT = SLURM_DIR / "submit_cascade.sh"


def events(out: Path, stage: str) -> list[dict]:
    f = out / stage / "events.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def submit_stage(cluster, cascade, stage: str, *overrides: str, extra: tuple[str, ...] = ()) -> int:
    """sbatch stage.sbatch directly (what submit_cascade.sh does for one stage)."""
    return cluster.sbatch(
        [
            f"--job-name={stage}",
            f"--output={cascade['logs']}/%x_%j.log",
            *CPU_SBATCH_ARGS.split(),
            *extra,
            str(STAGE_SCRIPT),
            str(cascade["config"]),
            stage,
            *overrides,
        ],
        env=cascade["env"],
        cwd=cascade["dir"],
    )


def log_of(cluster, job: int) -> str:
    path = cluster.job_info(job).get("StdOut", "")
    return Path(path).read_text(errors="replace") if path and Path(path).exists() else f"<no log {path!r}>"


def run_submit(cluster, cascade, *overrides: str) -> tuple[dict[str, int], subprocess.CompletedProcess]:
    res = cluster.run(
        ["bash", str(SUBMIT), str(cascade["config"]), *overrides], env=cascade["env"], cwd=cascade["dir"]
    )
    jobs = {}
    lines = res.stdout.strip().splitlines()
    for line in lines[:-1]:
        stage, job = line.split()
        jobs[stage] = int(job)
    assert lines[-1].startswith(("submitted ", "all ")), res.stdout
    return jobs, res


# (a) --------------------------------------------------------------------------------------
def test_srun_two_tasks_rank_env(cluster, cascade):
    res = cluster.run(
        ["srun", "--ntasks-per-node=2", "bash", "-c", "echo $SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS"]
    )
    assert sorted(res.stdout.split("\n")[:2]) == ["0 0 2", "1 1 2"], res.stdout

    (cascade["logs"]).mkdir(exist_ok=True)
    job = submit_stage(cluster, cascade, "sft")
    assert cluster.wait_job(job, timeout=60) == "COMPLETED", log_of(cluster, job)
    starts = [e for e in events(cascade["out"], "sft") if e["event"] == "start"]
    assert sorted(int(e["RANK"]) for e in starts) == [0, 1]
    assert sorted(int(e["LOCAL_RANK"]) for e in starts) == [0, 1]
    assert {e["WORLD_SIZE"] for e in starts} == {"2"}
    assert {e["MASTER_ADDR"] for e in starts} == {cluster.nodename}
    (port,) = {int(e["MASTER_PORT"]) for e in starts}
    assert 15000 <= port < 30000
    assert {e["job"] for e in starts} == {str(job)}
    assert (cascade["logs"] / f"sft_{job}.log").exists()
    assert "stage sft complete" in log_of(cluster, job)


# (b) --------------------------------------------------------------------------------------
def test_submit_chains_stages_and_skips_complete(cluster, cascade):
    (cascade["out"] / "sft").mkdir(parents=True)
    (cascade["out"] / "sft" / "DONE").write_text("3")  # the fake trainer's "complete" marker

    jobs, res = run_submit(cluster, cascade)
    assert list(jobs) == ["math", "code"], res.stdout
    assert "sft: complete, skipped" in res.stderr
    math_info, code_info = cluster.job_info(jobs["math"]), cluster.job_info(jobs["code"])
    assert math_info["JobName"] == "math" and code_info["JobName"] == "code"
    assert f"afterok:{jobs['math']}" in code_info["Dependency"]

    for stage in ("math", "code"):
        assert cluster.wait_job(jobs[stage], timeout=60) == "COMPLETED", log_of(cluster, jobs[stage])
    assert events(cascade["out"], "sft") == []  # never run
    math_end = max(e["time"] for e in events(cascade["out"], "math") if e["event"] == "exit")
    code_start = min(e["time"] for e in events(cascade["out"], "code") if e["event"] == "start")
    assert math_end < code_start
    assert (cascade["logs"] / f"code_{jobs['code']}.log").exists()

    # Everything complete now: a resubmit submits nothing.
    (cascade["out"] / "sft" / "DONE").write_text("3")
    jobs2, res2 = run_submit(cluster, cascade)
    assert jobs2 == {} and res2.stdout.strip().startswith("all 3 stages complete"), res2.stdout


# (c) --------------------------------------------------------------------------------------
# USR1 with the real trainer: test_slurm_real_trainer.py; here the TERM path (relayed as USR1).
@pytest.mark.parametrize("sig", ["TERM"])
def test_preemption_signal_checkpoints_requeues_and_finishes(cluster, cascade, sig):
    cascade["logs"].mkdir(exist_ok=True)
    job = submit_stage(cluster, cascade, "sft", "hold_stage=sft")
    out = cascade["out"]
    wait_for(lambda: len([e for e in events(out, "sft") if e["event"] == "holding"]) == 2, 60, "both ranks at step 1")

    # What --signal=B:USR1@N does before the time limit: USR1 to the batch shell only.
    cluster.run(["scancel", f"--signal={sig}", "--batch", str(job)])

    assert cluster.wait_job(job, timeout=90) == "COMPLETED", log_of(cluster, job)
    info = cluster.job_info(job)
    assert info["Restarts"] == "1", info
    ev = events(out, "sft")
    exits = [(e["restart"], e["code"]) for e in ev if e["event"] == "exit"]
    assert sorted(exits) == [(0, 75), (0, 75), (1, 0), (1, 0)], ev
    assert {e["step"] for e in ev if e["event"] == "start" and e["restart"] == 1} == {1}  # resumed
    log = log_of(cluster, job)
    assert f"received SIG{sig}" in log
    assert "requeueing job" in log
    assert "stage sft complete" in log
    assert log.count("stage=sft config=") == 2, log  # both runs appended to one log


def test_requeue_is_bounded(cluster, cascade):
    cascade["logs"].mkdir(exist_ok=True)
    cascade["env"]["MAX_REQUEUES"] = "0"
    job = submit_stage(cluster, cascade, "sft", "hold_stage=sft")
    wait_for(
        lambda: len([e for e in events(cascade["out"], "sft") if e["event"] == "holding"]) == 2, 60, "ranks holding"
    )
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    assert cluster.wait_job(job, timeout=60) == "FAILED"
    info = cluster.job_info(job)
    assert info["Restarts"] == "0" and info["ExitCode"] == "75:0", info
    assert "not requeueing" in log_of(cluster, job)


def test_time_limit_signal_from_header_requeues(cluster, cascade):
    """The real path: --signal=B:USR1@N before --time runs out (slurmctld checks every ~30 s)."""
    cascade["logs"].mkdir(exist_ok=True)
    job = submit_stage(
        cluster, cascade, "sft", "hold_stage=sft", "hold_timeout=100", extra=("--time=1", "--signal=B:USR1@55")
    )
    assert cluster.wait_job(job, timeout=120) == "COMPLETED", log_of(cluster, job)
    assert cluster.job_info(job)["Restarts"] == "1"
    log = log_of(cluster, job)
    assert "received SIGUSR1" in log and "requeueing job" in log and "stage sft complete" in log, log


def test_cancelled_stage_is_not_requeued_and_cancels_dependents(cluster, cascade):
    jobs, _ = run_submit(cluster, cascade, "hold_stage=sft", "hold_timeout=60")
    out = cascade["out"]
    wait_for(lambda: len([e for e in events(out, "sft") if e["event"] == "holding"]) == 2, 60, "ranks holding")
    cluster.run(["scancel", str(jobs["sft"])])
    assert cluster.wait_job(jobs["sft"], timeout=60) == "CANCELLED"
    assert cluster.wait_job(jobs["code"], timeout=60) == "CANCELLED"
    assert cluster.job_info(jobs["math"])["JobState"] == "CANCELLED"
    assert cluster.job_info(jobs["sft"])["Restarts"] == "0"
    time.sleep(2)
    assert cluster.job_info(jobs["sft"])["JobState"] == "CANCELLED"  # not requeued after the fact


# (d) --------------------------------------------------------------------------------------
def test_failing_stage_cancels_dependents(cluster, cascade):
    jobs, res = run_submit(cluster, cascade, "fail_stage=math")
    assert list(jobs) == ["sft", "math", "code"], res.stdout
    assert cluster.wait_job(jobs["sft"], timeout=60) == "COMPLETED", log_of(cluster, jobs["sft"])
    assert cluster.wait_job(jobs["math"], timeout=60) == "FAILED", log_of(cluster, jobs["math"])
    assert cluster.wait_job(jobs["code"], timeout=60) == "CANCELLED", cluster.job_info(jobs["code"])
    assert events(cascade["out"], "code") == []
    log = log_of(cluster, jobs["math"])
    assert "stage math FAILED: trainer exit code 3" in log, log
    assert "failed at step 1 (fail_stage)" in log, log  # the rank's stderr is in the log
    assert cluster.job_info(jobs["math"])["ExitCode"] == "3:0"

    # Resubmitting (after the "fix") skips the completed stage and runs the rest.
    jobs2, _ = run_submit(cluster, cascade)
    assert list(jobs2) == ["math", "code"]
    assert cluster.wait_job(jobs2["code"], timeout=60) == "COMPLETED", log_of(cluster, jobs2["code"])


# (e) --------------------------------------------------------------------------------------
def test_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail("shellcheck missing: apt-get install -y shellcheck", pytrace=False)
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    root = SLURM_DIR.parent
    scripts = sorted(p for folder in (SLURM_DIR, root / "scripts", root / "benchmarks") for p in folder.iterdir()
                     if p.suffix in {".sh", ".sbatch"})
    assert {p.name for p in scripts} >= {"stage.sbatch", "submit_cascade.sh", "install_gpu.sh", "gpu_check.sh"}
    res = subprocess.run(["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
