"""Token log-probabilities and entropy from vocab-sharded logits, chunked over tokens.

The logits of a large-vocabulary model are the biggest activation of an RL step ([tokens, vocab]);
a float32 ``log_softmax`` copy of them doubles that, and its backward keeps both. Here each chunk of
tokens is reduced to one log-sum-exp per token (combined across the tensor-parallel group with two
small all-reduces), the forward keeps only [tokens]-sized tensors, and the backward writes the
gradient straight into its output buffer. The input logits are never modified.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# Elements of a float32 temporary per chunk (64 MiB): small against the logits, large enough that
# per-chunk overhead does not show (the dry run plans the fused head's buffers from it).
CHUNK_ELEMENTS = 1 << 24


def _default_chunk(vocab_local: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab_local))


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for 16/32-bit logits, float64 for float64 (so the float64 tests are exact)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks of ``group`` (1 for None: not sharded)."""
    return 1 if group is None else dist.get_world_size(group)


def _vocab_range(vocab_local: int, group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None else 0
    return rank * vocab_local, (rank + 1) * vocab_local


def _global_logsumexp(local_lse: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """log(sum_r exp(lse_r)) over the ranks of ``group``, stable: two all-reduces of [chunk]."""
    if _group_size(group) == 1:
        return local_lse
    shift = local_lse.clone()
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    total = (local_lse - shift).exp()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return shift + total.log()


def _local_target_logit(chunk: torch.Tensor, targets: torch.Tensor, start: int, end: int) -> tuple:
    """Logit of each target on this shard (0 where the target lives on another shard), and the mask."""
    on_shard = (targets >= start) & (targets < end)
    local_ids = torch.where(on_shard, targets - start, torch.zeros_like(targets))
    picked = chunk.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1).to(_accumulation_dtype(chunk))
    return torch.where(on_shard, picked, torch.zeros_like(picked)), on_shard, local_ids


def _valid_columns(vocab_local: int, start: int, vocab_size: Optional[int]) -> int:
    """How many of this shard's columns are real tokens (the rest is vocabulary padding)."""
    if vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, vocab_size - start))


def _chunk_logsumexp(chunk: torch.Tensor, valid: int, acc: torch.dtype) -> torch.Tensor:
    if valid == 0:
        return torch.full((chunk.shape[0],), float("-inf"), dtype=acc, device=chunk.device)
    return torch.logsumexp(chunk[:, :valid].to(acc), dim=-1)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, chunk_size, vocab_size):
        n, vocab_local = logits.shape
        start, end = _vocab_range(vocab_local, group)
        valid = _valid_columns(vocab_local, start, vocab_size)
        acc = _accumulation_dtype(logits)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        target_logit = torch.empty(n, dtype=acc, device=logits.device)
        for lo in range(0, n, chunk_size):
            hi = min(n, lo + chunk_size)
            chunk = logits[lo:hi]
            lse[lo:hi] = _chunk_logsumexp(chunk, valid, acc)
            target_logit[lo:hi] = _local_target_logit(chunk, targets[lo:hi], start, end)[0]
        if _group_size(group) > 1:
            dist.all_reduce(target_logit, group=group)
            lse = _global_logsumexp(lse, group)
        ctx.save_for_backward(logits, targets, lse)
        ctx.group, ctx.chunk_size, ctx.start, ctx.end, ctx.valid = group, chunk_size, start, end, valid
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        acc = _accumulation_dtype(logits)
        grad_out = grad_out.to(acc)
        for lo in range(0, logits.shape[0], ctx.chunk_size):
            hi = min(logits.shape[0], lo + ctx.chunk_size)
            g = grad_out[lo:hi]
            # d logp(y) / d x_v = 1[v == y] - softmax(x)_v
            probs = (logits[lo:hi].to(acc) - lse[lo:hi, None]).exp_()
            probs.mul_(-g[:, None])
            on_shard = (targets[lo:hi] >= ctx.start) & (targets[lo:hi] < ctx.end)
            rows = torch.nonzero(on_shard).squeeze(-1)
            probs[rows, targets[lo:hi][rows] - ctx.start] += g[rows]
            probs[:, ctx.valid:] = 0  # vocabulary padding is outside the distribution
            grad[lo:hi] = probs
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """log softmax(logits)[target] per token, from logits sharded over the vocabulary.

    Args:
        logits: [..., V_local] this rank's vocabulary shard (rank r holds ids [r*V_local, (r+1)*V_local)),
            any float dtype; not modified. Scale by 1/temperature before calling if sampling used one.
        targets: [...] global token ids (int64).
        group: the tensor-parallel group the vocabulary is sharded over; None = not sharded.
        chunk_size: tokens per chunk (default: about 64 MiB of float32 temporaries per chunk).
        vocab_size: number of real tokens; columns >= vocab_size (embedding padding) are left out
            of the softmax, as the sampler leaves them out. None = all columns are real.

    Returns:
        [...] log-probabilities (float32; float64 for float64 logits), differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without the "
                         f"vocab dim {tuple(logits.shape[:-1])}")
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    chunk = chunk_size or _default_chunk(logits.shape[-1])
    if vocab_size is not None and bool((flat_targets >= vocab_size).any()):
        raise ValueError(f"a target id is >= vocab_size={vocab_size} (a padding id cannot be a target)")
    out = _VocabParallelLogprobs.apply(flat_logits, flat_targets, group, chunk, vocab_size)
    return out.reshape(lead)


@torch.no_grad()
def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) per token, from vocab-sharded logits; a metric (no gradient).

    Args:
        logits: [..., V_local] this rank's vocabulary shard; not modified.
        group: the tensor-parallel group; None = not sharded.
        chunk_size: tokens per chunk.
        vocab_size: number of real tokens; padding columns are left out of the distribution (as in
            :func:`vocab_parallel_logprobs`). None = all columns are real.

    Returns:
        [...] float32 entropies (float64 for float64 logits).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_size or _default_chunk(logits.shape[-1])
    n, acc = flat.shape[0], _accumulation_dtype(logits)
    start, _ = _vocab_range(flat.shape[-1], group)
    valid = _valid_columns(flat.shape[-1], start, vocab_size)
    lse = torch.empty(n, dtype=acc, device=logits.device)
    for lo in range(0, n, chunk):
        lse[lo:lo + chunk] = _chunk_logsumexp(flat[lo:lo + chunk], valid, acc)
    lse = _global_logsumexp(lse, group)
    expected_logit = torch.zeros(n, dtype=acc, device=logits.device)  # E_p[logit], this shard's share
    for lo in range(0, n, chunk):
        part = flat[lo:lo + chunk, :valid].to(acc)
        expected_logit[lo:lo + chunk] = ((part - lse[lo:lo + chunk, None]).exp() * part).sum(-1)
    if _group_size(group) > 1:
        dist.all_reduce(expected_logit, group=group)
    return (lse - expected_logit).reshape(logits.shape[:-1])
