"""Rollout metrics of a step (issue 12's telemetry) from a hand-made round: what each name means.

``reward/mean`` is the reward the advantages see — after the overlong policy zeroed the unfinished
response — where before it was the verifier's score (2/3 here instead of 1/3); the verifier's is
``reward/raw_mean``. Failed rewards are left out of the means and counted."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_cascade.algorithms import apply_overlong_policy
from megatron_cascade.stages.prompt_data import Example
from megatron_cascade.stages.group_filter import GroupRound
from megatron_cascade.cascade.step_metrics import rollout_metrics
from megatron_cascade.rollout import RolloutBatch, RolloutSample, SamplingParams
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.stages.rollout import RolloutStage


def _round() -> GroupRound:
    # One group of 4 in domain "math": lengths 3, 5, 8, 2; the 8-token one hit max_new_tokens.
    lengths, reasons = [3, 5, 8, 2], ["stop", "stop", "length", "stop"]
    samples = [RolloutSample(0, g, [1], response_ids=[7] * n, finish_reason=r)
               for g, (n, r) in enumerate(zip(lengths, reasons))]
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # the verifier's
    errored = torch.tensor([False, False, False, True])  # the last reward failed (scored 0)
    finished = torch.tensor([[r == "stop" for r in reasons]])
    rewards, keep = apply_overlong_policy(scores.view(1, 4), finished, policy="zero")
    keep = keep & ~errored.view(1, 4)
    return GroupRound([Example("math", (1,), {}, "t:1")], RolloutBatch(samples, SamplingParams(n=4)), scores,
                      errored, rewards, keep, torch.tensor([True]))


def _stage(type_name: str) -> RolloutStage:
    stage = RolloutStage.__new__(RolloutStage)
    stage.runner = SimpleNamespace(stage=SimpleNamespace(domains={"math": 1.0}))
    stage.entry = stage_type(type_name)
    return stage


def test_reward_mean_is_after_the_overlong_policy_and_raw_mean_before():
    sums, maxes = _stage("grpo")._rollout_sums([_round()])
    m = rollout_metrics(sums, maxes, prompts_per_step=1, teachers={})
    # Scored samples: the first three (rewards after the policy 1, 0, 0; verifier 1, 0, 1).
    assert m["reward/mean"] == pytest.approx(1 / 3)
    assert m["reward/raw_mean"] == pytest.approx(2 / 3)
    assert m["reward/std"] == pytest.approx(math.sqrt(1 / 3 - 1 / 9))
    assert m["reward/domain/math"] == pytest.approx(1 / 3)
    assert m["reward/errors"] == 1 and m["reward/error_frac"] == 0.25
    assert m["response/length_mean"] == 4.5 and m["response/length_max"] == 8
    assert m["response/length_mean/math"] == 4.5
    assert m["finish/stop_frac"] == 0.75 and m["finish/stop_frac/math"] == 0.75
    assert m["finish/length_frac"] == 0.25
    assert m["groups/informative_frac"] == 1.0 and m["sampling/rounds"] == 1


def test_response_faults_are_counted_apart_from_errors_per_domain():
    """A response that broke its own scoring is a scored 0 (a verdict), counted in its own metric."""
    from megatron_cascade.environments.episode import EpisodeSample

    rnd = _round()
    rnd.rollouts.samples[1] = EpisodeSample(0, 1, [1], response_ids=[7] * 5, finish_reason="stop",
                                            response_fault="the response broke its scoring")
    sums, maxes = _stage("grpo")._rollout_sums([rnd])
    m = rollout_metrics(sums, maxes, prompts_per_step=1, teachers={})
    assert m["reward/response_faults"] == 1 and m["reward/response_faults/math"] == 1
    assert m["reward/errors"] == 1 and m["reward/errors/math"] == 1  # the failed reward, not the fault
    assert m["reward/mean"] == pytest.approx(1 / 3)  # the fault's 0 is among the scored


def test_a_stage_without_rewards_logs_no_reward_metric():
    sums, maxes = _stage("distill")._rollout_sums([_round()])
    m = rollout_metrics(sums, maxes, prompts_per_step=1, teachers={"math": "sft"})
    assert not any(k.startswith("reward/") for k in m)
    assert m["response/length_max"] == 8


def test_reverse_kl_per_domain_and_teacher():
    total = {"groups": 2.0, "groups_informative": 0.0, "samples/a": 2.0, "samples/b": 2.0,
             "length_sum/a": 4.0, "length_sum/b": 4.0, "stop_sum/a": 2.0, "stop_sum/b": 2.0,
             "mopd_rkl_sum/a": 3.0, "mopd_tokens/a": 4.0, "mopd_rkl_sum/b": 1.0, "mopd_tokens/b": 4.0}
    m = rollout_metrics(total, {"response_length_max": 2.0, "sampling_rounds": 1.0}, 2,
                        {"a": "stage_x", "b": "/ckpts/teacher_y/"})
    assert m["reverse_kl/domain/a"] == 0.75 and m["reverse_kl/domain/b"] == 0.25
    assert m["reverse_kl/teacher/stage_x"] == 0.75 and m["reverse_kl/teacher/teacher_y"] == 0.25


def test_folder_teachers_keep_distinct_tags():
    """Stage outputs all end in .../final: before, two such teachers were averaged under one tag."""
    total = {"groups": 2.0, "groups_informative": 0.0, "samples/rlhf": 1.0, "samples/stem": 1.0,
             "length_sum/rlhf": 1.0, "length_sum/stem": 1.0, "stop_sum/rlhf": 1.0, "stop_sum/stem": 1.0,
             "mopd_rkl_sum/rlhf": 1.0, "mopd_tokens/rlhf": 1.0, "mopd_rkl_sum/stem": 0.0, "mopd_tokens/stem": 1.0}
    m = rollout_metrics(total, {"response_length_max": 1.0, "sampling_rounds": 1.0}, 2,
                        {"rlhf": "/runs/x/stages/rlhf/final", "stem": "/runs/x/stages/multi_domain_rl/final"})
    assert m["reverse_kl/teacher/rlhf_final"] == 1.0 and m["reverse_kl/teacher/multi_domain_rl_final"] == 0.0


def test_a_domain_named_like_a_reward_metric_does_not_overwrite_it():
    """Before, a domain named ``mean`` logged its own reward as ``reward/mean`` (1.0 here, not 0.5)."""
    total = {"groups": 2.0, "groups_informative": 0.0}
    for d, r in (("mean", 1.0), ("b", 0.0)):
        total.update({f"samples/{d}": 1.0, f"scored/{d}": 1.0, f"reward_sum/{d}": r, f"reward_sq_sum/{d}": r,
                      f"raw_reward_sum/{d}": r, f"length_sum/{d}": 1.0, f"stop_sum/{d}": 1.0})
    m = rollout_metrics(total, {"response_length_max": 1.0, "sampling_rounds": 1.0}, 2, {})
    assert m["reward/mean"] == 0.5 and m["reward/domain/mean"] == 1.0


def test_generation_stats_of_every_round_are_logged():
    """KV on demand: preemptions and the tokens they prefilled again add up over rounds; the peak of
    requests decoding at once is the largest of any round (rounds without the paged engine: none)."""
    from megatron_cascade.rollout.batch import GenerationStats

    first, second, static = _round(), _round(), _round()
    first.rollouts.stats = GenerationStats(preemptions=2, recomputed_tokens=30, peak_requests=4)
    second.rollouts.stats = GenerationStats(preemptions=1, recomputed_tokens=5, peak_requests=6)
    sums, maxes = _stage("grpo")._rollout_sums([first, second, static])
    m = rollout_metrics(sums, maxes, prompts_per_step=1, teachers={})
    assert (m["generation/preemptions"], m["generation/recomputed_tokens"], m["generation/peak_requests"]) == (3, 35, 6)
