"""``generate`` on the tiny Megatron model: KV cache vs recomputation, trainer log-probs, stopping,
seeds, padded vocabulary, and TP=2 / PP=2 against TP=PP=1 with the same weights.

One worker process per layout runs all of that layout's generations (process start and Megatron
import dominate the cost); the tests below assert on what the workers returned.
"""

import pytest
import torch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.testing import run_distributed
from rollout_workers import GREEDY, HOT, PROMPTS, SAMPLED, TOKENIZER, layout_worker, reference_worker

pytestmark = pytest.mark.distributed

LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rollout") / "weights")


@pytest.fixture(scope="module")
def ref(weights_dir):
    return run_distributed(reference_worker, 1, weights_dir)[0]


def _close(a, b, atol=LOGPROB_ATOL):
    for row_a, row_b in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(row_a), torch.tensor(row_b), atol=atol, rtol=0)


def test_kv_cache_equals_recomputation(ref):
    for kind in ("greedy", "sampled"):
        assert ref[kind]["tokens"] == ref[f"{kind}_nocache"]["tokens"], kind
        _close(ref[kind]["logprobs"], ref[f"{kind}_nocache"]["logprobs"])
        _close(ref[kind]["sampled_logprobs"], ref[f"{kind}_nocache"]["sampled_logprobs"])


@pytest.mark.parametrize("kind", ["greedy_train", "sampled_train", "hot_train"])
def test_logprobs_equal_trainer_forward(ref, kind):
    """Packed rollouts through a training forward: vocab_parallel_logprobs(logits / T, targets)."""
    check = ref[kind]
    assert check["tokens_checked"] >= 30
    assert check["vs_trainer"] < LOGPROB_ATOL
    assert check["vs_float64"] < LOGPROB_ATOL


def test_trainer_logprobs_are_of_the_truncated_distribution_sampled_from(ref):
    """With rollout.top_k / top_p the GRPO stage trains on the log-probs of the truncated distribution
    the responses were drawn from (as NeMo-RL), and its IS ratio compares them with the sampler's log-probs
    of that same distribution. Before, the trainer used the untruncated softmax: up to 0.69 nats off here."""
    check = ref["sampled_stage_train"]
    assert check["tokens_checked"] >= 30
    assert check["vs_sampled"] < LOGPROB_ATOL
    assert check["vs_batch"] < LOGPROB_ATOL


def test_prompts_of_different_lengths_are_left_padded_correctly(ref):
    # The trainer check packs each sample unpadded from position 0: equality there (above) means
    # left padding changed nothing. Here: the lengths really differ and every row got its tokens.
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    assert all(len(t) == GREEDY.max_new_tokens for t in ref["greedy"]["tokens"])


def test_batching_by_prompt_length_matches_left_padding(ref):
    # Prompts 0 and 3 have the same length and share a batch; the others run alone, unpadded.
    got = ref["greedy_grouped"]
    assert got["tokens"] == ref["greedy"]["tokens"] + ref["greedy"]["tokens"][:1]
    assert got["index"] == [(i, 0) for i in range(len(PROMPTS) + 1)]
    _close(got["logprobs"], ref["greedy"]["logprobs"] + ref["greedy"]["logprobs"][:1])


def test_sampled_logprobs_are_renormalised_and_greedy_is_point_mass(ref):
    for lp, slp in zip(ref["sampled"]["logprobs"], ref["sampled"]["sampled_logprobs"]):
        # Removing padded ids, top-k and top-p only shrinks the normaliser.
        assert all(s >= t - 1e-6 for s, t in zip(slp, lp))
        assert all(s <= 1e-6 for s in slp)
    assert all(v == 0.0 for row in ref["greedy"]["sampled_logprobs"] for v in row)


def test_top_k_one_equals_greedy(ref):
    assert ref["top_k1"]["tokens"] == ref["greedy"]["tokens"]


