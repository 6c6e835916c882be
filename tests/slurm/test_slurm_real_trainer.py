"""The real trainer under a private one-node Slurm: the CI-sized tiny cascade
(examples/tiny_cascade/ci.yaml) submitted with slurm/submit_cascade.sh, one job per stage, two
gloo ranks per job.

(a) the chain runs every stage as its own job, in order, 2 tasks each, and completes the manifest;
(b) a stage job that gets its preemption signal mid-stage checkpoints, exits 75, is requeued,
    resumes and finishes with the same manifest (stage statuses, eval per stage and domain) as
    the undisturbed chain of (a);
(c) a stage that fails at run time stops the chain: dependents cancelled, the trainer's error and
    "stage X FAILED" in the job log.

The chain of (a) runs once per module; (b) and (c) start from copies of its run directory with
the later stages removed, so each of them runs only the stages it is about.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cluster import CPU_SBATCH_ARGS, REPO, SLURM_DIR

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SUBMIT = SLURM_DIR / "submit_cascade.sh"
CI_CONFIG = REPO / "examples" / "tiny_cascade" / "ci.yaml"
STAGES = ["sft", "if_rl", "math_rl", "mopd", "code_rl"]  # ci.yaml, in cascade order


def real_trainer_cmd() -> str:
    """The CLI of the Python running the tests (its venv's console script), never a fixed path."""
    script = Path(sys.executable).with_name("megatron-cascade")
    if script.exists():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m megatron_cascade.cli"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def log_of(cluster, job: int) -> str:
    path = cluster.job_info(job).get("StdOut", "")
    return Path(path).read_text(errors="replace") if path and Path(path).exists() else f"<no log {path!r}>"


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def metric_lines(out: Path, stage: str) -> int:
    f = out / "stages" / stage / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def submit(cluster, work: Path, out: Path, config: Path = CI_CONFIG, *overrides: str) -> dict[str, int]:
    """slurm/submit_cascade.sh CONFIG output_dir=OUT [overrides]; returns {stage: job id}."""
    env = {
        "MEGATRON_CASCADE_CMD": real_trainer_cmd(),
        "SBATCH_EXTRA_ARGS": CPU_SBATCH_ARGS,
        "LOG_DIR": str(work / "logs"),
        "MAX_REQUEUES": "2",
    }
    # The trainer stops a stage whose next step would end inside checkpoint.time_limit_margin_s of the
    # job's time limit (default 600 s: the whole of these 10-minute CPU jobs); these tests are about
    # chaining and signals, so keep a margin that fits their steps.
    margin = "checkpoint.time_limit_margin_s=60"
    res = cluster.run(["bash", str(SUBMIT), str(config), f"output_dir={out}", margin, *overrides], env=env,
                      cwd=work, timeout=120)
    lines = res.stdout.strip().splitlines()
    assert lines and lines[-1].startswith(("submitted ", "all ")), res.stdout + res.stderr
    return {stage: int(job) for stage, job in (line.split() for line in lines[:-1])}


def copy_run(src: Path, dst: Path, keep: list[str]) -> None:
    """A copy of run directory ``src`` in which only the stages ``keep`` happened."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report.png"))
    data = manifest(dst)
    for stage in list(data["stages"]):
        if stage not in keep:
            del data["stages"][stage]
            shutil.rmtree(dst / "stages" / stage, ignore_errors=True)
    (dst / "manifest.json").write_text(json.dumps(data, indent=2, sort_keys=True))
    shutil.rmtree(dst / "tensorboard", ignore_errors=True)


# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(slurm_cluster):
    """The whole CI cascade submitted once (the undisturbed reference for the other tests)."""
    slurm_cluster.wait_idle(timeout=30)
    work = Path(tempfile.mkdtemp(prefix="real-chain-", dir=slurm_cluster.job_dir))
    work.chmod(0o755)
    out = work / "run"
    jobs = submit(slurm_cluster, work, out)
    assert list(jobs) == STAGES
    states = {stage: slurm_cluster.wait_job(job, timeout=240) for stage, job in jobs.items()}
    yield {"work": work, "out": out, "jobs": jobs, "states": states}
    if slurm_cluster.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
        slurm_cluster.run(["scancel", "--user=root"], check=False)
        slurm_cluster.wait_idle(timeout=30)


def test_real_cascade_runs_stage_jobs_in_order_with_two_tasks(cluster, chain):
    jobs = chain["jobs"]
    logs = {stage: log_of(cluster, job) for stage, job in jobs.items()}
    assert all(state == "COMPLETED" for state in chain["states"].values()), f"{chain['states']}\n" + "\n".join(
        logs.values())

    infos = {stage: cluster.job_info(job) for stage, job in jobs.items()}
    for previous, stage in zip(STAGES, STAGES[1:]):
        assert f"afterok:{jobs[previous]}" in infos[stage]["Dependency"] or infos[stage]["Dependency"] == "(null)"
        # Slurm's times have 1 s resolution: the next stage never starts before the previous one ends.
        assert infos[previous]["EndTime"] <= infos[stage]["StartTime"], (previous, stage, infos)
    for stage, log in logs.items():
        assert infos[stage]["JobName"] == stage and infos[stage]["NumTasks"] == "2", infos[stage]
        assert f"stage={stage} config={CI_CONFIG}" in log, log
        assert "tasks=2 (per node 2" in log, log
        assert "Layout(world_size=2, tp=1, pp=1, cp=1, ep=1, etp=1, dp=2" in log, log  # the trainer's rank 0
        assert f"stage {stage} complete" in log, log
        for other in STAGES:  # this job ran its own stage only; the earlier ones were skipped
            if STAGES.index(other) < STAGES.index(stage):
                assert f"stage {other} is complete; skipping" in log, log
        assert (chain["work"] / "logs" / f"{stage}_{jobs[stage]}.log").exists()
    # The trainer's own record of the order: each stage's metrics were all written before the next began.
    ends = [(chain["out"] / "stages" / s / "final").stat().st_mtime for s in STAGES]
    assert ends == sorted(ends)

    data = manifest(chain["out"])
    assert data["stage_order"] == STAGES
    assert {s: r["status"] for s, r in data["stages"].items()} == {s: "complete" for s in STAGES}
    for stage in STAGES:
        assert set(data["stages"][stage]["eval"]) == {"math", "instruction_following", "code"}
    statuses = cluster.run([*shlex.split(real_trainer_cmd()), "stages", str(CI_CONFIG),
                            f"output_dir={chain['out']}"]).stdout
    assert statuses.split() == [w for s in STAGES for w in (s, "complete")], statuses
    # Everything complete: a resubmission submits nothing.
    assert submit(cluster, chain["work"], chain["out"]) == {}


def test_real_stage_preempted_mid_stage_requeues_and_matches_undisturbed_run(cluster, chain):
    assert all(state == "COMPLETED" for state in chain["states"].values()), chain["states"]
    work = Path(tempfile.mkdtemp(prefix="real-preempt-", dir=cluster.job_dir))
    out = work / "run"
    stage = "code_rl"
    copy_run(chain["out"], out, keep=STAGES[:-1])
    jobs = submit(cluster, work, out)
    assert list(jobs) == [stage]
    job = jobs[stage]

    # Mid-stage: once rank 0 has passed the earlier (complete) stages it watches for the signal
    # and is about to build code_rl (6 steps). Deliver the preemption signal the way
    # --signal=B:USR1@N does: to the batch shell, which relays it through srun (and repeats it
    # every RESIGNAL_INTERVAL s for a rank that was not yet watching).
    wait_for(lambda: "stage mopd is complete; skipping" in log_of(cluster, job), 180,
             "the job to reach its stage")
    assert metric_lines(out, stage) < 5, "the stage is about to finish: too late to preempt it"
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])

    assert cluster.wait_job(job, timeout=240) == "COMPLETED", log_of(cluster, job)
    info = cluster.job_info(job)
    log = log_of(cluster, job)
    assert info["Restarts"] == "1", (info, log)
    assert "received SIGUSR1" in log and "will checkpoint at the end of this step" in log, log
    assert f"stage {stage}: checkpointed at step" in log and "exiting with 75" in log, log
    assert "requeueing job" in log, log
    resumed = re.search(rf"stage {stage}: resuming from \S+ \(step (\d+)\)", log)
    assert resumed and 1 <= int(resumed.group(1)) < 6, log  # mid-stage
    assert f"stage {stage} complete" in log, log
    assert log.count(f"stage={stage} config=") == 2, log  # both runs appended to one log

    # The interrupted run ends exactly where the undisturbed one did.
    got, want = manifest(out), manifest(chain["out"])
    assert got["stage_order"] == want["stage_order"]
    assert {s: r["status"] for s, r in got["stages"].items()} == {s: "complete" for s in STAGES}
    assert {s: r["eval"] for s, r in got["stages"].items()} == {s: r["eval"] for s, r in want["stages"].items()}
    assert got["stages"] == want["stages"]


def test_real_failing_stage_stops_the_chain(cluster, chain):
    assert all(state == "COMPLETED" for state in chain["states"].values()), chain["states"]
    work = Path(tempfile.mkdtemp(prefix="real-fail-", dir=cluster.job_dir))
    out = work / "run"
    copy_run(chain["out"], out, keep=["sft", "if_rl"])
    # math_rl also trains on a domain whose train file holds only malformed rows: valid config, refused
    # by that stage's job before it writes anything (and by no other stage's).
    broken = work / "broken_train.jsonl"
    broken.write_text('{"prompt": "1+1=", "answer": "2"\nnot json at all\n[1, 2, 3]\n')
    config = work / "ci_broken.yaml"
    config.write_text(
        f"defaults: [{CI_CONFIG}]\n"
        f"domains:\n  broken:\n    train: {broken}\n    reward: {{name: math}}\n"
    )
    jobs = submit(cluster, work, out, config, "stages.math_rl.domains={broken: 1.0}")
    assert list(jobs) == ["math_rl", "mopd", "code_rl"]
    assert cluster.wait_job(jobs["math_rl"], timeout=180) == "FAILED", log_of(cluster, jobs["math_rl"])
    for stage in ("mopd", "code_rl"):
        assert cluster.wait_job(jobs[stage], timeout=60) == "CANCELLED", cluster.job_info(jobs[stage])
        assert not (work / "logs" / f"{stage}_{jobs[stage]}.log").exists()  # never started
    log = log_of(cluster, jobs["math_rl"])
    assert "the run cannot start; nothing was written" in log, log  # the trainer's preflight refuses
    assert f"domains.broken.train: {broken}:1: not valid JSON" in log and "(3 of the first 3 rows bad)" in log, log
    assert re.search(r"stage math_rl FAILED: trainer exit code [1-9]", log), log  # the script's verdict
    assert cluster.job_info(jobs["math_rl"])["Restarts"] == "0"
    data = manifest(out)
    assert sorted(data["stages"]) == ["if_rl", "sft"]
    for stage in ("mopd", "code_rl"):
        assert not (out / "stages" / stage).exists()
