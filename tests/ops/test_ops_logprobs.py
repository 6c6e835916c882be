"""vocab_parallel_logprobs / entropy against float64 log_softmax, on one process and at TP=2."""

import pytest
import torch

from megatron_cascade.ops import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_cascade.testing import run_distributed


def _data(seed=0, shape=(3, 7), vocab=50, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=gen)
    grad_out = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return logits, targets, grad_out


def _reference(logits, targets, grad_out):
    x = logits.detach().double().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (lp * grad_out).sum().backward()
    return lp.detach(), x.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
def test_single_process_matches_float64_reference(chunk_size):
    logits, targets, grad_out = _data()
    ref_lp, ref_grad = _reference(logits, targets, grad_out)
    x = logits.clone().requires_grad_(True)
    before = x.detach().clone()
    lp = vocab_parallel_logprobs(x, targets, chunk_size=chunk_size)
    (lp.double() * grad_out).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(x.grad, ref_grad, atol=1e-10, rtol=0)
    assert torch.equal(x.detach(), before), "input logits were modified"


def test_entropy_matches_reference():
    logits, _, _ = _data(seed=3)
    probs = torch.softmax(logits, -1)
    ref = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(vocab_parallel_entropy(logits, chunk_size=5), ref, atol=1e-10, rtol=0)


def test_float32_and_bfloat16_inputs_accumulate_in_float32():
    logits, targets, _ = _data(seed=4)
    ref = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)]:
        lp = vocab_parallel_logprobs(logits.to(dtype), targets, chunk_size=2)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), ref, atol=tol, rtol=0)


def test_shape_mismatch_is_a_clear_error():
    logits, targets, _ = _data()
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_logprobs(logits, targets[:, :-1])


def _tp2_worker(logits, targets, grad_out, chunk_size):
    rank = torch.distributed.get_rank()
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    before = shard.detach().clone()
    lp = vocab_parallel_logprobs(shard, targets, group=torch.distributed.group.WORLD, chunk_size=chunk_size)
    (lp.double() * grad_out).sum().backward()
    ent = vocab_parallel_entropy(shard.detach(), group=torch.distributed.group.WORLD, chunk_size=chunk_size)
    return lp.detach(), shard.grad, ent, torch.equal(shard.detach(), before)


@pytest.mark.distributed
def test_tp2_matches_full_vocab_log_softmax():
    """At TP=2 (two gloo processes, each with half the vocab) vs log_softmax on the full vocab."""
    logits, targets, grad_out = _data(seed=1, vocab=64)
    ref_lp, ref_grad = _reference(logits, targets, grad_out)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    results = run_distributed(_tp2_worker, 2, logits, targets, grad_out, 5, cpu_mode=False)
    for lp, _, ent, unchanged in results:
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-10, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
        assert unchanged, "input logits were modified"
    full_grad = torch.cat([r[1] for r in results], dim=-1)
    torch.testing.assert_close(full_grad, ref_grad, atol=1e-10, rtol=0)


def test_entropy_leaves_vocab_padding_out():
    """Padding columns (untrained embedding rows) are not tokens the sampler can draw: before, their
    logits entered the entropy's softmax."""
    logits, _, _ = _data(seed=4, vocab=64)
    real = torch.log_softmax(logits[..., :50], -1)
    ref = -(real.exp() * real).sum(-1)
    torch.testing.assert_close(vocab_parallel_entropy(logits, chunk_size=5, vocab_size=50), ref, atol=1e-10, rtol=0)


def test_vocab_padding_is_left_out_of_the_softmax():
    logits, targets, grad_out = _data(seed=5, vocab=64)
    targets = targets % 50
    ref_lp, ref_grad = _reference(logits[..., :50], targets, grad_out)
    x = logits.clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(x, targets, chunk_size=3, vocab_size=50)
    (lp * grad_out).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(x.grad[..., :50], ref_grad, atol=1e-10, rtol=0)
    assert torch.all(x.grad[..., 50:] == 0)
    with pytest.raises(ValueError, match="padding id"):
        vocab_parallel_logprobs(logits, torch.full_like(targets, 55), vocab_size=50)


def _tp2_padded_worker(logits, targets):
    rank = torch.distributed.get_rank()
    shard = logits.chunk(2, dim=-1)[rank]
    # vocab 20 of 64 columns: rank 1's shard is padding only.
    group = torch.distributed.group.WORLD
    return (vocab_parallel_logprobs(shard, targets, group=group, vocab_size=20),
            vocab_parallel_entropy(shard, group=group, vocab_size=20))


@pytest.mark.distributed
def test_tp2_with_a_shard_of_padding_only():
    logits, targets, _ = _data(seed=6, vocab=64)
    targets = targets % 20
    ref = torch.log_softmax(logits[..., :20], -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    real = torch.log_softmax(logits[..., :20], -1)
    ref_entropy = -(real.exp() * real).sum(-1)
    for lp, entropy in run_distributed(_tp2_padded_worker, 2, logits, targets, cpu_mode=False):
        torch.testing.assert_close(lp, ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-10, rtol=0)
