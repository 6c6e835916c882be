"""Rewards that do not block generation (issue 11 part 4).

* ``ScoringPool`` (items arriving one by one) gives exactly ``score_batch``'s scores and error
  counts: raising, hanging (timed out), non-finite and out-of-range rewards, and a batch reward
  whose waiting items go out as one call.
* ``RolloutScorer`` wired to ``generate(on_finished=...)`` scores each sample while the others
  decode (a reward finished before ``generate`` returned) and returns what today's serial
  ``score_responses`` returns on the same rollouts; at TP=2 only the model-parallel source rank
  runs the rewards and the other gets the scores by broadcast.
"""

import time

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.rewards import BoundReward, score_batch
from megatron_cascade.rewards.scoring import ScoringPool, finalize_scores
from megatron_cascade.testing import run_distributed


def _flaky(response: str, sample: dict) -> float:
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(3)
    if response == "nan":
        return float("nan")
    return {"big": 1.5, "neg": -2.0}.get(response, len(response) / 10)


BATCH_CALLS: list[int] = []


def _batched(response: str, sample: dict) -> float:
    return sample["target"] == response


def _batched_many(responses, samples):
    BATCH_CALLS.append(len(responses))
    time.sleep(0.1)  # the next items queue up meanwhile
    return [float(s["target"] == r) if r != "bad" else ValueError("bad item") for r, s in zip(responses, samples)]


_batched.batch_fn = _batched_many


def test_pool_scores_like_score_batch():
    responses = ["ok", "raise", "hang", "nan", "big", "neg", "abc", "hang", "x"]
    expected = score_batch(_flaky, responses, [{}] * len(responses), timeout_s=0.4, max_workers=2)
    pool = ScoringPool(max_workers=2)
    start = time.monotonic()
    for r in responses:  # arriving one by one, as generation finishes them
        pool.submit(_flaky, r, {}, timeout_s=0.4)
        time.sleep(0.02)
    got = finalize_scores(pool.results(), "_flaky")
    assert got == expected == ([0.2, 0.0, 0.0, 0.0, 1.0, 0.0, 0.3, 0.0, 0.1], 4)
    assert time.monotonic() - start < 2.5  # the hung calls were abandoned, not awaited


def test_pool_groups_waiting_items_of_a_batch_reward():
    reward = BoundReward("batched", _batched)
    responses = ["a", "b", "bad", "d", "e"]
    samples = [{"target": t} for t in ("a", "x", "c", "d", "y")]
    BATCH_CALLS.clear()
    expected = score_batch(reward, responses, samples)
    assert BATCH_CALLS == [5]
    BATCH_CALLS.clear()
    pool = ScoringPool(max_workers=1)
    for r, s in zip(responses, samples):
        pool.submit(reward, r, s)
    got = finalize_scores(pool.results(), "batched")
    assert got == expected == ([1.0, 0.0, 0.0, 1.0, 0.0], 1)
    assert sum(BATCH_CALLS) == 5 and len(BATCH_CALLS) < 5  # one call took several waiting items


# -- wired to generate ----------------------------------------------------------------------------

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=103, ffn_hidden_size=64,
                    max_position_embeddings=64)
CALLS: list[float] = []  # when each reward call finished (monotonic s), in this process


def _timed_length_reward(response: str, sample: dict) -> float:
    time.sleep(0.01)
    CALLS.append(time.monotonic())
    return len(set(response)) / 40 if sample["kind"] == "len" else float(response[:1] in "aeiou")


def _scorer_worker(parallel: ParallelConfig):
    from megatron_cascade.stages.rollout_scoring import RolloutScorer, score_responses
    from megatron_cascade.config.schema import DomainConfig, RewardSpec
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    initialize_model_parallel(parallel, seed=5)
    model = build_gpt_model(MODEL, parallel)
    texts = ["a", "hello there", "what is the answer to this long question?", "x" * 30]
    prompts = [tok.encode(t) for t in texts]
    rows = [{"kind": "len"}, {"kind": "vowel"}, {"kind": "len"}, {"kind": "vowel"}]
    names = ["short", "vowels", "short", "vowels"]
    rewards = {"short": _timed_length_reward, "vowels": _timed_length_reward}
    domains = {d: DomainConfig(reward=RewardSpec(name=d, timeout_s=5.0)) for d in rewards}
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=3, seed=3, ignore_eos=True)
    CALLS.clear()
    with RolloutScorer(rewards, domains, tok, rows, names) as scorer:
        # The 64-token limit gives the prompts budgets of 40 down to 34 tokens: samples finish apart.
        rollouts = generate(model, prompts, params, tokenizer=tok, max_sequence_length=64,
                            on_finished=scorer.on_finished)
        generated_at = time.monotonic()
        streamed = scorer.collect(rollouts.samples)
    calls = list(CALLS)
    serial = score_responses(rewards, domains, [tok.decode(s.response_ids) for s in rollouts],
                             [rows[s.prompt_index] for s in rollouts], [names[s.prompt_index] for s in rollouts])
    return streamed[:2], serial[:2], sum(t < generated_at for t in calls), len(calls)


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(tensor_model_parallel_size=2)],
                         ids=["one-process", "tp2"])
def test_scorer_scores_during_generation_like_serial_scoring(parallel):
    world = parallel.tensor_model_parallel_size
    results = run_distributed(_scorer_worker, world, parallel, timeout_s=240)
    (scores, errors), (serial_scores, serial_errors), early, calls = results[0]
    assert errors == serial_errors == 0 and len(scores) == 12
    torch.testing.assert_close(scores, serial_scores, atol=0, rtol=0)
    assert len(set(scores.tolist())) > 2  # scores that tell samples apart
    assert calls == 12 and early > 0  # one streamed call per sample, some of them during generation
    for rank_scores, rank_serial, rank_early, rank_calls in results[1:]:  # not the source: no reward ran
        torch.testing.assert_close(rank_scores[0], scores, atol=0, rtol=0)
        assert rank_calls == rank_early == 0
