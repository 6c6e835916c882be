"""The real trainer (CLI, one process) under a Slurm job whose end time is too close for another
step: it checkpoints after the step, exits 75 (requeue) with the reason in its log, and a rerun
resumes from that checkpoint and finishes. The end time comes from ``SLURM_JOB_END_TIME`` as
Slurm >= 23.02 sets it; the decision itself (learned step times) is unit-tested in test_time_limit.py.
"""

from __future__ import annotations

import os
import time

from cascade_fixtures import TINY, run_cli

from megatron_cascade.cascade.manifest import checkpoint_root, stage_status
from megatron_cascade.cascade.runtime import EXIT_REQUEUE
from megatron_cascade.training.resume_checkpoint import read_latest

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 48, ffn_hidden_size: 96}}
training: {{micro_batch_size: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0, keep_last: 2}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: 3, prompts_per_step: 8, domains: {{math: 1.0}}}}
"""


def _no_slurm_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def test_stops_before_the_job_end_then_resumes(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=out))
    # The job ends in an hour and the trainer keeps an hour free for checkpoint + exit: no step fits.
    env = {**_no_slurm_env(), "SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(time.time()) + 3600)}
    first = run_cli("run", str(config), "checkpoint.time_limit_margin_s=3600", env=env, timeout=300)
    assert first.returncode == EXIT_REQUEUE, first.stdout[-3000:]
    assert "job ends in" in first.stdout and "checkpointing now" in first.stdout, first.stdout[-3000:]
    latest = read_latest(checkpoint_root(str(out), "sft"))
    assert latest is not None and latest.endswith("step_00000001"), latest
    # Requeued (here: rerun without a time limit): resumes at step 1 and completes the stage.
    second = run_cli("run", str(config), env=_no_slurm_env(), timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resuming from" in second.stdout and "(step 1)" in second.stdout, second.stdout[-3000:]
    assert stage_status(str(out), "sft") == "complete"
