"""Generation from a hybrid Mamba-2 / attention / MoE model with cached SSM state.

``generate(use_kv_cache=True)`` runs a hybrid model through Megatron's paged engine: continuous
batching, each request with its KV blocks and a slot of conv and SSM states (prefill writes them
through the varlen kernels, each decode step advances them one token; a prompt's samples fork its
slot). ``static_batches=True`` runs Megatron's static context instead, the attention K/V and the
states of a left-padded batch: the padding must reach neither attention (masked) nor the Mamba
conv/SSM states (``mamba_padding.py``). The reference of both is ``use_kv_cache=False``: the whole
prefix recomputed for every token (the training-path scan, no state), and a teacher-forced forward
of each prompt + response alone. Prompts of four lengths, n = 2 samples per prompt.
"""

from __future__ import annotations

import contextlib
from unittest import mock

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
        paged = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=True)
        static = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=True, static_batches=True)
        recomputed = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=False)
        # Two requests at most at once in the blocks of the longest: preempted (state slot freed,
        # prefilled again from prompt + response) as they grow.
        tight = generate(model, PROMPTS, params, tokenizer=TOKENIZER, kv_cache=_tight_budget(model))
        # Three state slots for groups of two, and the longest prompt's samples cut after 3 tokens by the
        # sequence limit: requests join while others decode, so steps mix decode and prefill requests
        # (with the scratch rows Megatron leaves uninitialised NaN, as they may be on a GPU).
        limit = len(PROMPTS[2]) + 3
        with _uninitialised_memory_is_nan(), _counting_mixed_steps() as mixed:
            three = generate(model, PROMPTS, params, tokenizer=TOKENIZER, kv_cache=_three_slots(model),
                             max_sequence_length=limit)
        three_ref = generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=False, max_sequence_length=limit)
        result[name] = dict(paged=_tokens(paged), static=_tokens(static), recomputed=_tokens(recomputed),
                            tight=_tokens(tight), three=_tokens(three), three_ref=_tokens(three_ref),
                            three_logprobs=([s.response_logprobs for s in three],
                                            [s.response_logprobs for s in three_ref]), mixed_steps=mixed[0],
                            tight_stats=vars(tight.stats), paged_stats=vars(paged.stats),
                            logprobs={k: [s.response_logprobs for s in b] for k, b in
                                      (("paged", paged), ("static", static), ("recomputed", recomputed),
                                       ("tight", tight))},
                            forced=_teacher_forced_logprobs(model, paged))
    result["budget"] = _budget_checks(model)
    return result


def _uninitialised_memory_is_nan():
    """``torch.empty_like`` filled with NaN: Megatron's mixed decode + prefill Mamba step leaves the rows
    of a scratch tensor it does not use uninitialised (garbage, NaN on a GPU as likely as not); they
    must not reach the rows it does use."""
    empty_like = torch.empty_like

    def nan_empty_like(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    return mock.patch.object(torch, "empty_like", nan_empty_like)


@contextlib.contextmanager
def _counting_mixed_steps():
    """Counts the Mamba layer calls whose step holds decode and prefill requests at once."""
    from megatron.core.ssm import mamba_mixer

    count = [0]
    original = mamba_mixer.MambaMixer._dynamic_inference

    def counted(self, hidden_states, context):
        dims = context.padded_batch_dimensions
        count[0] += bool(dims.decode_req_count and dims.prefill_req_count)
        return original(self, hidden_states, context)

    with mock.patch.object(mamba_mixer.MambaMixer, "_dynamic_inference", counted):
        yield count


def _three_slots(model):
    """Room for three requests at their longest (expected = longest), state slots included."""
    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.kv_budget import kv_layout

    layout = kv_layout(model, block_size_tokens=8, tp=1)
    longest = layout.blocks_for(max(len(p) for p in PROMPTS) + GREEDY.max_new_tokens)
    return KVCacheConfig(kv_cache_bytes=3 * (layout.state_bytes + longest * layout.block_bytes) + layout.block_bytes,
                         block_size_tokens=8, expected_response_fraction=1.0)


def _tight_budget(model):
    """Two state slots (requests expected at a tenth of their budget: 3 blocks each) and blocks that
    hold only the longest request at its longest (6 of 8 tokens; one more is Megatron's dummy)."""
    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.kv_budget import kv_layout

    layout = kv_layout(model, block_size_tokens=8, tp=1)
    longest = layout.blocks_for(max(len(p) for p in PROMPTS) + GREEDY.max_new_tokens)
    return KVCacheConfig(kv_cache_bytes=(longest + 1) * layout.block_bytes + 2 * layout.state_bytes,
                         block_size_tokens=8, expected_response_fraction=0.1)


def _budget_checks(model):
    """Rows per static batch follow the cache budget: tokens unchanged; a budget below one row refused."""
    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.kv_budget import static_row_bytes

    row_tokens = max(len(p) for p in PROMPTS) + GREEDY.max_new_tokens
    per_row = static_row_bytes(model, row_tokens)
    three_rows = KVCacheConfig(kv_cache_bytes=3 * per_row + 1)
    budgeted = generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, static_batches=True, kv_cache=three_rows)
    try:
        generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, static_batches=True,
                 kv_cache=KVCacheConfig(kv_cache_bytes=per_row - 1))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return dict(per_row=per_row, row_tokens=row_tokens, tokens=_tokens(budgeted), refused=refused)


