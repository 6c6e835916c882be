"""Evaluation generates within the run's ``rollout.kv_cache_*`` budget (the stage passes the same
``KVCacheConfig.from_rollout`` of its rollout section).

A budget of 6 blocks of 8 tokens holds one 36-token request (prompt + 32 new tokens: 5 blocks)
at a time: the eval prompts wait their turn and the scores equal those of the default budget. A
budget below one request is refused naming ``rollout.kv_cache_bytes``. Before, evaluation never
passed the keys to ``generate`` (the default budget always applied: no error).
"""

import pytest

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=103, ffn_hidden_size=64,
                    max_position_embeddings=64)


def _distinct_chars(response: str, sample: dict) -> float:
    return len(set(response)) / 32


def _worker():
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.cascade.evaluation import evaluate
    from megatron_cascade.config.schema import DomainConfig, EvalConfig, RewardSpec, RolloutConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.model.builder import params_dtype
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    initialize_model_parallel(ParallelConfig(), seed=2)
    model = build_gpt_model(MODEL, ParallelConfig())
    examples = [Example("d", tuple(tok.encode(t)), {}, f"x:{i}") for i, t in enumerate(["abcd", "hello", "2+2="])]
    domains = {"d": DomainConfig(reward=RewardSpec(name="distinct"))}
    block_bytes = 2 * MODEL.num_layers * 8 * MODEL.hidden_size * params_dtype(MODEL).itemsize  # K and V

    def run(**kv):
        rollout = RolloutConfig(max_new_tokens=32, kv_block_size_tokens=8, **kv)
        return evaluate(model, {"d": examples}, {"d": _distinct_chars}, domains, tok,
                        EvalConfig(temperature=1.0), rollout, seed=4)

    out = {"default": run(), "one_at_a_time": run(kv_cache_bytes=6 * block_bytes)}
    try:
        run(kv_cache_bytes=3 * block_bytes)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_evaluation_uses_the_rollout_kv_budget():
    out = run_distributed(_worker, 1, timeout_s=240)[0]
    assert out["one_at_a_time"] == out["default"] and 0 < out["default"]["d"] < 1
    assert "rollout.kv_cache_bytes" in out.get("refused", "")
