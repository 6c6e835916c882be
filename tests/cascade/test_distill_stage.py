"""The ``distill`` stage type (on-policy distillation without rewards), added as one file plus a
registry entry (issue 12's plug-in proof): a tiny sft -> distill cascade through the CLI.

The distilled domain's reward is a function that raises on every call: had the stage built or
called a reward, the step would stop on ``rewards.max_error_frac``. The stage trains (reverse KL
to its teacher, lengths, finish rates logged; no reward metric), is recorded in the manifest, and
the dry run plans its resident teacher."""

from __future__ import annotations

import json
import math
import os

from cascade_fixtures import TINY, read_manifest, run_cli

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 48, ffn_hidden_size: 96}}
training: {{micro_batch_size: 8}}
rollout: {{max_new_tokens: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
domains:
  math: {{reward: {{name: "exploding_reward:explode"}}}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 8, domains: {{math: 1.0}}}}
  - {{name: distill, type: distill, steps: 2, prompts_per_step: 8, samples_per_prompt: 2,
      domains: {{math: 1.0}}, teachers: {{math: sft}}}}
"""


def _config(tmp_path, text: str = CONFIG) -> tuple[str, str]:
    out = str(tmp_path / "run")
    path = str(tmp_path / "distill.yaml")
    with open(path, "w") as f:
        f.write(text.format(tiny=TINY, out=out))
    return path, out


def test_distill_stage_trains_without_any_reward(tmp_path):
    config, out = _config(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    result = run_cli("run", config, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    manifest = read_manifest(out)
    assert manifest["stages"]["distill"]["status"] == "complete"
    assert manifest["stages"]["distill"]["type"] == "distill"
    with open(os.path.join(out, "stages", "distill", "metrics.jsonl")) as f:
        distill = [json.loads(line) for line in f]
    assert len(distill) == 2
    for row in distill:
        assert math.isfinite(row["reverse_kl_mean"])
        assert "reverse_kl/domain/math" in row and "reverse_kl/teacher/sft" in row
        assert row["response/length_mean"] > 0 and "time/teacher_s" in row
        assert not any(k.startswith("reward/") for k in row), sorted(row)


def test_distill_dry_run_plans_the_teacher(tmp_path):
    config, _ = _config(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    result = run_cli("run", config, "--dry-run", env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("distill"))
    assert "teacher" in line, line


def test_teachers_are_required(tmp_path):
    config, _ = _config(tmp_path, CONFIG.replace(", teachers: {{math: sft}}", ""))
    result = run_cli("run", config, "--dry-run")
    assert result.returncode != 0
    assert "distill needs a teacher for domain 'math'" in result.stdout