def _ep_worker(weights_dir):
    """EP=2 x DP=2: rank 0 generates three prompts, rank 1 one (the ranks' step counts differ)."""
    import torch.distributed as dist

    model = _model(ParallelConfig(expert_model_parallel_size=2), weights_dir, False)
    mine = PROMPTS[:3] if dist.get_rank() == 0 else PROMPTS[3:]
    return {static: _tokens(generate(model, mine, GREEDY, tokenizer=TOKENIZER, static_batches=static))
            for static in (False, True)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("hybrid_gen") / "w")
    return weights, run_distributed(_single_worker, 1, weights)[0]


@pytest.mark.parametrize("name", ["greedy", "sampled"])
@pytest.mark.parametrize("engine", ["paged", "static", "tight"])
def test_cached_ssm_state_equals_full_recompute(single, name, engine):
    """Paged (with forks), static, and paged under a budget that preempts: the recomputed tokens,
    log-probs within float rounding of the recompute and of a teacher-forced forward."""
    result = single[1][name]
    assert result[engine] == result["recomputed"]
    logprobs = result["logprobs"]
    for cached, recomputed in zip(logprobs[engine], logprobs["recomputed"], strict=True):
        assert max(abs(a - b) for a, b in zip(cached, recomputed, strict=True)) < 1e-5
    for cached, forced in zip(logprobs[engine], result["forced"], strict=True):
        assert max(abs(a - b) for a, b in zip(cached, forced, strict=True)) < 1e-5
    # The test would prove little if the responses were all the same token.
    assert len({tuple(t) for t in result["paged"]}) > 2 and all(len(set(t)) > 1 for t in result["paged"])


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_steps_mixing_decode_and_prefill_equal_the_recompute(single, name):
    """Megatron's mixed Mamba step splits the packed tokens into decode and prefill parts through
    scratch tensors whose unused rows are uninitialised; NaN there must not reach a used row."""
    result = single[1][name]
    assert result["mixed_steps"] > 0
    assert result["three"] == result["three_ref"]
    for cached, recomputed in zip(*result["three_logprobs"], strict=True):
        assert max(abs(a - b) for a, b in zip(cached, recomputed, strict=True)) < 1e-5


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_paged_hybrid_runs_requests_together_and_preempts_under_a_tight_budget(single, name):
    result = single[1][name]
    assert result["paged_stats"]["peak_requests"] == len(PROMPTS) * 2  # all at once: 4 prompts x 2 samples
    assert result["paged_stats"]["preemptions"] == 0
    tight = result["tight_stats"]
    assert tight["peak_requests"] == 2 and tight["preemptions"] > 0 and tight["recomputed_tokens"] > 0


def test_expert_parallel_ranks_step_together_and_match_one_process(single):
    weights, result = single
    ranks = run_distributed(_ep_worker, 2, weights, timeout_s=240)
    reference = result["greedy"]["paged"]
    for static in (False, True):  # prompts 0-2 on rank 0, prompt 3 on rank 1 (n = 2 each)
        assert ranks[0][static] + ranks[1][static] == reference


def test_static_batches_follow_the_cache_budget(single):
    budget = single[1]["budget"]
    # K/V of the one attention layer (2 groups x head dim 8) + conv [128, 4] and SSM [8, 8, 16] states of the
    # two Mamba layers, fp32.
    assert budget["per_row"] == 4 * (2 * budget["row_tokens"] * 2 * 8 + 2 * (128 * 4 + 8 * 8 * 16))
    assert budget["tokens"] == single[1]["greedy"]["paged"]  # 8 rows in batches of 3
    assert "cannot hold one row" in budget["refused"] and "rollout.kv_cache_bytes" in budget["refused"]
