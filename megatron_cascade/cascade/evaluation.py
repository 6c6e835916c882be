"""Held-out evaluation: every domain's eval set, greedy (or sampled) pass@1 with its verifier, its
standard error over prompts and pass@k (k = ``eval.samples``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cascade.stages.prompt_data import Example
from megatron_cascade.stages.rollout_scoring import RolloutScorer
from megatron_cascade.config.schema import DistributedConfig, DomainConfig, EvalConfig, RolloutConfig
from megatron_cascade.environments.runner import run_episodes
from megatron_cascade.environments.settings import domain_episode_settings, episode_scores
from megatron_cascade.rollout import KVCacheConfig, SamplingParams
from megatron_cascade.rollout.replica_groups import GenerationReplica
from megatron_cascade.rollout.meeting import meet_after_generation

log = logging.getLogger(__name__)

DEFAULT_GENERATION_WAIT = DistributedConfig().generation_wait_minutes


def data_parallel() -> tuple:
    """(rank, size, group) of this process in Megatron's data-parallel group."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


@dataclass(frozen=True)
class DomainEval:
    """One domain's held-out result.

    ``score``: mean reward in [0, 1] over the scored samples (pass@1 when the reward is 0/1).
    ``se``: standard error of ``score`` over prompts (sample std of the per-prompt means / sqrt(prompts)):
    the samples of one prompt are not independent, the prompts are. 0 with fewer than two prompts.
    ``pass_at_k``: fraction of prompts with at least one full-credit sample (reward >= 1) among their
    ``k`` samples. ``prompts``: prompts with at least one scored sample.
    """

    score: float
    se: float
    pass_at_k: float
    k: int
    prompts: int


def _prompt_sums(values: torch.Tensor, scored: torch.Tensor, prompt_index: list[int], n_prompts: int) -> list[float]:
    """[sum of per-prompt means, sum of their squares, prompts with a scored sample, prompts with a
    full-credit sample] over this rank's prompts (values, scored: [samples])."""
    means_sum = squares_sum = prompts = passed = 0.0
    index = torch.tensor(prompt_index, dtype=torch.long)
    for p in range(n_prompts):
        rows = (index == p) & scored
        if not bool(rows.any()):
            continue
        mean = float(values[rows].mean())
        means_sum, squares_sum, prompts = means_sum + mean, squares_sum + mean * mean, prompts + 1
        passed += float(bool((values[rows] >= 1.0).any()))
    return [means_sum, squares_sum, prompts, passed]


def _standard_error(means_sum: float, squares_sum: float, n: float) -> float:
    if n < 2:
        return 0.0
    variance = max(squares_sum - means_sum * means_sum / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


def evaluate(module: torch.nn.Module | GenerationReplica, eval_sets: dict[str, list[Example]], rewards: dict,
             domains: dict[str, DomainConfig], tokenizer, eval_cfg: EvalConfig, rollout_cfg: RolloutConfig,
             seed: int, generation_wait_minutes: float = DEFAULT_GENERATION_WAIT) -> dict[str, float]:
    """Mean score per domain in [0, 1] (:func:`evaluate_detailed`'s ``score``); collective."""
    details = evaluate_detailed(module, eval_sets, rewards, domains, tokenizer, eval_cfg, rollout_cfg, seed,
                                generation_wait_minutes)
    return {domain: result.score for domain, result in details.items()}


def evaluate_detailed(module: torch.nn.Module | GenerationReplica, eval_sets: dict[str, list[Example]],
                      rewards: dict, domains: dict[str, DomainConfig], tokenizer, eval_cfg: EvalConfig,
                      rollout_cfg: RolloutConfig, seed: int,
                      generation_wait_minutes: float = DEFAULT_GENERATION_WAIT) -> dict[str, DomainEval]:
    """Per domain: mean score in [0, 1] over the samples whose reward did not fail (0 if none was
    scored; failures are logged), its standard error over prompts and pass@k; prompts are split over
    data-parallel ranks; collective.

    Responses get ``eval.max_new_tokens`` tokens (null: the run's ``rollout.max_new_tokens``), stop
    at the run's ``rollout.stop_strings`` and use a KV cache of the run's ``rollout.kv_cache_*``;
    each is scored as soon as it finishes (a reward worker pool, while the rest decode). Every rank
    calls ``generate`` for every domain, also with no prompts of its own (expert-parallel lockstep).
    Multi-turn domains run whole episodes in their environment, scored as in training. Ranks wait for
    the slowest replica outside collectives, at most ``generation_wait_minutes``
    (``distributed.generation_wait_minutes``).

    ``module``: the policy (generating at the training layout), or a ``GenerationReplica`` (a decode
    copy: its data-parallel replicas split the prompts).
    """
    replica = module if isinstance(module, GenerationReplica) else GenerationReplica.training(module)
    dp_rank, dp_size, dp_group = replica.dp_rank, replica.dp_size, replica.dp_group
    max_new_tokens = eval_cfg.max_new_tokens if eval_cfg.max_new_tokens is not None else rollout_cfg.max_new_tokens
    stop_strings = tuple(rollout_cfg.stop_strings)
    # Episodes in each domain's environment, as in training (single_turn: one generate call).
    settings = domain_episode_settings(domains, sorted(eval_sets), tokenizer, max_new_tokens)
    scores = {}
    for domain in sorted(eval_sets):
        examples = eval_sets[domain][: eval_cfg.max_prompts]
        mine = examples[dp_rank::dp_size]
        params = SamplingParams(temperature=eval_cfg.temperature, max_new_tokens=max_new_tokens,
                                stop_strings=stop_strings, n=eval_cfg.samples, seed=seed + dp_rank)
        # Every rank generates, a rank without prompts too: with experts spread over data-parallel
        # ranks it runs dummy forwards for its EP group's all-to-alls (elsewhere it returns at once).
        with RolloutScorer(rewards, domains, tokenizer, [e.row for e in mine], [domain] * len(mine),
                           model_parallel_group=replica.mp_group) as scorer:
            rollouts = run_episodes(replica.module, [list(e.prompt_ids) for e in mine], [e.row for e in mine],
                                    [settings[domain]] * len(mine), params, tokenizer=tokenizer,
                                    kv_cache=KVCacheConfig.from_rollout(rollout_cfg),
                                    on_episode_done=scorer.on_finished)
            values, errored, _ = scorer.collect_flags(rollouts.samples)
        meet_after_generation(generation_wait_minutes, f"eval {domain} generation")
        values, errored = episode_scores(rollouts.samples, values, errored)
        scored = ~errored
        per_prompt = _prompt_sums(values, scored, [s.prompt_index for s in rollouts.samples], len(mine))
        total = torch.tensor([float(values[scored].sum()), float(scored.sum()), float(len(values)), *per_prompt],
                             dtype=torch.float64)
        dist.all_reduce(total, group=dp_group)
        # A failed reward is no verdict on the response: the score is over the scored samples.
        if total[1] < total[2]:
            log.warning("eval %s: %d of %d rewards errored or timed out; the score is over the %d scored",
                        domain, int(total[2] - total[1]), int(total[2]), int(total[1]))
        means_sum, squares_sum, prompts, passed = total[3:].tolist()
        scores[domain] = DomainEval(score=float(total[0] / max(total[1], 1.0)),
                                    se=_standard_error(means_sum, squares_sum, prompts),
                                    pass_at_k=passed / max(prompts, 1.0), k=eval_cfg.samples, prompts=int(prompts))
    return scores
