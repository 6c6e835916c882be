"""vocab_parallel_truncated_logprobs (top-k / top-p, as the sampler truncates) against a float64
reference written out per row, values and gradients, on one process and at TP=2."""

import math

import pytest
import torch

from megatron_cascade.ops import vocab_parallel_truncated_logprobs
from megatron_cascade.testing import run_distributed

VOCAB, REAL = 48, 45  # 3 padding columns, never in the distribution


def _data(seed=0, shape=(5, 7)):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, VOCAB, generator=gen, dtype=torch.float64) * 2
    logits[0, 0, :4] = 5.0  # ties at the top-k boundary are all kept (as the sampler keeps them)
    targets = torch.randint(0, REAL, shape, generator=gen)
    grad_out = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return logits, targets, grad_out


def _kept(row: list[float], top_k: int, top_p: float) -> list[bool]:
    """Which ids of one row survive: real ids, then the top-k by value (ties kept), then the smallest
    most-likely prefix whose mass before it is < top_p (the first token always)."""
    real = [i for i in range(REAL)]
    if 0 < top_k < len(real):
        kth = sorted((row[i] for i in real), reverse=True)[top_k - 1]
        real = [i for i in real if row[i] >= kth]
    order = sorted(real, key=lambda i: -row[i])
    z = sum(math.exp(row[i]) for i in order)
    kept, before = set(), 0.0
    for pos, i in enumerate(order):
        if pos > 0 and before >= top_p:
            break
        kept.add(i)
        before += math.exp(row[i]) / z
    return [i in kept for i in range(VOCAB)]


def _reference(logits, targets, grad_out, top_k, top_p):
    flat = logits.reshape(-1, VOCAB)
    keep = torch.tensor([_kept(r, top_k, top_p) for r in flat.tolist()]).reshape(logits.shape)
    x = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lp = lp.clamp(min=-1e4)
    (lp * grad_out).sum().backward()
    p = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    entropy = -(p * torch.log(p.clamp(min=1e-300))).sum(-1)
    return lp.detach(), x.grad, entropy


CASES = [(0, 0.9), (5, 1.0), (7, 0.6), (1, 1.0)]


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("top_k,top_p", CASES)
def test_single_process_matches_float64_reference(top_k, top_p, chunk_size):
    logits, targets, grad_out = _data()
    ref_lp, ref_grad, ref_entropy = _reference(logits, targets, grad_out, top_k, top_p)
    x = logits.clone().requires_grad_(True)
    before = x.detach().clone()
    lp, entropy = vocab_parallel_truncated_logprobs(x, targets, top_k=top_k, top_p=top_p, vocab_size=REAL,
                                                    with_entropy=True, chunk_size=chunk_size)
    (lp * grad_out).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(x.grad, ref_grad, atol=1e-10, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-10, rtol=0)
    assert (lp > -1e4).any() and (lp == -1e4).any() == bool((ref_lp == -1e4).any())
    assert torch.equal(x.detach(), before), "input logits were modified"


def test_bfloat16_logits_accumulate_in_float32():
    logits, targets, grad_out = _data(seed=4)
    ref_lp, ref_grad, _ = _reference(logits.bfloat16().double(), targets, grad_out, 5, 0.9)
    x = logits.bfloat16().requires_grad_(True)
    lp, _ = vocab_parallel_truncated_logprobs(x, targets, top_k=5, top_p=0.9, vocab_size=REAL)
    (lp.double() * grad_out).sum().backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), ref_grad, atol=1e-2, rtol=0)


def _tp2_worker(logits, targets, grad_out, cases):
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    shard = logits.shape[-1] // 2
    for top_k, top_p in cases:
        x = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        lp, entropy = vocab_parallel_truncated_logprobs(x, targets, top_k=top_k, top_p=top_p, group=dist.group.WORLD,
                                                        vocab_size=REAL, with_entropy=True, chunk_size=3)
        (lp * grad_out).sum().backward()
        out.append((lp.detach(), x.grad, entropy))
    return out


def test_tensor_parallel_equals_reference():
    """TP=2 (vocab shards exchanged for token shards and back, 35 tokens: one padding row)."""
    logits, targets, grad_out = _data(seed=1)
    ranks = run_distributed(_tp2_worker, 2, logits, targets, grad_out, CASES)
    for case, (top_k, top_p) in enumerate(CASES):
        ref_lp, ref_grad, ref_entropy = _reference(logits, targets, grad_out, top_k, top_p)
        grads = []
        for rank in range(2):
            lp, grad, entropy = ranks[rank][case]
            torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
            torch.testing.assert_close(entropy, ref_entropy, atol=1e-10, rtol=0)
            grads.append(grad)
        torch.testing.assert_close(torch.cat(grads, -1), ref_grad, atol=1e-10, rtol=0)


def test_untruncated_equals_plain_log_softmax():
    logits, targets, _ = _data(seed=2)
    lp, _ = vocab_parallel_truncated_logprobs(logits, targets, top_k=0, top_p=1.0)
    ref = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, atol=1e-12, rtol=0)
