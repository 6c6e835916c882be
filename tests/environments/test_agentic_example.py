"""``examples/tiny_cascade/agentic.yaml``, CI-sized: a short SFT on the calculator tool traces, then the
multi-turn GRPO stage in the ``tool_calling`` environment through the CLI. The SFT'd model calls the
tool (more than one turn per episode on average), and the stage logs the episode metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENTIC = os.path.join(REPO, "examples", "tiny_cascade", "agentic.yaml")
SHORT = ["stages.sft.steps=60", "stages.tool_rl.steps=2", "stages.tool_rl.prompts_per_step=4",
         "stages.tool_rl.samples_per_prompt=2", "stages.tool_mopd.steps=1", "stages.tool_mopd.prompts_per_step=4",
         "eval.max_prompts=4", "eval.samples=1", "logging.progress_bar=false", "logging.tensorboard=false"]


def test_agentic_example_runs_multi_turn_tool_episodes(tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megatron_cascade.cli", "run", AGENTIC, f"output_dir={out}", *SHORT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, start_new_session=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(os.path.join(out, "stages", "tool_rl", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert len(steps) == 2
    for m in steps:
        for key in ("episode/tool_calls_mean", "episode/tool_call_success_frac", "episode/reward_per_turn",
                    "reward/mean", "episode/timeouts"):
            assert key in m
    assert sum(m["episode/turns_mean"] for m in steps) / len(steps) > 1.0
    assert sum(m["episode/tool_calls_mean"] for m in steps) > 0
    assert sum(m["reward/errors"] for m in steps) == 0  # the reward reads the runner's record of each episode
    with open(os.path.join(out, "stages", "tool_mopd", "metrics.jsonl")) as f:
        (mopd,) = [json.loads(line) for line in f]
    assert mopd["episode/turns_mean"] >= 1.0 and "reverse_kl/teacher/tool_rl" in mopd
