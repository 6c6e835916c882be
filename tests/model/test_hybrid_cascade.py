"""The tiny cascade on a hybrid Mamba-2 / attention / MoE model, CI-sized: examples/tiny_cascade/hybrid.yaml
with its five stages (sft -> if_rl -> math_rl -> mopd -> code_rl) cut to a step or two each, through the
CLI as a user runs it. Every stage completes and is recorded; MOPD loads its teachers (hybrid
checkpoints of earlier stages); the report reads every stage's evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HYBRID = os.path.join(REPO, "examples", "tiny_cascade", "hybrid.yaml")
SHORT = """
defaults: [{hybrid}]
output_dir: {out}
model: {{hidden_size: 64, hybrid: {{mamba_head_dim: 16, mamba_state_dim: 16}},
        moe: {{ffn_hidden_size: 64, shared_expert_intermediate_size: 64}}}}
training: {{micro_batch_size: 8}}
rollout: {{max_new_tokens: 8}}
eval: {{max_prompts: 2, samples: 2}}
checkpoint: {{every_steps: 1, keep_last: 1}}
logging: {{progress_bar: false}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 8, domains: {{math: 1.0, instruction_following: 1.0, code: 1.0}}}}
  - {{name: if_rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 2,
      domains: {{instruction_following: 1.0}}}}
  - {{name: math_rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 2, domains: {{math: 1.0}}}}
  - {{name: mopd, type: mopd, steps: 1, prompts_per_step: 4, samples_per_prompt: 2,
      domains: {{math: 1.0, instruction_following: 1.0}}, teachers: {{math: math_rl, instruction_following: if_rl}}}}
  - {{name: code_rl, type: grpo, steps: 1, prompts_per_step: 2, samples_per_prompt: 2, domains: {{code: 1.0}}}}
"""
STAGES = ["sft", "if_rl", "math_rl", "mopd", "code_rl"]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "megatron_cascade.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"CLI timed out: {args}\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def test_tiny_hybrid_cascade_runs_every_stage(tmp_path):
    out = str(tmp_path / "run")
    config = tmp_path / "hybrid_ci.yaml"
    config.write_text(SHORT.format(hybrid=HYBRID, out=out))
    result = _cli("run", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["stage_order"] == STAGES
    for name in STAGES:
        record = manifest["stages"][name]
        assert record["status"] == "complete", name
        with open(os.path.join(out, record["final_weights"], "model_config.json")) as f:
            saved = json.load(f)["config"]
        assert saved["architecture"] == "hybrid" and saved["hybrid"]["layer_pattern"] == "M*ME"
        assert set(record["eval"]) == {"math", "instruction_following", "code"}
    assert manifest["stages"]["mopd"]["teachers"] == {"math": "math_rl", "instruction_following": "if_rl"}
    report = _cli("report", out)
    assert report.returncode == 0 and "code_rl" in report.stdout, report.stdout[-2000:]
