"""Stages that train on their own samples: generation rounds (episodes in each domain's environment:
one response for single-turn rewards, several turns for tool use), rewards scored while decoding, the
overlong policy, and the rollout sums every such stage logs. Subclasses turn the chosen groups
into a training batch (``train_batch``)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_cascade.algorithms import apply_overlong_policy, informative_groups
from megatron_cascade.stages.prompt_data import Example
from megatron_cascade.stages.group_filter import GroupRound, merge_groups, select_groups
from megatron_cascade.stages.rollout_scoring import RolloutScorer, build_domain_rewards, check_error_fraction
from megatron_cascade.environments.runner import run_episodes
from megatron_cascade.environments.settings import domain_episode_settings, episode_scores
from megatron_cascade.rollout import KVCacheConfig, RolloutBatch, SamplingParams
from megatron_cascade.rollout.batch import GenerationStats
from megatron_cascade.rollout.replica_groups import GenerationReplica, model_parallel_source
from megatron_cascade.rollout.meeting import meet_after_generation
from megatron_cascade.stages.base import StageType, StepBatch


class RolloutStage(StageType):
    """Generate ``samples_per_prompt`` responses per prompt with the policy, score them (when the type
    has rewards), and train on them."""

    multi_turn = False  # set by setup: a domain of the stage has a multi-turn environment
    episode_metrics: tuple[str, ...] = ()  # set by setup: the metric names of those environments
    expected_fraction: float | None = None  # the previous step's response/length_mean / max_new_tokens
    expected_used: float | None = None  # what the last generation's admission expected

    def setup(self) -> None:
        r = self.runner
        self.rewards = build_domain_rewards(r.cfg.domains, r.stage.domains) if self.entry.rewards else {}
        self.episodes = domain_episode_settings(r.cfg.domains, list(r.stage.domains), r.tok,
                                                r.stage.rollout.max_new_tokens)
        # Stages with a multi-turn domain log episode metrics (keys the same on every rank).
        self.episode_metrics = tuple(sorted({m for s in self.episodes.values() if not s.env.one_turn
                                             for m in s.env.metric_names}))
        self.multi_turn = any(not s.env.one_turn for s in self.episodes.values())

    def make_batch(self, step: int, examples: list[Example]) -> StepBatch:
        timing = {"time/generation_s": 0.0, "time/reward_s": 0.0}
        rounds = self._generate_groups(step, examples, timing)
        dynamic = self.runner.stage.rollout.dynamic_sampling_max_rounds > 1
        chosen = merge_groups(rounds, select_groups(rounds, len(examples), informative_first=dynamic))
        sums, maxes = self._rollout_sums(rounds)
        return StepBatch(self.train_batch(chosen, sums, timing), sums, maxes, timing)

    def train_batch(self, chosen: GroupRound, sums: dict[str, float], timing: dict[str, float]):
        """The ``TrainBatch`` of the chosen groups; may add sums and timings."""
        raise NotImplementedError

    def step_done(self, metrics: dict[str, float]) -> None:
        """``rollout.adapt_expected_response_fraction``: the next step expects this one's mean response
        length (single-turn stages: a multi-turn response holds several calls and the observations)."""
        ro = self.runner.stage.rollout
        if ro.adapt_expected_response_fraction and not self.multi_turn and "response/length_mean" in metrics:
            self.expected_fraction = min(1.0, max(metrics["response/length_mean"], 1.0) / ro.max_new_tokens)

    def kv_cache(self) -> KVCacheConfig:
        """The step's paged-cache settings: the rollout section's, expecting the adapted fraction."""
        kv = KVCacheConfig.from_rollout(self.runner.stage.rollout)
        if self.expected_fraction is not None:
            kv = replace(kv, expected_response_fraction=self.expected_fraction)
        self.expected_used = kv.expected_response_fraction
        return kv

    # -- generation ------------------------------------------------------------------------------
    def sampling(self, step: int, n: int, round: int = 0, replica_rank: int | None = None) -> SamplingParams:
        """Sampling of ``step``'s ``round``: seeded by (seed, stage, step, generating replica, round);
        the replica is the training DP rank, or the decode copy's DP rank (``replica_rank``)."""
        r = self.runner
        ro = r.stage.rollout
        rank = r.dp_rank if replica_rank is None else replica_rank
        seed = (r.cfg.seed * 1_000_003 + r.index * 10_007 + step) * 131 + rank + round * 7_368_787
        return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, stop_strings=tuple(ro.stop_strings), n=n, seed=seed)

    def _generate_round(self, step: int, round: int, examples: list[Example], timing: dict,
                        replica: GenerationReplica) -> GroupRound:
        """Run G episodes per prompt (G responses for single-turn domains), score them (while
        decoding), apply the overlong policy."""
        r = self.runner
        G = r.stage.samples_per_prompt
        if replica.is_copy:
            rollouts, scores, errored = self._generate_on_copy(step, round, examples, timing, replica)
        else:
            rollouts, scores, errored = self._generate_scored(step, round, examples, timing, replica)
        scores, errored = episode_scores(rollouts.samples, scores, errored)
        if self.entry.rewards:
            # Before anything is trained on this step: every rank stops if the rewards largely failed.
            check_error_fraction(errored, [examples[s.prompt_index].domain for s in rollouts], r.cfg.domains,
                                 list(r.stage.domains), r.cfg.rewards.max_error_frac, r.dp_group)
        finished = torch.tensor([s.finish_reason == "stop" for s in rollouts])
        rewards, keep = apply_overlong_policy(scores.view(len(examples), G), finished.view(len(examples), G),
                                              policy=r.stage.rollout.overlong_policy)
        # A failed reward's 0 is not a verdict on the response: it is no evidence for its group.
        informative = informative_groups(rewards, valid=keep & ~errored.view(len(examples), G))
        return GroupRound(examples, rollouts, scores, errored, rewards, keep, informative)

    def _generate_scored(self, step: int, round: int, examples: list[Example], timing: dict,
                         replica: GenerationReplica):
        """(rollouts, scores [N] float64, reward failed [N] bool) of ``examples`` on ``replica``, each
        episode scored the moment it ends while the others go on (a group reward once the G episodes
        of its prompt have ended)."""
        r = self.runner
        G = r.stage.samples_per_prompt
        t0 = time.perf_counter()
        scorer = RolloutScorer(self.rewards, r.cfg.domains, r.tok, [e.row for e in examples],
                               [e.domain for e in examples], group_size=G,
                               model_parallel_group=replica.mp_group) if self.entry.rewards else None
        with scorer or contextlib.nullcontext():
            rollouts = run_episodes(replica.module, [list(e.prompt_ids) for e in examples], [e.row for e in examples],
                                    [self.episodes[e.domain] for e in examples],
                                    self.sampling(step, G, round, replica.dp_rank if replica.is_copy else None),
                                    tokenizer=r.tok, kv_cache=self.kv_cache(),
                                    on_episode_done=scorer.on_finished if scorer else None)
            timing["time/generation_s"] += time.perf_counter() - t0
            if scorer:
                scores, errored, reward_s = scorer.collect_flags(rollouts.samples)  # reward_s: the stragglers
                timing["time/reward_s"] += reward_s
                for i in scorer.response_faults.nonzero().flatten().tolist():  # counted with the environment's
                    sample = rollouts.samples[i]
                    sample.response_fault = getattr(sample, "response_fault", None) or "the response broke its scoring"
            else:
                scores = torch.zeros(len(rollouts), dtype=torch.float64)
                errored = torch.zeros(len(rollouts), dtype=torch.bool)
        # The next collective crosses replicas: wait for the slowest outside it (no timeout to fire).
        meet_after_generation(r.cfg.distributed.generation_wait_minutes, f"stage {r.stage.name} generation")
        return rollouts, scores, errored

    def _generate_on_copy(self, step: int, round: int, examples: list[Example], timing: dict,
                          replica: GenerationReplica):
        """``_generate_scored`` for this training rank's ``examples`` on the decode copy: every
        training data-parallel rank's prompts are pooled, each decode replica generates and scores a
        contiguous share, and the results go back to the training ranks that own the prompts
        (prompt-major, ``prompt_index`` local again). Collective over the whole job."""
        r = self.runner
        world = dist.get_world_size()
        owners: list = [None] * world
        dist.all_gather_object(owners, (r.dp_rank, examples))
        by_rank = dict(owners)  # the TP / PP / CP ranks of a training replica hold the same prompts
        pooled = [e for rank in sorted(by_rank) for e in by_rank[rank]]
        first = sum(len(by_rank[rank]) for rank in sorted(by_rank) if rank < r.dp_rank)
        lo, hi = _share(len(pooled), replica.dp_rank, replica.dp_size)
        rollouts, scores, errored = self._generate_scored(step, round, pooled[lo:hi], timing, replica)
        source, _, _ = model_parallel_source(replica.mp_group)
        mine = (lo, rollouts.samples, scores, errored, rollouts.stats) if source else None
        results: list = [None] * world
        dist.all_gather_object(results, mine)
        samples, picked_scores, picked_errored = [], [], []
        stats = GenerationStats()
        for result in results:
            if result is None:
                continue
            start, got, got_scores, got_errored, got_stats = result
            if r.dp_rank == 0:  # every decode replica's stats once: the step's sums add over training ranks
                stats.add(got_stats)
            for i, sample in enumerate(got):
                index = start + sample.prompt_index - first  # the prompt's index among this rank's examples
                if 0 <= index < len(examples):
                    sample.prompt_index = index
                    samples.append(sample)
                    picked_scores.append(float(got_scores[i]))
                    picked_errored.append(bool(got_errored[i]))
        order = sorted(range(len(samples)), key=lambda i: (samples[i].prompt_index, samples[i].sample_index))
        batch = RolloutBatch([samples[i] for i in order], rollouts.params, stats)
        return (batch, torch.tensor([picked_scores[i] for i in order], dtype=torch.float64),
                torch.tensor([picked_errored[i] for i in order], dtype=torch.bool))

    def _generate_groups(self, step: int, examples: list[Example], timing: dict) -> list[GroupRound]:
        """Round 0 on ``examples``; with dynamic sampling further rounds on further prompts until every
        rank has its share of informative groups (decided on all data-parallel ranks together)."""
        r = self.runner
        replica = r.generation_replica()  # the decode copy refit once per step (its weights are this step's)
        try:
            return self._generate_rounds(step, examples, timing, replica)
        finally:
            r.generation_done()

    def _generate_rounds(self, step: int, examples: list[Example], timing: dict,
                         replica: GenerationReplica) -> list[GroupRound]:
        r = self.runner
        rounds = [self._generate_round(step, 0, examples, timing, replica)]
        quota = len(examples)
        while len(rounds) < r.stage.rollout.dynamic_sampling_max_rounds:
            found = sum(int(rnd.informative.sum()) for rnd in rounds)
            have = torch.tensor([float(min(found, quota))], dtype=torch.float64)
            dist.all_reduce(have, group=r.dp_group)
            if have.item() >= r.stage.prompts_per_step:
                break
            rounds.append(self._generate_round(step, len(rounds), r.my_share(step, len(rounds)), timing, replica))
        return rounds

    # -- metrics ---------------------------------------------------------------------------------
    def _rollout_sums(self, rounds: list[GroupRound]) -> tuple[dict[str, float], dict[str, float]]:
        """Step sums (and maxima) of this rank over every generated sample of every round. Reward
        statistics (stages with rewards) count only samples whose reward did not fail, after the
        overlong policy (the rewards advantages see; ``raw_reward``: the verifiers' scores)."""
        sums: dict[str, float] = {"groups": 0.0, "groups_informative": 0.0, "generation_preemptions": 0.0,
                                  "generation_recomputed_tokens": 0.0}
        longest = peak_requests = 0.0
        for rnd in rounds:
            stats = rnd.rollouts.stats
            if stats is not None:  # the paged engine's run (KV on demand)
                _add(sums, "generation_preemptions", float(stats.preemptions))
                _add(sums, "generation_recomputed_tokens", float(stats.recomputed_tokens))
                peak_requests = max(peak_requests, float(stats.peak_requests))
            scored = ~rnd.errored
            faulted = torch.tensor([getattr(s, "response_fault", None) is not None for s in rnd.rollouts],
                                   dtype=torch.bool)
            reward = rnd.rewards.flatten().to(torch.float64)
            lengths = torch.tensor([float(len(s.response_ids)) for s in rnd.rollouts])
            stopped = torch.tensor([float(s.finish_reason == "stop") for s in rnd.rollouts])
            longest = max(longest, float(lengths.max()) if len(lengths) else 0.0)
            domains = rnd.sample_domains
            _add(sums, "groups", float(len(rnd.examples)))
            _add(sums, "groups_informative", float(rnd.informative.sum()))
            for domain in self.runner.stage.domains:
                mine = torch.tensor([d == domain for d in domains], dtype=torch.bool)
                _add(sums, f"samples/{domain}", float(mine.sum()))
                _add(sums, f"length_sum/{domain}", float(lengths[mine].sum()))
                _add(sums, f"stop_sum/{domain}", float(stopped[mine].sum()))
                if self.entry.rewards:
                    ok = mine & scored
                    _add(sums, f"scored/{domain}", float(ok.sum()))
                    _add(sums, f"response_faults/{domain}", float((mine & faulted).sum()))
                    _add(sums, f"reward_sum/{domain}", float(reward[ok].sum()))
                    _add(sums, f"reward_sq_sum/{domain}", float((reward[ok] ** 2).sum()))
                    _add(sums, f"raw_reward_sum/{domain}", float(rnd.scores[ok].sum()))
            if self.multi_turn:
                self._episode_sums(sums, rnd)
        peaks = {"response_length_max": longest, "sampling_rounds": float(len(rounds)),
                 "generation_peak_requests": peak_requests}
        if self.expected_used is not None:
            peaks["generation_expected_fraction"] = self.expected_used
        return sums, peaks

    def _episode_sums(self, sums: dict[str, float], rnd: GroupRound) -> None:
        """Episode sums of a round: turns, environment metrics, step timeouts and errors, and the
        reward over the turns of scored episodes (``episode/reward_per_turn``)."""
        keys = ["episodes", "episode_turns", "episode_timeouts", "episode_env_errors", "episode_scored_turns",
                "episode_scored_reward"] + [f"episode_metric/{name}" for name in self.episode_metrics]
        for key in keys:  # every rank all-reduces the same keys
            _add(sums, key, 0.0)
        scored = ~rnd.errored
        reward = rnd.rewards.flatten().to(torch.float64)
        for i, s in enumerate(rnd.rollouts):
            _add(sums, "episodes", 1.0)
            _add(sums, "episode_turns", float(s.turns))
            _add(sums, "episode_timeouts", float(s.timed_out))
            _add(sums, "episode_env_errors", float(s.env_error is not None))
            for name in self.episode_metrics:
                _add(sums, f"episode_metric/{name}", float(s.metrics.get(name, 0.0)))
            if self.entry.rewards and bool(scored[i]):
                _add(sums, "episode_scored_turns", float(s.turns))
                _add(sums, "episode_scored_reward", float(reward[i]))


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _share(total: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of ``total`` items for ``rank`` of ``size``: contiguous, sizes differing by at most one."""
    base, extra = divmod(total, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)