def test_seed_reproducibility_and_n_samples(ref):
    assert ref["sampled"]["tokens"] == ref["sampled_again"]["tokens"]
    assert ref["sampled"]["tokens"] != ref["sampled_seed2"]["tokens"]
    n = SAMPLED.n
    assert ref["sampled"]["index"] == [(p, s) for p in range(len(PROMPTS)) for s in range(n)]
    for p in range(len(PROMPTS)):
        group = ref["sampled"]["tokens"][p * n:(p + 1) * n]
        assert len({tuple(t) for t in group}) == n, "samples of one prompt should differ"


def test_padded_vocab_ids_never_sampled(ref):
    # At T=3 about a fifth of the model's probability sits on the padded ids 103..127 (returned by
    # the worker), so 192 unmasked draws would hit them; none may appear.
    assert ref["hot_train"]["pad_mass_mean"] > 0.1
    sampled = [t for row in ref["hot"]["tokens"] for t in row]
    assert len(sampled) == len(PROMPTS) * HOT.n * HOT.max_new_tokens
    assert max(sampled) < TOKENIZER.vocab_size


def test_finish_reasons(ref):
    assert ref["greedy"]["reasons"] == ["length"] * len(PROMPTS)
    row0 = ref["greedy"]["tokens"][0]
    # Stop token: the response ends at (and keeps) its first occurrence.
    cut = row0.index(ref["stop_id"]) + 1
    assert ref["by_id"]["tokens"] == [row0[:cut]] and ref["by_id"]["reasons"] == ["stop"]
    # Stop string: ends at the first token whose decoded prefix contains it.
    cut = next(i for i in range(1, len(row0) + 1) if ref["stop_string"] in TOKENIZER.decode(row0[:i]))
    assert ref["by_string"]["tokens"] == [row0[:cut]] and ref["by_string"]["reasons"] == ["stop"]


def test_max_sequence_length_budget_is_per_row(ref):
    # The limit leaves the longest prompt 3 tokens; the shorter ones keep max_new_tokens.
    got = ref["short_limit"]
    assert [len(t) for t in got["tokens"]] == [12, 12, 3]
    assert got["reasons"] == ["length"] * 3
    assert got["tokens"][:2] == ref["greedy"]["tokens"][:2]
    assert got["tokens"][2] == ref["greedy"]["tokens"][2][:3]


def test_model_mode_restored(ref):
    assert ref["restored_training_mode"] is True
    assert ref["eval_stays_eval"] is True


@pytest.mark.parametrize("tag,parallel", [
    ("tp2", ParallelConfig(tensor_model_parallel_size=2)),
    ("pp2", ParallelConfig(pipeline_model_parallel_size=2)),
], ids=["tp2", "pp2"])
def test_layout_matches_single_process(ref, weights_dir, tag, parallel):
    ranks = run_distributed(layout_worker, 2, parallel, weights_dir)
    for got in ranks:
        # Every rank returns the same batch: the sampled token is identical across TP and PP ranks.
        assert got["greedy"]["tokens"] == ref["greedy"]["tokens"]
        assert got["sampled"]["tokens"] == ref["sampled"]["tokens"]
        _close(got["greedy"]["logprobs"], ref["greedy"]["logprobs"])
        _close(got["sampled"]["logprobs"], ref["sampled"]["logprobs"])
    assert ranks[0] == ranks[1]
    if tag == "tp2":
        assert ranks[0]["sampled_train"]["vs_trainer"] < LOGPROB_ATOL
        # Truncated log-probs at TP=2: the vocab shards are exchanged for token shards and back.
        assert ranks[0]["sampled_stage_train"]["vs_sampled"] < LOGPROB_ATOL
    else:
        # Stages overlapped on two KV lanes: the same samples; every lane step counted per stage.
        got = ranks[0]["sampled_overlapped"]
        assert got["tokens"] == ref["sampled"]["tokens"]
        _close(got["logprobs"], ref["sampled"]["logprobs"])
        assert ranks[0]["overlapped_steps"] > SAMPLED.max_new_tokens
        for name in ("preempted", "preempted_overlapped"):  # KV on demand: preempted, same tokens
            got = ranks[0][name]
            assert got["tokens"] == ref["sampled"]["tokens"], name
            _close(got["logprobs"], ref["sampled"]["logprobs"])
            assert got["preemptions"] > 0, name
