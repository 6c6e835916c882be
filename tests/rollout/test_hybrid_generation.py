"""Generation from a hybrid Mamba-2 / attention / MoE model with cached SSM state.

``generate(use_kv_cache=True)`` runs a hybrid model through Megatron's static inference context,
which holds the attention K/V and each Mamba layer's conv and SSM state; the prefill writes them and
every decode step advances them one token. The reference is ``use_kv_cache=False``: the whole prefix
recomputed for every token (the training-path scan, no state), and a teacher-forced forward of each
prompt + response alone (no padding). Prompts of three lengths, left-padded into one batch: the
padding must reach neither attention (masked) nor the Mamba conv/SSM states (``mamba_padding.py``);
n = 2 samples per prompt.
"""

from __future__ import annotations

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig
from megatron_cascade.rollout import SamplingParams, generate
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(
    architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=103,
    ffn_hidden_size=64, max_position_embeddings=96, init_method_std=0.05, position_embedding_type="none",
    activation="squared_relu",
    hybrid=HybridConfig(layer_pattern="M*ME", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16,
                        mamba_chunk_size=8),
    moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, shared_expert_intermediate_size=48,
                  router_score_function="sigmoid", router_enable_expert_bias=True, router_topk_scaling_factor=2.5))
TOKENIZER = CharTokenizer()
PROMPTS = [TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
           for text in ("abc", "what is 2+2?", "Write a haiku about rain.\nGo", "xyz")]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, n=2, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=7, ignore_eos=True)


def _model(parallel, weights_dir, save):
    from megatron_cascade.testing.checkpoints import model_with_shared_weights

    return model_with_shared_weights(MODEL, parallel, weights_dir, save, seed=1234)


def _tokens(batch):
    return [s.response_ids for s in batch]


def _teacher_forced_logprobs(model, batch):
    """log p(response token | prefix) from one full forward per sample (no cache)."""
    out = []
    model.eval()
    with torch.no_grad():
        for s in batch:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[0, :, :TOKENIZER.vocab_size]
            lp = torch.log_softmax(logits.double(), -1)
            n = len(s.prompt_ids)
            out.append([float(lp[n - 1 + i, t]) for i, t in enumerate(s.response_ids)])
    return out


def _single_worker(weights_dir):
    model = _model(ParallelConfig(), weights_dir, True)
    result = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        cached = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=True)
        recomputed = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=False)
        result[name] = dict(cached=_tokens(cached), recomputed=_tokens(recomputed),
                            logprobs=[s.response_logprobs for s in cached],
                            recomputed_logprobs=[s.response_logprobs for s in recomputed],
                            forced=_teacher_forced_logprobs(model, cached))
    result["budget"] = _budget_checks(model)
    return result


def _budget_checks(model):
    """Rows per static batch follow the cache budget: tokens unchanged; a budget below one row refused."""
    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.kv_budget import static_row_bytes

    row_tokens = max(len(p) for p in PROMPTS) + GREEDY.max_new_tokens
    per_row = static_row_bytes(model, row_tokens)
    three_rows = KVCacheConfig(kv_cache_bytes=3 * per_row + 1)
    budgeted = generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, use_kv_cache=True, kv_cache=three_rows)
    try:
        generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, kv_cache=KVCacheConfig(kv_cache_bytes=per_row - 1))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return dict(per_row=per_row, row_tokens=row_tokens, tokens=_tokens(budgeted), refused=refused)


def _ep_worker(weights_dir):
    """EP=2 x DP=2: rank 0 generates three prompts, rank 1 one (the ranks' step counts differ)."""
    import torch.distributed as dist

    model = _model(ParallelConfig(expert_model_parallel_size=2), weights_dir, False)
    mine = PROMPTS[:3] if dist.get_rank() == 0 else PROMPTS[3:]
    return _tokens(generate(model, mine, GREEDY, tokenizer=TOKENIZER, use_kv_cache=True))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("hybrid_gen") / "w")
    return weights, run_distributed(_single_worker, 1, weights)[0]


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_cached_ssm_state_equals_full_recompute(single, name):
    result = single[1][name]
    assert result["cached"] == result["recomputed"]
    for cached, recomputed, forced in zip(result["logprobs"], result["recomputed_logprobs"], result["forced"]):
        assert max(abs(a - b) for a, b in zip(cached, recomputed)) < 1e-5
        assert max(abs(a - b) for a, b in zip(cached, forced)) < 1e-5
    # The test would prove little if the responses were all the same token.
    assert len({tuple(t) for t in result["cached"]}) > 2 and all(len(set(t)) > 1 for t in result["cached"])


def test_expert_parallel_ranks_step_together_and_match_one_process(single):
    weights, result = single
    ranks = run_distributed(_ep_worker, 2, weights, timeout_s=240)
    reference = result["greedy"]["cached"]
    assert ranks[0] + ranks[1] == reference  # prompts 0-2 on rank 0, prompt 3 on rank 1 (n = 2 each)


def test_static_batches_follow_the_cache_budget(single):
    budget = single[1]["budget"]
    # K/V of the one attention layer (2 groups x head dim 8) + conv [128, 4] and SSM [8, 8, 16] states of the
    # two Mamba layers, fp32.
    assert budget["per_row"] == 4 * (2 * budget["row_tokens"] * 2 * 8 + 2 * (128 * 4 + 8 * 8 * 16))
    assert budget["tokens"] == single[1]["greedy"]["cached"]  # 8 rows in batches of 3
    assert "cannot hold one row" in budget["refused"] and "rollout.kv_cache_bytes" in budget["refused"]
