"""A run that trains with context parallelism and generates on a decode layout, end to end on CPU:
two processes under torchrun, ``parallel.context_parallel_size=2`` (the training step, the log-prob
passes and SFT split every packed sequence over the two ranks) and ``rollout.parallel`` at TP=1 (two
decode replicas, each holding the whole model, refit in memory after every optimizer step). The
GRPO stage is configured as the recipe's long-context stage (padding-free packing); every stage
completes, evaluates on the decode copy, and logs its refits. A second run decodes on a copy with
pipeline stages (``rollout.parallel.pipeline_model_parallel_size=2``)."""

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
model: {{num_layers: 2, hidden_size: 48, ffn_hidden_size: 96}}
parallel: {{context_parallel_size: 2}}
training: {{micro_batch_size: 8, sequence_packing: true, max_tokens_per_row: 512}}
rollout: {{max_new_tokens: 10, filter_uninformative_groups: false, parallel: {{tensor_model_parallel_size: 1}}}}
eval: {{max_prompts: 4}}
checkpoint: {{every_steps: 1, keep_last: 1}}
logging: {{progress_bar: false}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 8, domains: {{math: 1.0}}}}
  - {{name: long_context_rl, type: grpo, steps: 2, prompts_per_step: 4, samples_per_prompt: 4,
      domains: {{math: 1.0}}}}
"""


def test_context_parallel_training_with_a_decode_layout_runs_every_stage(tmp_path):
    out = str(tmp_path / "run")
    config = tmp_path / "cp2.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_cascade.cli", "run", str(config)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    for name in ("sft", "long_context_rl"):
        assert manifest["stages"][name]["status"] == "complete", name
        assert set(manifest["stages"][name]["eval"]) == {"math", "instruction_following", "code"}
    with open(os.path.join(out, "stages", "long_context_rl", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["time/refit_s"] > 0  # the copy was refit before the step's generation
        assert metrics["sequences"] == 16 and metrics["tokens"] > 0  # trained on every sample, CP-split
        # 4 prompts x 4 samples over two decode replicas: 8 requests decode at once on each.
        assert metrics["generation/peak_requests"] == 8


PIPELINE_CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 2, hidden_size: 48, ffn_hidden_size: 96, tie_embeddings: true}}
training: {{micro_batch_size: 8}}
rollout: {{max_new_tokens: 10, filter_uninformative_groups: false, parallel: {{pipeline_model_parallel_size: 2}}}}
eval: {{max_prompts: 4}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: rl, type: grpo, steps: 2, prompts_per_step: 4, samples_per_prompt: 4, domains: {{math: 1.0}}}}
"""


def test_a_decode_layout_with_pipeline_stages_runs_a_stage(tmp_path):
    """Two processes train at DP=2 and decode on a PP=2 copy (one pipeline; tied embeddings, so the
    last stage's output weight is refit from the embedding): the GRPO stage generates, trains on
    every sample, parks the training state and evaluates on the copy."""
    out = str(tmp_path / "run")
    config = tmp_path / "pp2.yaml"
    config.write_text(PIPELINE_CONFIG.format(tiny=TINY, out=out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_cascade.cli", "run", str(config)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f)["stages"]["rl"]["status"] == "complete"
    with open(os.path.join(out, "stages", "rl", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["time/refit_s"] > 0 and metrics["time/offload_s"] > 0
        assert metrics["sequences"] == 16 and metrics["generation/peak_requests"] >= 8
