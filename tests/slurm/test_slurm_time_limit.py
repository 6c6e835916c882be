"""The real trainer under a private one-node Slurm with a short ``--time``: rank 0 asks Slurm for
the job's end time (squeue; Debian 12's Slurm 22.05), the ranks agree, and when the next step plus
``checkpoint.time_limit_margin_s`` would pass the end the stage checkpoints after its step, exits 75
and slurm/stage.sbatch requeues the job: before the --signal lead time, which here comes too late
(10 s before the end). The margin is the whole 2-minute limit, so the stop comes at the end of the
first step however fast the machine runs (smaller margins let fast machines finish the tiny stage
inside the window they left: 4 steps inside 20 s on CI, then 60 steps inside 5 s here)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from cluster import REPO
from test_slurm_real_trainer import log_of, real_trainer_cmd, wait_for

from megatron_cascade.cascade.manifest import checkpoint_root
from megatron_cascade.training.resume_checkpoint import read_latest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = REPO / "examples" / "tiny_cascade" / "cascade.yaml"
CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 48, ffn_hidden_size: 96}}
training: {{micro_batch_size: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0, keep_last: 2, time_limit_margin_s: 120}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: 60, prompts_per_step: 8, domains: {{math: 1.0}}}}
"""


def test_trainer_checkpoints_and_requeues_before_the_time_limit(cluster):
    work = Path(tempfile.mkdtemp(prefix="time-limit-", dir=cluster.job_dir))
    work.chmod(0o755)
    out = work / "run"
    config = work / "c.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=out))
    env = {
        "MEGATRON_CASCADE_CMD": real_trainer_cmd(),
        # 2 minutes; the signal 10 s before the end (too late for a step plus a checkpoint).
        "SBATCH_EXTRA_ARGS": "--ntasks-per-node=2 --gpus-per-node=0 --time=2 --signal=B:USR1@10",
        "LOG_DIR": str(work / "logs"),
        "MAX_REQUEUES": "2",
    }
    res = cluster.run(["bash", str(REPO / "slurm" / "submit_cascade.sh"), str(config)], env=env, cwd=work,
                      timeout=120)
    job = int(res.stdout.strip().splitlines()[0].split()[1])
    cluster.wait_state(job, {"RUNNING"}, timeout=120)  # the 2-minute limit counts from here
    try:
        log = wait_for(lambda: (lambda text: text if "requeueing job" in text or "FAILED" in text else None)(
            log_of(cluster, job)), 150, "the time-limit checkpoint and requeue")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.job_info(job)}\n{log_of(cluster, job)}") from None
    cluster.run(["scancel", str(job)], check=False)  # the requeued rerun is not part of this test
    assert "end time from" in log and "job ends at" in log, log  # rank 0 learned the end time from Slurm
    assert "checkpointing now" in log and "exiting with 75" in log, log
    assert "received SIGUSR1" not in log, log  # the trainer stopped before the signal
    assert f"requeueing job {job}" in log, log
    latest = read_latest(checkpoint_root(str(out), "sft"))
    assert latest is not None and int(latest.rsplit("_", 1)[1]) == 1, latest  # stopped after its first step
    print(next(line for line in log.splitlines() if "end time from" in line))
