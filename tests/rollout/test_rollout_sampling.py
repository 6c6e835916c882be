"""Sampling, stopping, left padding and packing as pure functions (no model, no processes)."""

import math

import pytest
import torch

from megatron_cascade.rollout import RolloutBatch, RolloutSample, SamplingParams, pack_rollouts
from megatron_cascade.rollout.layout import left_pad
from megatron_cascade.ops.filters import filter_top_k, filter_top_k_top_p, filter_top_p, mask_padded_vocab
from megatron_cascade.rollout.sampling import sample
from megatron_cascade.rollout.stopping import StopCriteria
from megatron_cascade.tokenizers import CharTokenizer

VOCAB, PADDED = 5, 8


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _logits():
    # Padded ids 5..7 have the largest logits: an unmasked sampler would pick them most of the time.
    return torch.tensor([[1.0, 2.0, 3.0, 0.5, -1.0, 9.0, 9.0, 9.0],
                         [0.0, 0.0, 4.0, 0.0, 3.5, 8.0, 8.0, 8.0]])


def test_padded_vocab_never_sampled():
    logits = _logits()
    params = SamplingParams(temperature=5.0)
    gen = _gen()
    for _ in range(200):
        assert sample(logits, params, VOCAB, gen).tokens.max() < VOCAB
    assert torch.isinf(mask_padded_vocab(logits, VOCAB)[:, VOCAB:]).all()
    with pytest.raises(ValueError, match="exceeds"):
        mask_padded_vocab(logits, PADDED + 1)


def test_greedy_and_top_k_one():
    logits = _logits()
    greedy = sample(logits, SamplingParams(temperature=0.0), VOCAB, None)
    assert greedy.tokens.tolist() == [2, 2]
    assert greedy.sampled_logprobs.tolist() == [0.0, 0.0]
    # Greedy reports the T=1 log-prob over the real vocabulary (trainer convention).
    torch.testing.assert_close(greedy.temperature_logprobs, torch.log_softmax(logits[:, :VOCAB], -1)[:, 2])
    top1 = sample(logits, SamplingParams(temperature=1.0, top_k=1), VOCAB, _gen())
    assert top1.tokens.tolist() == [2, 2]
    assert top1.sampled_logprobs.abs().max() == 0.0


def test_logprob_conventions():
    logits = _logits()
    params = SamplingParams(temperature=0.7, top_k=3)
    out = sample(logits, params, VOCAB, _gen(3))
    tokens = out.tokens
    trainer = torch.log_softmax(logits[:, :VOCAB] / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.temperature_logprobs, trainer)
    truncated = filter_top_k(mask_padded_vocab(logits, VOCAB) / 0.7, 3)
    expected = torch.log_softmax(truncated, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.sampled_logprobs, expected)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_top_k(logits, 2)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_top_p(logits, 0.1)).tolist() == [[True, False, False, False]]
    assert filter_top_k(logits, 0) is logits and filter_top_p(logits, 1.0) is logits


