"""Evaluation leaves a failed reward out of the score (a failure is no verdict on the response), as
training does: with a reward that scores 1 or raises, the score is 1 over the scored samples.
Before, a failure counted as a real 0 (the score was the fraction that did not fail)."""

import pytest

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=103, ffn_hidden_size=64,
                    max_position_embeddings=64)


def _one_or_outage(response: str, sample: dict) -> float:
    if sum(map(ord, response)) % 2:
        raise ConnectionError("reward server unreachable")
    return 1.0


def _worker():
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.cascade.evaluation import evaluate
    from megatron_cascade.config.schema import DomainConfig, EvalConfig, RewardSpec, RolloutConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    initialize_model_parallel(ParallelConfig(), seed=2)
    model = build_gpt_model(MODEL, ParallelConfig())
    examples = [Example("d", tuple(tok.encode(t)), {}, f"x:{i}") for i, t in enumerate(["abcd", "hello", "2+2=", "xy"])]
    domains = {"d": DomainConfig(reward=RewardSpec(name="outage"))}
    eval_cfg = EvalConfig(temperature=1.0, samples=4)
    return evaluate(model, {"d": examples}, {"d": _one_or_outage}, domains, tok, eval_cfg,
                    RolloutConfig(max_new_tokens=8), seed=4)


def test_failed_rewards_are_left_out_of_the_eval_score():
    assert run_distributed(_worker, 1, timeout_s=240)[0] == {"d": 1.0}
