"""``run_episodes``: the policy acting in environments, all episodes of a step at once.

Turn 0 is exactly today's ``generate`` call (every prompt, ``n`` samples each, the step's seed), so
single-turn domains sample the same tokens as before. Every later turn batches the next model turn of
all live episodes into one ``generate`` call (n = 1 per episode, a seed per turn); a turn that runs
past what is left of its episode's token budget is cut there afterwards (the same tokens as a smaller
budget; ``generate`` has one budget per call, and its hybrid-model path no per-request one). An environment step starts the moment its episode's turn
finishes decoding, in a daemon thread (``workers.Pending``), so tools run while other episodes still
decode; after the call the runner waits for each step at most until its deadline. A step that
overruns ends its episode (score 0), the others go on.

Environment steps run once per model replica, on its model-parallel source rank; their outcomes
(observation ids, done, reward) are broadcast to the other tensor/pipeline ranks, which therefore
hold the same episodes. Data-parallel replicas run their episodes independently (no collective per
turn), except that with expert parallelism the ranks of an EP group keep calling ``generate``
together (empty calls included) until none has a live episode.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_cascade.environments.episode import Episode, EpisodeSample, EpisodeSettings, StepOutcome
from megatron_cascade.environments.workers import Pending
from megatron_cascade.rewards.outcome import ResponseFault
from megatron_cascade.rollout import KVCacheConfig, RolloutBatch, RolloutSample, SamplingParams, generate
from megatron_cascade.rollout.batch import GenerationStats
from megatron_cascade.rollout.replica_groups import model_parallel_source, replica_groups
from megatron_cascade.rollout.model_runner import unwrap_model
from megatron_cascade.tokenizers.base import Tokenizer

log = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct seeds per turn for any step seed


def run_episodes(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[dict],
    settings: Sequence[EpisodeSettings],
    params: SamplingParams,
    *,
    tokenizer: Tokenizer,
    kv_cache: Optional[KVCacheConfig] = None,
    max_sequence_length: Optional[int] = None,
    on_episode_done: Optional[Callable[[int, EpisodeSample], None]] = None,
) -> RolloutBatch:
    """Run ``params.n`` episodes per prompt to their end; collective over the model-parallel group
    (and the expert-parallel group), like ``generate``.

    Args:
        model: this rank's policy model (see ``generate``).
        prompts: [P] token ids of each episode's start; ``rows``: [P] their data rows (``Environment.start``).
        settings: [P] each prompt's environment and budgets.
        params: sampling of every turn (``params.max_new_tokens`` per turn); turn 0 uses it as it is,
            turn t its seed advanced by t strides. The environments' ``stop_strings`` are added.
        on_episode_done: ``(episode index, sample)`` on every rank the moment an episode ends (e.g.
            to start scoring it); the index is prompt-major, as in the returned batch.

    Returns:
        ``RolloutBatch`` of P * n ``EpisodeSample``s, prompt-major.
    """
    limit = max_sequence_length or unwrap_model(model).max_sequence_length
    groups = replica_groups(unwrap_model(model))
    is_source, group, src = model_parallel_source(groups.mp)
    stops = tuple(dict.fromkeys(list(params.stop_strings) + [s for e in settings for s in e.env.stop_strings]))
    episodes = [Episode(EpisodeSample(prompt_index=p, sample_index=k, prompt_ids=list(prompt)), settings[p], rows[p])
                for p, prompt in enumerate(prompts) for k in range(params.n)]
    finishing: list[Pending] = []
    stats = GenerationStats()  # over every turn's generate call

    def end(index: int) -> None:
        ep = episodes[index]
        if ep.release() and is_source:  # release the episode's resources without waiting here
            finishing.append(Pending(ep.settings.env.finish, ep.state, timeout_s=ep.settings.step_timeout_s))
        if on_episode_done is not None:
            on_episode_done(index, ep.sample)

    turn = 0
    while True:
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not _any_live(bool(live), groups.ep):
            break
        if turn == 0:
            targets = list(range(len(episodes)))
            call_prompts = [list(p) for p in prompts]
            call_params = dataclasses.replace(params, stop_strings=stops)
        else:
            targets = live
            call_prompts = [episodes[i].context for i in live]
            call_params = dataclasses.replace(params, n=1, stop_strings=stops,
                                              seed=(params.seed + turn * _TURN_SEED_STRIDE) % 2**63)
        pending: dict[int, Pending] = {}
        seen: set[int] = set()

        def on_turn(call_index: int, turn_sample: RolloutSample) -> None:
            if call_index in seen:
                return
            seen.add(call_index)
            index = targets[call_index]
            ep = episodes[index]
            ep.add_turn(turn_sample)
            if ep.sample.finish_reason == "length":  # the turn was cut: the episode is truncated
                ep.done = True
                end(index)
            elif ep.settings.env.one_turn:  # single-turn rewards: scored while the others decode
                ep.done = True
                end(index)
            elif is_source:
                ids = list(turn_sample.response_ids)
                pending[index] = Pending(ep.env_step, ids, tokenizer.decode(ids),
                                         timeout_s=ep.settings.step_timeout_s)

        result = generate(model, call_prompts, call_params, tokenizer=tokenizer, kv_cache=kv_cache,
                          max_sequence_length=limit, on_finished=on_turn)
        stats.add(result.stats)
        for call_index, turn_sample in enumerate(result):
            on_turn(call_index, turn_sample)
        stepped = sorted(i for i in targets if not episodes[i].done)
        outcomes = _outcomes(stepped, pending) if is_source else None
        if dist.get_world_size(group) > 1:
            box = [outcomes]
            dist.broadcast_object_list(box, src=src, group=group)
            outcomes = box[0]
        for index, outcome in zip(stepped, outcomes):
            episodes[index].apply(outcome, limit)
            if episodes[index].done:
                end(index)
        turn += 1
    for job in finishing:
        if not job.wait():
            log.warning("an environment's finish() overran environment.step_timeout_s; abandoned")
    return RolloutBatch([ep.sample for ep in episodes], params, stats)


def _outcomes(stepped: list[int], pending: dict[int, Pending]) -> list[StepOutcome]:
    """Each stepped episode's outcome, waiting for each step at most until its deadline."""
    out = []
    for index in stepped:
        job = pending[index]
        if not job.wait():
            log.warning("episode %d: environment step timed out (episode scores 0)", index)
            out.append(StepOutcome(timed_out=True))
        elif isinstance(job.error, ResponseFault):  # the turn made the step impossible: a verdict
            log.warning("episode %d: the model's turn broke its environment (episode scores 0): %s", index, job.error)
            out.append(StepOutcome(response_fault=str(job.error)))
        elif job.error is not None:
            out.append(StepOutcome(error=f"{type(job.error).__name__}: {job.error}"))
        else:
            out.append(StepOutcome.of(job.value))
    return out


def _any_live(live: bool, ep_group) -> bool:
    """Whether another turn is generated: this rank's answer, or with expert parallelism any EP rank's
    (their ``generate`` calls step together)."""
    if ep_group is None:
        return live
    flag = torch.tensor([float(live)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ep_group)
    return bool(flag.item() > 0)
