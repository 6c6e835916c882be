"""Fixtures for the Slurm launch tests: a private one-node Slurm cluster (see cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import CPU_SBATCH_ARGS, TRAINER_CMD, SlurmCluster, missing_requirements  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs a real (private, one-node) Slurm: slurm-wlm + munge, root")
    config.addinivalue_line("markers", "slow: slow test (seconds to minutes)")


def _skip_reason() -> str | None:
    missing = missing_requirements()
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "private Slurm unavailable (missing: " + ", ".join(missing) + ")"
    # Root with apt: the environment is expected to provide them (.ci/run installs them),
    # so a missing package is a failure, not a silent skip.
    return "FAIL:" + ", ".join(missing)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = _skip_reason()
    if reason and reason.startswith("FAIL:"):
        pytest.fail(
            f"missing {reason[5:]}; run: apt-get install -y slurm-wlm munge shellcheck", pytrace=False
        )
    if reason:
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster
    leftovers = cluster.our_pids()
    assert not leftovers, f"processes of the private Slurm survived teardown: {leftovers}"


@pytest.fixture
def cluster(slurm_cluster):
    """The session cluster, checked idle before and after each test (nothing left running)."""
    slurm_cluster.wait_idle(timeout=30)
    yield slurm_cluster
    # Whatever a test left queued or running is cancelled so the next test starts clean.
    if slurm_cluster.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
        slurm_cluster.run(["scancel", "--user=root"], check=False)
        slurm_cluster.wait_idle(timeout=30)
    job_pids = slurm_cluster.job_pids()
    assert not job_pids, f"job processes still alive after the test: {job_pids}"


@pytest.fixture
def trainer_cmd() -> str:
    return TRAINER_CMD


@pytest.fixture
def cascade(cluster, trainer_cmd):
    """A fake 3-stage cascade: config file, output dir and the environment to submit with."""
    work = Path(tempfile.mkdtemp(prefix="cascade-", dir=cluster.job_dir))
    work.chmod(0o755)
    out = work / "out"
    cfg = work / "cascade.json"
    cfg.write_text(json.dumps({"stages": ["sft", "math", "code"], "out": str(out), "steps": 3, "step_time": 0.1}))
    env = {
        "MEGATRON_CASCADE_CMD": trainer_cmd,
        "SBATCH_EXTRA_ARGS": CPU_SBATCH_ARGS,
        "LOG_DIR": str(work / "logs"),
        "MAX_REQUEUES": "3",
    }
    return {"dir": work, "config": cfg, "out": out, "logs": work / "logs", "env": env}
