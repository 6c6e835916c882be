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
from dataclasses import replace
from unittest import mock

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig
from megatron_cascade.rollout import SamplingParams, generate
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer
from paged_workers import _counting_padded_steps, fp8_token_multiple

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
        # rollout.cuda_graphs: decode steps padded to graph sizes (as a GPU replays them), preempting too.
        with _counting_padded_steps() as padded:
            graphs = {"three": generate(model, PROMPTS, params, tokenizer=TOKENIZER, max_sequence_length=limit,
                                        kv_cache=replace(_three_slots(model), cuda_graphs=2)),
                      "tight": generate(model, PROMPTS, params, tokenizer=TOKENIZER,
                                        kv_cache=replace(_tight_budget(model), cuda_graphs=2))}
        with fp8_token_multiple(model) as fed:  # every step padded to FP8's 8 tokens, mixed steps too
            graphs["fp8"] = generate(model, PROMPTS, params, tokenizer=TOKENIZER, max_sequence_length=limit,
                                     kv_cache=_three_slots(model))
        result[name] = dict(paged=_tokens(paged), static=_tokens(static), recomputed=_tokens(recomputed),
                            tight=_tokens(tight), three=_tokens(three), three_ref=_tokens(three_ref),
                            three_logprobs=([s.response_logprobs for s in three],
                                            [s.response_logprobs for s in three_ref]), mixed_steps=mixed[0],
                            tight_stats=vars(tight.stats), paged_stats=vars(paged.stats),
                            logprobs={k: [s.response_logprobs for s in b] for k, b in
                                      (("paged", paged), ("static", static), ("recomputed", recomputed),
                                       ("tight", tight))},
                            forced=_teacher_forced_logprobs(model, paged),
                            graphs={k: (_tokens(b), [s.response_logprobs for s in b]) for k, b in graphs.items()},
                            graphs_padded=padded, fp8_fed=fed)
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


class _EagerGraphManager:
    """Stands in for megatron-core's ``CudaGraphManager`` (which needs CUDA): records which layer it
    was asked to replay in which step, then runs the layer eagerly."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __call__(self, module, args, kwargs):
        kwargs = dict(kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)  # the graph runner's key, not a forward argument
        dims = kwargs["inference_context"].padded_batch_dimensions
        self.calls.append((type(module).__name__, dims.prefill_req_count, dims.decode_req_count))
        return module.forward(*args, **kwargs)


def _graph_routing_worker(weights_dir):
    """Which layers would replay CUDA graphs, in which steps: every graphable layer gets a manager (as
    ``cuda_graph_impl="local"`` gives them on a GPU), then ``graph_decode_steps_only`` narrows them."""
    from megatron.core.transformer.module import GraphableMegatronModule

    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.cuda_graphs import graph_decode_steps_only

    model = _model(ParallelConfig(), weights_dir, False)
    calls: list = []
    layers = [m for m in model.modules() if isinstance(m, GraphableMegatronModule)]
    for layer in layers:
        layer.cudagraph_manager = _EagerGraphManager(calls)
    graphed = graph_decode_steps_only(model)
    out = {"layers": [type(m).__name__ for m in layers], "graphed": graphed,
           "kept": [type(m).__name__ for m in layers if hasattr(m, "cudagraph_manager")]}
    runs = {"eager": dict(), "graphs": dict(kv_cache=KVCacheConfig(cuda_graphs=2)),
            "static": dict(static_batches=True, kv_cache=KVCacheConfig(cuda_graphs=2))}
    for name, kwargs in runs.items():
        calls.clear()
        batch = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER, max_sequence_length=len(PROMPTS[2]) + 3,
                         **kwargs)
        out[name] = (_tokens(batch), list(calls))
    calls.clear()
    model.train()
    ids = torch.tensor([PROMPTS[0]])
    model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[0].sum().backward()
    out["training_calls"] = list(calls)
    return out


def test_cuda_graphs_replay_only_decode_steps_of_layers_without_moe(single):
    """On a GPU, rollout.cuda_graphs gives the decode copy megatron-core's graph managers; replayed are
    exactly the decode steps padded to a graph size, in the Mamba and attention layers, never the MoE
    layer, a prefill or mixed step, the static path or a training forward; tokens as eager."""
    got = run_distributed(_graph_routing_worker, 1, single[0])[0]
    assert got["layers"] == ["MambaLayer", "TransformerLayer", "MambaLayer", "MoETransformerLayer"]
    assert got["kept"] == ["MambaLayer", "TransformerLayer", "MambaLayer"] and got["graphed"] == 3
    eager_tokens, eager_calls = got["eager"]
    tokens, calls = got["graphs"]
    assert tokens == eager_tokens and eager_calls == []
    assert calls and all(prefill == 0 for _, prefill, _ in calls)
    assert len(calls) % 3 == 0 and {name for name, _, _ in calls} == {"MambaLayer", "TransformerLayer"}
    assert got["static"][0] == eager_tokens and got["static"][1] == []
    assert got["training_calls"] == []


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
def test_decode_steps_padded_to_graph_sizes_equal_the_recompute(single, name):
    """rollout.cuda_graphs on the hybrid model: padding requests hold no Mamba state slot and are never
    sampled, so padded decode steps (beside mixed steps, and with preemptions) give the recompute's tokens;
    so do steps padded to FP8's multiple of 8 tokens (padding tokens in prefill and mixed steps)."""
    result = single[1][name]
    assert any(real < size for real, size in result["graphs_padded"])
    assert result["fp8_fed"] and all(n % 8 == 0 for n in result["fp8_fed"])
    for case, reference in (("three", "three_ref"), ("tight", "recomputed"), ("fp8", "three_ref")):
        tokens, logprobs = result["graphs"][case]
        assert tokens == result[reference], case
    tokens, logprobs = result["graphs"]["three"]
    for cached, recomputed in zip(logprobs, result["three_logprobs"][1], strict=True):
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
