"""Dynamic sampling (``rollout.dynamic_sampling_max_rounds``): a GRPO step keeps generating groups on
further prompts until every data-parallel rank holds its share of informative groups, then trains
on exactly that many groups per rank (issue 12).

* A real two-rank (DP=2) GRPO step on the tiny model with a reward under which every even-answer
  prompt is uninformative: without dynamic sampling the step trains on fewer groups than
  ``prompts_per_step``; with it, on all of them, after more than one round, the same on both ranks.
* ``select_groups`` / ``merge_groups``: informative groups first in generation order, topped up with
  uninformative ones at the cap; the merged round's tensors are the picked groups'.
"""

from __future__ import annotations

import os

import torch

from megatron_cascade.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 2, hidden_size: 32, ffn_hidden_size: 64}}
training: {{micro_batch_size: 16}}
rollout: {{max_new_tokens: 8, dynamic_sampling_max_rounds: {rounds}}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 4, domains: {{math: 1.0}}}}
"""


def _half_informative(response: str, sample: dict) -> float:
    """Even answers: every response scores 1 (an uninformative group); odd: the text's parity."""
    if int(sample["answer"]) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 2)


def _step_worker(tmp: str, rounds: int):
    import torch.distributed as dist

    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import initialize_model_parallel

    out = os.path.join(tmp, f"r{rounds}")
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "run.yaml"), "w") as f:
            f.write(CONFIG.format(tiny=TINY, out=os.path.join(out, "run"), rounds=rounds))
    dist.barrier()
    cfg = load_config(os.path.join(out, "run.yaml"))
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    runner = StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0]))
    runner._build()
    runner.kind.rewards = {"math": _half_informative}
    metrics = runner._step(0)
    return {k: metrics[k] for k in ("batch/effective_prompts", "batch/effective_frac", "sampling/rounds",
                                    "sampling/groups_generated", "groups/informative_frac", "tokens")}


def test_dynamic_sampling_fills_the_batch_with_informative_groups(tmp_path):
    plain = run_distributed(_step_worker, 2, str(tmp_path), 1, timeout_s=300)
    dynamic = run_distributed(_step_worker, 2, str(tmp_path), 8, timeout_s=300)
    assert plain[0] == plain[1] and dynamic[0] == dynamic[1], "metrics are global: the same on both ranks"
    plain, dynamic = plain[0], dynamic[0]
    # Without dynamic sampling the filter leaves fewer than prompts_per_step groups to train on.
    assert plain["sampling/rounds"] == 1 and plain["sampling/groups_generated"] == 4
    assert plain["batch/effective_prompts"] < 4
    # With it: more rounds on further prompts (the untrained model's groups are ~20% informative:
    # 6 rounds here, stopping before the cap of 8), and a full batch of informative groups.
    assert 1 < dynamic["sampling/rounds"] < 8
    assert dynamic["sampling/groups_generated"] == 4 * dynamic["sampling/rounds"]
    assert dynamic["batch/effective_prompts"] == 4 and dynamic["batch/effective_frac"] == 1.0
    assert dynamic["tokens"] > plain["tokens"], "more groups in the loss: more loss tokens"


def _round(informative: list[bool], tag: int, G: int = 2):
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.stages.group_filter import GroupRound
    from megatron_cascade.rollout import RolloutBatch, RolloutSample, SamplingParams

    P = len(informative)
    examples = [Example("d", (tag, p), {"id": (tag, p)}, f"t:{p}") for p in range(P)]
    samples = [RolloutSample(p, g, [tag, p], response_ids=[tag, p, g]) for p in range(P) for g in range(G)]
    rewards = torch.tensor([[float(tag * 10 + p), float(tag * 10 + p) + float(informative[p])] for p in range(P)])
    return GroupRound(examples, RolloutBatch(samples, SamplingParams(n=G)), scores=rewards.flatten().double(),
                      errored=torch.zeros(P * G, dtype=torch.bool), rewards=rewards,
                      keep=torch.ones(P, G, dtype=torch.bool), informative=torch.tensor(informative))


def test_select_and_merge_groups():
    from megatron_cascade.stages.group_filter import merge_groups, select_groups

    rounds = [_round([True, False, False], 0), _round([False, True, True], 1)]
    assert select_groups(rounds, 3, informative_first=False) == [(0, 0), (0, 1), (0, 2)]
    picks = select_groups(rounds, 3, informative_first=True)
    assert picks == [(0, 0), (1, 1), (1, 2)]
    merged = merge_groups(rounds, picks)
    assert [e.row["id"] for e in merged.examples] == [(0, 0), (1, 1), (1, 2)]
    assert merged.informative.all()
    torch.testing.assert_close(merged.rewards, torch.tensor([[0.0, 1.0], [11.0, 12.0], [12.0, 13.0]]))
    assert [s.prompt_index for s in merged.rollouts] == [0, 0, 1, 1, 2, 2]
    assert [s.response_ids for s in merged.rollouts][2] == [1, 1, 0]
    assert merged.sample_domains == ["d"] * 6
    # The cap reached with too few informative groups: topped up with the earliest uninformative ones.
    short = [_round([False, True, False], 0)]
    assert select_groups(short, 3, informative_first=True) == [(0, 0), (0, 1), (0, 2)]
    assert select_groups([_round([False, False], 0), _round([True, False], 1)], 2, True) == [(0, 0), (1, 0)]
    assert merge_groups(short, [(0, 0), (0, 1), (0, 2)]) is short[0]
