"""``rollout.adapt_expected_response_fraction``: from a stage's second step on, the paged engine
admits requests expecting the previous step's mean response length, not the configured fraction.

A random-init policy writes long answers (about 35 of 40 tokens) under a KV budget that a tight guess
of 0.5 overfills: with the fixed fraction the second step preempts as the first did; adapted (0.87,
logged as ``generation/expected_response_fraction``) it admits fewer at once and preempts less.
The tokens do not change (counter-based sampling noise): lengths and rewards are the same either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cascade_fixtures import TINY

pytestmark = pytest.mark.slow

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 2, hidden_size: 64, ffn_hidden_size: 128}}
rollout: {{max_new_tokens: 40, kv_block_size_tokens: 8, kv_cache_bytes: 524288, filter_uninformative_groups: false}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: rl, type: grpo, steps: 2, prompts_per_step: 8, samples_per_prompt: 4, domains: {{math: 1.0}}}}
"""


def _steps(tmp_path, adapt: bool) -> list[dict]:
    out = str(tmp_path / f"adapt_{adapt}")
    config = tmp_path / f"adapt_{adapt}.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=out))
    proc = subprocess.run([sys.executable, "-m", "megatron_cascade.cli", "run", str(config),
                           f"rollout.adapt_expected_response_fraction={str(adapt).lower()}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(os.path.join(out, "stages", "rl", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_admission_expects_the_previous_steps_mean_length(tmp_path):
    fixed, adapted = _steps(tmp_path, False), _steps(tmp_path, True)
    same = ("response/length_mean", "response/length_max", "finish/stop_frac", "reward/mean")
    for a, b in zip(fixed, adapted):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}  # the same tokens
    assert fixed[1]["generation/expected_response_fraction"] == adapted[0]["generation/expected_response_fraction"] == 0.5
    expected = adapted[0]["response/length_mean"] / 40
    assert expected > 0.6 and adapted[1]["generation/expected_response_fraction"] == pytest.approx(expected)
    assert fixed[1]["generation/preemptions"] > 0
    assert adapted[1]["generation/preemptions"] < fixed[1]["generation/preemptions"]
    assert adapted[1]["generation/recomputed_tokens"] < fixed[1]["generation/recomputed_tokens"]