def test_sampling_matches_distribution_and_seed():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(4000, -1)
    params = SamplingParams(temperature=1.0, seed=0)
    tokens = sample(logits, params, 4, _gen(1)).tokens
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert (freq - probs).abs().max() < 0.03
    assert torch.equal(tokens, sample(logits, params, 4, _gen(1)).tokens)
    assert not torch.equal(tokens, sample(logits, params, 4, _gen(2)).tokens)


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(max_new_tokens=0), dict(n=0), dict(stop_strings=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_stop_criteria():
    tok = CharTokenizer()
    ids = tok.encode("abc</s>xy")
    stop = StopCriteria(SamplingParams(stop_strings=("</s>",)), tok)
    reasons = [stop.check(ids[:i], budget=100) for i in range(1, len(ids) + 1)]
    assert reasons.index("stop") == len("abc</s>") - 1
    assert stop.check([tok.eos_id], budget=100) == "stop"  # eos stops by default
    no_eos = StopCriteria(SamplingParams(ignore_eos=True, stop_token_ids=(7,)), tok)
    assert no_eos.check([tok.eos_id], budget=100) is None
    assert no_eos.check([7], budget=100) == "stop"
    assert no_eos.check([10, 11], budget=2) == "length"
    assert no_eos.check([7, 7], budget=2) == "stop"  # stop wins over length on the same token
    with pytest.raises(ValueError, match="tokenizer"):
        StopCriteria(SamplingParams(stop_strings=("x",)), None)


def test_left_pad_layout_and_mask():
    batch = left_pad([[5, 6, 7], [8]], pad_id=0, max_new_tokens=4, max_sequence_length=6)
    assert batch.prompt_width == 3 and batch.budgets == [3, 4] and batch.max_length == 7
    assert batch.tokens[:, :3].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.position_ids[1].tolist() == [0, 0, 0, 1, 2, 3, 4]
    mask = batch.attention_mask(0, 3)  # True = masked
    assert mask.shape == (2, 1, 3, 3)
    assert (~mask[0, 0]).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert (~mask[1, 0, 2]).tolist() == [False, False, True]
    batch.append(3, torch.tensor([1, 2]))
    assert (~batch.attention_mask(3, 4)[1, 0, 0]).tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="no room"):
        left_pad([[1] * 6], pad_id=0, max_new_tokens=4, max_sequence_length=6)
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[]], pad_id=0, max_new_tokens=4, max_sequence_length=6)


def test_pack_rollouts_alignment():
    samples = [
        RolloutSample(0, 0, [1, 2, 3], [4, 5], [-0.1, -0.2], [-0.01, -0.02], "stop"),
        RolloutSample(1, 0, [6], [7, 8, 9], [-0.3, -0.4, -0.5], [-0.03, -0.04, -0.05], "length"),
    ]
    packed = pack_rollouts(RolloutBatch(samples, SamplingParams()), pad_id=0)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert packed.targets.tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 0, 0]]
    assert packed.loss_mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    lp = packed.inference_logprobs
    # Position t holds the log-prob of targets[t]: the response tokens 4, 5 and 7, 8, 9.
    assert [round(v, 4) for v in lp[0].tolist()] == [0, 0, -0.1, -0.2, 0]
    assert [round(v, 4) for v in lp[1].tolist()] == [-0.3, -0.4, -0.5, 0, 0]
    assert packed.prompt_lengths.tolist() == [3, 1] and packed.response_lengths.tolist() == [2, 3]
    sampled = pack_rollouts(RolloutBatch(samples, SamplingParams()), pad_id=0, seq_length=6, logprobs="sampled")
    assert sampled.tokens.shape == (2, 6)
    assert math.isclose(sampled.inference_logprobs[1, 0].item(), -0.03, rel_tol=1e-6)
    with pytest.raises(ValueError, match="shorter"):
        pack_rollouts(RolloutBatch(samples, SamplingParams()), pad_id=0, seq_length=4)


def test_top_k_then_top_p_ranks_only_the_top_k():
    """The combined filter (a topk of the survivors instead of a sort of the vocabulary) keeps what
    top-p after top-k keeps. Ties at the k-th value all survive top-k; where top-p then cuts inside a
    run of equal logits, which of them stay is arbitrary (sort and topk order ties differently): the
    count is the same. The sampler and the trainer use this one function, so they always agree."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=gen) * 3
    logits[0, :6] = 9.0  # six tied at the top: top-k 4 keeps all six, top-p cuts among them
    for k, p in [(4, 0.5), (50, 0.9), (1, 0.3), (499, 0.99), (0, 0.8), (20, 1.0)]:
        got = torch.isfinite(filter_top_k_top_p(logits, k, p))
        expected = torch.isfinite(filter_top_p(filter_top_k(logits, k), p))
        assert torch.equal(got[1:], expected[1:]), (k, p)
        assert got[0].sum() == expected[0].sum() and bool((got[0] <= (logits[0] >= 9.0) | expected[0]).all())
