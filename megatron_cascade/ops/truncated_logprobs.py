"""Log-probs and entropy under the top-k / top-p truncated distribution the sampler draws from.

With ``rollout.top_k`` / ``rollout.top_p`` the policy that generated a response is not
``softmax(logits / T)`` but its truncation to the top-k, then top-p, tokens, renormalised. Training on
the untruncated log-probs would follow the gradient of another policy, and the IS ratio against the
sampler's log-probs would compare two distributions. Here the trainer applies exactly the sampler's
filters (:mod:`megatron_cascade.ops.filters`, shared with ``rollout/sampling.py``).

Top-p needs each token's whole distribution sorted, which a vocabulary shard does not have: the
vocab-sharded logits ``[N, V/TP]`` are exchanged (all-to-all) into token shards ``[N/TP, V]``, each rank
filters and normalises its tokens over the full vocabulary, and the per-token results are gathered
back. The exchange is its own inverse in backward, so the op is differentiable in the logits.
Chunked over tokens (forward and backward); memory: at TP > 1 the token-sharded copy ([N/TP, V], the
size of the local logits), a bool per logit (the kept set, for the backward) and one chunk's temporaries.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.ops.filters import filter_top_k_top_p, mask_padded_vocab
from megatron_cascade.ops.logprobs import _accumulation_dtype, _group_size


LOGPROB_FLOOR = -1e4  # nats: exp() of it is 0 in float32 (the RL losses mask such tokens: losses/base.py)
# Elements of one chunk's float32 temporaries (16 MiB): the sort behind top-p makes several.
_CHUNK_ELEMENTS = 1 << 22


def _vocab_to_token_shards(x: torch.Tensor, group) -> torch.Tensor:
    """[N, V/TP] (N divisible by TP) -> [N/TP, V]: rank r gets rows r*N/TP.. with every vocab shard."""
    tp = _group_size(group)
    n, v_local = x.shape
    recv = torch.empty(tp, n // tp, v_local, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, x.contiguous(), group=group)  # recv[s] = rank s's shard of my rows
    return recv.permute(1, 0, 2).reshape(n // tp, tp * v_local)


def _token_to_vocab_shards(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_vocab_to_token_shards`: [N/TP, V] -> [N, V/TP]."""
    tp = _group_size(group)
    rows, v = y.shape
    send = y.reshape(rows, tp, v // tp).permute(1, 0, 2).contiguous()  # send[s] = shard s of my rows
    out = torch.empty(tp * rows, v // tp, dtype=y.dtype, device=y.device)
    dist.all_to_all_single(out, send.reshape(tp * rows, v // tp), group=group)
    return out


class _ToTokenShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _vocab_to_token_shards(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _token_to_vocab_shards(grad.contiguous(), ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """All-gather per-token values [N/TP] -> [N]. Every rank computes the same loss from the gathered
    values (as with vocab-parallel log-probs), so each rank's gradient is its own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(_group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def _keep_mask(x: torch.Tensor, top_k: int, top_p: float, vocab_size: Optional[int]) -> torch.Tensor:
    """[rows, V] bool: the ids the sampler may draw (real vocabulary, then top-k, then top-p)."""
    if vocab_size is not None:
        x = mask_padded_vocab(x, vocab_size)
    return torch.isfinite(filter_top_k_top_p(x, top_k, top_p))


class _TruncatedLogprobs(torch.autograd.Function):
    """Chunked over tokens: each chunk's kept set (a sort per token for top-p) and log-sum-exp over
    it; the backward recomputes each chunk's probabilities from the saved log-sum-exp and kept set
    (a bool per logit) instead of keeping a float copy of the logits' size."""

    @staticmethod
    def forward(ctx, logits, targets, top_k, top_p, vocab_size, chunk):
        n = logits.shape[0]
        acc = _accumulation_dtype(logits)
        picked = torch.empty(n, dtype=acc, device=logits.device)
        entropy = torch.empty(n, dtype=acc, device=logits.device)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        for lo in range(0, n, chunk):
            x = logits[lo:lo + chunk].to(acc)
            k = keep[lo:lo + chunk]
            k.copy_(_keep_mask(x, top_k, top_p, vocab_size))
            masked = x.masked_fill(~k, float("-inf"))
            lse[lo:lo + chunk] = torch.logsumexp(masked, dim=-1)
            t = targets[lo:lo + chunk].unsqueeze(-1)
            picked[lo:lo + chunk] = (masked.gather(-1, t).squeeze(-1) - lse[lo:lo + chunk]).clamp(min=LOGPROB_FLOOR)
            probs = (masked - lse[lo:lo + chunk, None]).exp()
            entropy[lo:lo + chunk] = lse[lo:lo + chunk] - torch.where(k, probs * x, torch.zeros_like(x)).sum(-1)
        ctx.save_for_backward(logits, targets, lse, keep)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        logits, targets, lse, keep = ctx.saved_tensors
        grad = torch.empty_like(logits)
        chunk = ctx.chunk
        for lo in range(0, logits.shape[0], chunk):
            x = logits[lo:lo + chunk].to(lse.dtype)
            k = keep[lo:lo + chunk]
            t = targets[lo:lo + chunk].unsqueeze(-1)
            # A target outside the kept set got the floor: no gradient reaches its row.
            g = grad_picked[lo:lo + chunk].to(lse.dtype) * k.gather(-1, t).squeeze(-1)
            probs = torch.where(k, (x - lse[lo:lo + chunk, None]).exp(), torch.zeros_like(x))
            part = -g[:, None] * probs
            part.scatter_add_(-1, t, g[:, None])
            grad[lo:lo + chunk] = part.to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_truncated_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    top_k: int,
    top_p: float,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of each target (and optionally the entropy) under softmax(logits) truncated to the
    top-k, then top-p, tokens and renormalised — the distribution the sampler draws from.

    Args:
        logits: [..., V_local] this rank's vocabulary shard (divide by the temperature first).
        targets: [...] global token ids.
        top_k: keep the k most likely tokens (0: all); top_p: keep the smallest most-likely set
            reaching this mass (1.0: all).
        group: tensor-parallel group the vocabulary is sharded over (None: not sharded).
        vocab_size: real tokens (padding columns never sampled); None = all columns are real.
        with_entropy: also return the entropy (nats) of the truncated distribution (no gradient).
        chunk_size: tokens per chunk (default: about 16 MiB of float32 temporaries per chunk).

    Returns:
        ([...] float32 log-probs (float64 for float64 logits), differentiable in ``logits``;
        a target outside the kept set gets ``LOGPROB_FLOOR`` and no gradient), and [...] entropies or None.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without the "
                         f"vocab dim {tuple(logits.shape[:-1])}")
    lead, tp = targets.shape, _group_size(group)
    flat = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    n = flat.shape[0]
    pad = (-n) % tp  # all-to-all needs the tokens split evenly over the TP ranks
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        flat_targets = torch.cat([flat_targets, flat_targets.new_zeros(pad)])
    rows = (n + pad) // tp
    rank = 0 if tp == 1 else dist.get_rank(group)
    mine = flat_targets[rank * rows:(rank + 1) * rows]
    full = flat if tp == 1 else _ToTokenShards.apply(flat, group)
    chunk = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, full.shape[-1]))
    picked, entropy = _TruncatedLogprobs.apply(full, mine, top_k, top_p, vocab_size, chunk)
    entropy = entropy if with_entropy else None
    if tp > 1:
        picked = _GatherTokens.apply(picked, group)
        entropy = None if entropy is None else _GatherTokens.apply(entropy, group)
    picked = picked[:n].reshape(lead)
    return picked, (None if entropy is None else entropy[:n].reshape(lead))
