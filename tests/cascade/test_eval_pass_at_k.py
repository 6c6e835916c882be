"""Held-out evaluation reports, next to the mean score, its standard error over prompts (the samples
of one prompt are not independent) and pass@k (a prompt passes when one of its k samples scores 1),
the same on one data-parallel rank as on two."""

import math

import pytest

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=103, ffn_hidden_size=64,
                    max_position_embeddings=64)


def _by_row(response: str, sample: dict) -> float:
    """The row decides: "all" scores 1, "none" 0, "half" 1 on odd response checksums (some of its samples)."""
    kind = sample["kind"]
    return {"all": 1.0, "none": 0.0}.get(kind, float(sum(map(ord, response)) % 2))


def _worker(samples: int):
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.cascade.evaluation import evaluate_detailed
    from megatron_cascade.config.schema import DomainConfig, EvalConfig, RewardSpec, RolloutConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    initialize_model_parallel(ParallelConfig(), seed=2)
    model = build_gpt_model(MODEL, ParallelConfig())
    kinds = ["all", "none", "all", "none", "none", "all"]
    examples = [Example("d", tuple(tok.encode(f"q{i}=")), {"kind": k}, f"x:{i}") for i, k in enumerate(kinds)]
    domains = {"d": DomainConfig(reward=RewardSpec(name="by_row"))}
    result = evaluate_detailed(model, {"d": examples}, {"d": _by_row}, domains, tok,
                               EvalConfig(temperature=1.0, samples=samples), RolloutConfig(max_new_tokens=6), seed=4)
    return result["d"]


def test_score_standard_error_and_pass_at_k_are_over_prompts():
    result = run_distributed(_worker, 1, 4, timeout_s=240)[0]
    # per-prompt means 1,0,1,0,0,1: mean 0.5, sample std sqrt(0.3), SE sqrt(0.3 / 6)
    assert result.score == pytest.approx(0.5)
    assert result.se == pytest.approx(math.sqrt(0.3 / 6))
    assert result.pass_at_k == pytest.approx(0.5) and result.k == 4 and result.prompts == 6


def test_two_data_parallel_ranks_give_the_single_rank_result():
    one = run_distributed(_worker, 1, 2, timeout_s=240)[0]
    two = run_distributed(_worker, 2, 2, timeout_s=240)
    assert two[0] == two[1] == one


def test_standard_error_of_a_constant_score_is_zero_and_needs_two_prompts():
    from megatron_cascade.cascade.evaluation import _standard_error

    assert _standard_error(3.0, 3.0, 3.0) == 0.0
    assert _standard_error(1.0, 1.0, 1.0) == 0.0
    assert _standard_error(1.0, 1.0, 2.0) == pytest.approx(0.5)  # means 1 and 0
