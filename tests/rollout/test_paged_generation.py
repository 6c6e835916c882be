"""The paged, continuous-batching generator: a KV budget smaller than the call (requests wait,
results unchanged, memory within the budget), one prefill per prompt for its samples, on_finished
while decoding goes on, empty calls, and MoE layouts: expert-parallel lockstep across
data-parallel ranks with different work, and TP=2 with sequence parallelism.
"""

import pytest
import torch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.testing import run_distributed
from paged_workers import EP_PROMPTS, SMALL, budget_worker, graph_padding_worker, long_tail_worker, moe_worker
from rollout_workers import GREEDY, PROMPTS, SAMPLED

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("paged") / "w")
    return dict(run_distributed(budget_worker, 1, weights)[0], weights_dir=weights)


@pytest.mark.parametrize("budget", ["small", "reserved", "tiny"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_small_kv_budget_changes_no_token(ref, kind, budget):
    """Under 5 or 3 blocks (the requests need 2-3 each at their longest) requests wait, and on
    demand are preempted and prefilled again: the tokens are those of an unlimited budget."""
    small, full = ref[f"{kind}_{budget}"], ref[kind]
    for key in ("tokens", "reasons", "index"):
        assert small[key] == full[key], key
    for key in ("logprobs", "sampled_logprobs"):  # other batch mates, prefill vs decode: float rounding only
        for a, b in zip(small[key], full[key], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert ref[kind]["tokens"] == ref[f"{kind}_nocache"]["tokens"]
    assert ref[f"{kind}_{budget}_stats"]["kv_cache_bytes"] <= SMALL.kv_cache_bytes


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_kv_on_demand_runs_more_requests_and_preempts(ref, kind):
    """Worst-case reservation fits 2 requests in 5 blocks and never preempts; on demand more start
    at once (1-3 blocks each at admission) and the newest are preempted as they grow; with 3
    blocks (the longest request alone) too, and the tokens prefilled again are counted."""
    reserved, small, tiny = (ref[f"{kind}_{b}_stats"] for b in ("reserved", "small", "tiny"))
    assert reserved["peak_requests"] == 2 and reserved["preemptions"] == 0
    assert small["peak_requests"] > reserved["peak_requests"]
    assert small["preemptions"] > 0 and small["recomputed_tokens"] > 0
    assert tiny["preemptions"] > 0 and tiny["peak_requests"] <= small["peak_requests"]
    assert ref[f"{kind}_stats"]["preemptions"] == 0  # an unlimited budget never preempts


@pytest.mark.parametrize("block_tokens,fraction", [(8, 0.25), (16, 0.3)])
def test_long_tailed_responses_under_a_tight_budget(ref, tmp_path_factory, block_tokens, fraction):
    """Many short responses and a few at the cap, 24 requests in a quarter of what they need at their
    longest: the long ones outgrow what admission expected for them, so promised growth exceeds the
    free blocks for a while (no admission then) and the newest requests are preempted; the tokens are
    those of an unlimited budget, and more requests run at once than with worst-case reservation."""
    weights = ref["weights_dir"]
    got = run_distributed(long_tail_worker, 1, weights, block_tokens, fraction)[0]
    lengths = sorted(len(t) for t in got["full"])
    assert lengths[0] < 10 and lengths[-1] == 48  # long-tailed
    assert got["demand"] == got["full"] and got["reserved"] == got["full"]
    assert got["demand_stats"]["peak_requests"] > got["reserved_stats"]["peak_requests"]


def test_decode_steps_padded_to_graph_sizes_change_no_token(ref):
    """rollout.cuda_graphs: decode-only steps padded up to Megatron's graph batch sizes (as a GPU
    replays captured graphs) give the eager steps' tokens, also while requests are preempted; their
    log-probs differ by float rounding only (padding rows are never sampled). Same for every step
    padded to FP8's multiple of 8 tokens."""
    got = run_distributed(graph_padding_worker, 1, ref["weights_dir"])[0]
    eager = got["eager"]
    for name in ("graphs", "graphs_tight"):
        padded = got[f"{name}_padded"]
        assert any(real < size for real, size in padded), f"{name}: no step was padded"
        assert got[name]["tokens"] == eager["tokens"] and got[name]["reasons"] == eager["reasons"], name
        for key in ("logprobs", "sampled_logprobs"):
            for a, b in zip(got[name][key], eager[key], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert got["graphs_tight_stats"]["preemptions"] > 0
    assert got["graphs_tight_stats"]["preemptions"] == got["tight_stats"]["preemptions"]
    assert not got["tight_padded"] and not got["eager"].get("padded")
    # FP8: every step (prefills, decode steps, prefills again after preemption) holds a multiple of 8
    # tokens, as TE's FP8 GEMMs assert; the tokens are unchanged.
    assert got["fp8"]["tokens"] == eager["tokens"] and got["fp8_stats"]["preemptions"] > 0
    assert got["fp8_fed"] and all(n % 8 == 0 for n in got["fp8_fed"]), got["fp8_fed"]


def test_samples_of_a_prompt_share_its_prefill(ref):
    assert ref["fed_tokens"] == ref["fed_expected"]
    # Under the reserved budget a prompt's 3 samples (2 blocks each) do not fit at once: forks only
    # for the samples admitted together, the others prefill again later.
    assert 0 < ref["sampled_reserved_forks"] < len(PROMPTS) * (SAMPLED.n - 1)
    assert ref["greedy_reserved_forks"] == 0


def test_on_finished_fires_while_others_decode(ref):
    got = ref["callbacks"]
    assert got["forwards"] == GREEDY.max_new_tokens
    by_index = {i: (after, length) for i, after, length in got["calls"]}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[2] == (3, 3), "the short sample is handed over right after its third token"
    assert by_index[0] == by_index[1] == (GREEDY.max_new_tokens, GREEDY.max_new_tokens)
    assert got["same_objects"] == [12, 12, 3]


def test_empty_call_returns_empty_batch(ref):
    assert ref["empty"] == (0, 0)


def test_missing_flash_attn_is_a_clear_error(ref):
    assert ref["without_flash_attn"].startswith("RuntimeError: generate() runs Megatron's paged KV cache, "
                                                "which needs flash-attn >= 2.7.3")


def test_request_that_can_never_fit_names_the_key(ref):
    assert "rollout.kv_cache_bytes" in ref["never_fits"] and "needs 3" in ref["never_fits"]


@pytest.fixture(scope="module")
def moe_ref(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("moe") / "w")
    return weights, run_distributed(moe_worker, 1, ParallelConfig(), weights, True)[0]


def test_expert_parallel_lockstep_across_data_parallel(moe_ref):
    """EP=2 x DP=2: rank 1's response ends after 3 tokens, then rank 1 has no prompts at all. It
    runs dummy forwards for rank 0's remaining steps; each rank's tokens equal one process's."""
    weights, ref = moe_ref
    ranks = run_distributed(moe_worker, 2, ParallelConfig(expert_model_parallel_size=2), weights, False,
                            timeout_s=240)
    for rank, got in enumerate(ranks):
        assert got[rank]["tokens"] == ref[rank]["tokens"]
    assert ranks[0][0]["steps"] == ranks[1][1]["steps"] == 10
    assert (ranks[0][0]["dummy"], ranks[1][1]["dummy"]) == (0, 10 - 3)
    assert ranks[0]["alone"]["tokens"] == ref[0]["tokens"]
    assert ranks[1]["alone"] == {"tokens": [], "steps": 10, "dummy": 10}
    assert len(EP_PROMPTS[1]) == 1


def test_expert_parallel_ranks_pad_to_one_graph_size(moe_ref):
    """EP=2 x DP=2 with rollout.cuda_graphs: the EP group agrees on each step's size (a MAX over the
    group inside the context, which idle ranks join: without that, rank 1's dummy steps hang the
    group), and the tokens are one process's."""
    weights, ref = moe_ref
    ranks = run_distributed(moe_worker, 2, ParallelConfig(expert_model_parallel_size=2), weights, False, 2,
                            timeout_s=240)
    for rank, got in enumerate(ranks):
        assert got[rank]["tokens"] == ref[rank]["tokens"]
    assert ranks[0]["alone"]["tokens"] == ref[0]["tokens"]
    assert ranks[1]["alone"] == {"tokens": [], "steps": 10, "dummy": 10}
    # Rank 0's 9 decode steps of each call run on its 2-request graph size; rank 1 (one request slot)
    # has no size that holds the group's 2 tokens, so its steps run eagerly.
    assert ranks[0]["padded_steps"] == [(2, 2)] * 18 and ranks[1]["padded_steps"] == []


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                   expert_tensor_parallel_size=1),
], ids=["tp2-sp", "tp2-sp-ep2-etp1"])
def test_moe_tensor_and_sequence_parallel_match_one_process(moe_ref, parallel):
    weights, ref = moe_ref
    for got in run_distributed(moe_worker, 2, parallel, weights, False, timeout_s=240):
        assert got[0]["tokens"] == ref[0]["tokens"] and got[1]["tokens"] == ref[1]["tokens"]
        assert got["sequence_parallel_restored"]
        before, after = got["sequence_parallel_state"]
        assert after == before, [(x, y) for x, y in zip(before, after) if x != y]


def test_samples_share_their_prompt_blocks(ref):
    """4 prompts of 40-63 tokens x 4 samples in 23 blocks of 8 tokens (one sample at its longest needs
    11): with the prompt's full blocks shared, a group costs its prompt once, so more samples decode at
    once than with a copy per sample; preemptions free a shared block only with its last holder; the
    tokens are those of an unlimited budget either way, and every block is back in the pool (no
    holder left) when the call ends."""
    from paged_workers import shared_prompt_worker

    got = run_distributed(shared_prompt_worker, 1, ref["weights_dir"])[0]
    assert got["shared"] == got["full"] and got["copied"] == got["full"]
    shared, copied = got["shared_stats"], got["copied_stats"]
    assert shared["peak_requests"] > copied["peak_requests"], (shared, copied)
    assert shared["preemptions"] > 0, shared
    for name in ("shared", "copied"):
        for free, total, holders in got[f"{name}_returned"]:
            assert (free, holders) == (total, 0), got[f"{name}_returned"]
