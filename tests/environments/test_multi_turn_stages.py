"""Multi-turn episodes in real stages at DP=2 (two gloo ranks, the whole cascade runner): a GRPO stage
and an MOPD stage (teacher: the SFT stage before them; teacher log-probs over whole episodes,
observations masked) on the scripted environment, which takes three turns whatever the tiny model samples. Both
stages train, and log the episode metrics, the same on both ranks (all-reduced). Held-out evaluation
runs episodes too (before: one response per prompt, scored without the environment's turn rewards)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 2, hidden_size: 32, ffn_hidden_size: 64}}
training: {{micro_batch_size: 16}}
rollout: {{max_new_tokens: 6}}
eval: {{max_prompts: 4, samples: 1}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
domains:
  math:
    reward: {{name: "scripted_env:parity"}}
    environment: {{name: "scripted_env:ScriptedEnv", kwargs: {{turns: 3}}, max_turns: 4, max_episode_tokens: 60}}
stages:
  - {{name: sft, type: sft, steps: 1, prompts_per_step: 4, domains: {{math: 1.0}}}}
  - {{name: rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 4, domains: {{math: 1.0}}}}
  - {{name: distill, type: mopd, steps: 1, prompts_per_step: 4, samples_per_prompt: 2, domains: {{math: 1.0}},
      teachers: {{math: sft}}}}
"""


def _cascade_worker(tmp: str) -> dict:
    import torch.distributed as dist

    from megatron_cascade.cascade.runner import run_cascade
    from megatron_cascade.config import load_config

    path = os.path.join(tmp, "run.yaml")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write(CONFIG.format(tiny=TINY, out=os.path.join(tmp, "run")))
    dist.barrier()
    code = run_cascade(load_config(path))
    with open(os.path.join(tmp, "run", "manifest.json")) as f:
        manifest = json.load(f)
    metrics = {}
    for stage in ("rl", "distill"):
        with open(os.path.join(tmp, "run", "stages", stage, "metrics.jsonl")) as f:
            metrics[stage] = [json.loads(line) for line in f]
    return {"code": code, "metrics": metrics, "eval": {s: manifest["stages"][s]["eval"] for s in manifest["stages"]}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("multi_turn"))
    here = os.path.dirname(os.path.abspath(__file__))
    return run_distributed(_cascade_worker, 2, tmp, timeout_s=420,
                           env={"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")})


def test_grpo_trains_on_multi_turn_episodes_at_dp2(ranks):
    assert [r["code"] for r in ranks] == [0, 0]
    steps = ranks[0]["metrics"]["rl"]
    assert len(steps) == 1
    for m in steps:
        assert m["episode/turns_mean"] > 2.0  # three turns unless a turn hit its budget
        assert m["episode/steps_mean"] >= 2.0 and m["episode/timeouts"] == 0 and m["episode/env_errors"] == 0
        assert m["batch/effective_prompts"] > 0 and m["grad_norm"] > 0  # informative groups were trained on
        assert 0.0 < m["episode/reward_per_turn"] < 1.0
    assert ranks[0]["metrics"] == ranks[1]["metrics"]


def test_mopd_distills_over_multi_turn_episodes_at_dp2(ranks):
    (m,) = ranks[0]["metrics"]["distill"]
    assert m["episode/turns_mean"] > 2.0
    assert m["reverse_kl/domain/math"] != 0.0 and m["grad_norm"] > 0


def test_evaluation_runs_episodes(ranks):
    """Every eval episode takes three steps at 0.25 each, plus the transcript's parity (0 or 1): an
    episode's score is 0.75 or 1.75. A single response scored alone would be 0 or 1."""
    for scores in ranks[0]["eval"].values():
        assert scores["math"] >= 0.75
    assert ranks[0]["eval"] == ranks[1]["eval"]
