"""Token log-probabilities (and entropy) straight from the last hidden states: output layer fused in.

``vocab_parallel_logprobs`` avoids a second copy of the logits, but the logits themselves
([tokens, V/TP], 7.6 GB per GPU at 50K tokens) and, in training, their gradient still exist. Here the
output projection ``hidden @ weight.T`` runs one chunk of tokens at a time: each chunk's logits are
reduced to a log-sum-exp and a target logit (per token) and dropped; the backward recomputes them
chunk by chunk and turns them straight into the gradients of ``hidden`` and ``weight``. Nothing
[tokens, vocab]-sized is ever held; the log-sum-exp is combined across the tensor-parallel group with
the small all-reduces of :mod:`megatron_cascade.ops.logprobs`. The trainer's forward steps (training,
teacher, reference and old-policy log-probs) use it in place of the model's output layer
(``training/output_head.py``).

Tensor-parallel convention (that of Megatron's output layer, a ColumnParallelLinear, followed by its
vocab-parallel cross-entropy): ``hidden`` is replicated over the TP group, ``weight`` is this rank's
vocabulary shard, the log-probs come out replicated. The gradient of ``weight`` is this rank's shard
of the true gradient. The gradient of ``hidden`` is, by default, the true gradient on every rank —
the sum over TP ranks of each shard's part, all-reduced here as ColumnParallelLinear's
``copy_to_tensor_model_parallel_region`` does in its backward. With ``reduce_hidden_grad=False`` it
is this rank's part only, for a caller that reduces it itself (under sequence parallelism the hidden
states are all-gathered over the sequence before the output layer and the gradient is
reduce-scattered back, half the traffic of an all-reduce).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron_cascade.ops.logprobs import (
    _accumulation_dtype,
    _default_chunk,
    _global_logsumexp,
    _group_size,
    _local_target_logit,
    _valid_columns,
    _vocab_range,
)


class _Workspace:
    """[chunk, V_local] buffers that every chunk reuses.

    A fresh 64 MiB tensor per chunk costs its page faults every time (on CPU about as long as the
    log-softmax over it), so the GEMM writes into one buffer and the softmax into another. ``wgrad``:
    a weight-sized buffer for each chunk's 16-bit weight gradient before it is added in float32.
    """

    def __init__(self, chunk: int, weight: torch.Tensor, acc: torch.dtype, *, softmax: bool, wgrad: bool):
        shape = (chunk, weight.shape[0])
        self.logits = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        self.acc = self.logits if weight.dtype == acc else torch.empty(shape, dtype=acc, device=weight.device)
        self.softmax = torch.empty(shape, dtype=acc, device=weight.device) if softmax else None
        self.wgrad = torch.empty_like(weight) if wgrad and weight.dtype != acc else None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, ws: _Workspace, valid: int,
                  temperature: float) -> torch.Tensor:
    """``(hidden @ weight.T) / temperature`` for one chunk, [chunk, V_local] in the accumulation dtype.

    The product is rounded to the input dtype first, as the output layer produces its logits (the
    GEMM accumulates in float32 inside), so the values equal the unfused path's; the temperature
    divides the upcast values, as the sampler does. Padding columns (>= ``valid``) are set to -inf:
    outside the distribution, they get probability 0 in every softmax below.
    """
    n = hidden.shape[0]
    logits = torch.mm(hidden, weight.t(), out=ws.logits[:n])
    x = logits if ws.acc is ws.logits else ws.acc[:n].copy_(logits)
    if temperature != 1.0:
        x.div_(temperature)
    x[:, valid:] = float("-inf")
    return x


def _chunk_stats(x: torch.Tensor, valid: int, ws: _Workspace, with_entropy: bool) -> tuple:
    """This shard's log-sum-exp [chunk] and, with ``with_entropy``, sum_v softmax_shard(x)_v * x_v."""
    n = x.shape[0]
    if valid == 0:
        lse = torch.full((n,), float("-inf"), dtype=x.dtype, device=x.device)
        return lse, torch.zeros_like(lse) if with_entropy else None
    # log_softmax into a reused buffer is ~4x faster on CPU than torch.logsumexp (which makes its own
    # temporaries); at the row's argmax log_softmax = -log(sum exp(x - max)), so max(x) - max(ls) is the
    # log-sum-exp, as precise as logsumexp's own.
    ls = torch.log_softmax(x, -1, out=ws.softmax[:n])
    lse = x.amax(-1) - ls.amax(-1)
    expected = ls[:, :valid].exp_().mul_(x[:, :valid]).sum(-1) if with_entropy else None
    return lse, expected


def _entropy(local_lse: torch.Tensor, lse: torch.Tensor, local_expected: torch.Tensor,
             group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """lse - E_p[x], with E_p[x] = sum_r exp(lse_r - lse) * local_expected_r over the TP ranks."""
    expected = (local_lse - lse).exp() * local_expected
    if _group_size(group) > 1:
        dist.all_reduce(expected, group=group)
    return lse - expected


def _logits_grad(x: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, targets: torch.Tensor,
                 start: int, end: int, temperature: float) -> torch.Tensor:
    """d(sum grad_out * logp) / d(raw logits) for one chunk, in place over ``x`` (the logits / T).

    d logp(y) / d x_v = 1[v == y] - softmax(x)_v with x = raw / T, hence the extra 1/T; padding
    columns (-inf in ``x``) get exp(-inf) = 0.
    """
    g = grad_out / temperature
    grad = x.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    on_shard = (targets >= start) & (targets < end)
    rows = torch.nonzero(on_shard).squeeze(-1)
    grad[rows, targets[rows] - start] += g[rows]
    return grad


class _FusedOutputLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, chunk_size, vocab_size, temperature, with_entropy,
                reduce_hidden_grad):
        n = hidden.shape[0]
        start, end = _vocab_range(weight.shape[0], group)
        valid = _valid_columns(weight.shape[0], start, vocab_size)
        acc = _accumulation_dtype(hidden)
        ws = _Workspace(min(chunk_size, max(n, 1)), weight, acc, softmax=True, wgrad=False)
        local_lse = torch.empty(n, dtype=acc, device=hidden.device)
        target_logit = torch.empty(n, dtype=acc, device=hidden.device)
        local_expected = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        for lo in range(0, n, chunk_size):
            hi = min(n, lo + chunk_size)
            x = _chunk_logits(hidden[lo:hi], weight, ws, valid, temperature)
            target_logit[lo:hi] = _local_target_logit(x, targets[lo:hi], start, end)[0]
            lse, expected = _chunk_stats(x, valid, ws, with_entropy)
            local_lse[lo:hi] = lse
            if with_entropy:
                local_expected[lo:hi] = expected
        del ws
        if _group_size(group) > 1:
            dist.all_reduce(target_logit, group=group)
        lse = _global_logsumexp(local_lse, group)
        entropy = _entropy(local_lse, lse, local_expected, group) if with_entropy else None
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.group, ctx.chunk_size, ctx.temperature = group, chunk_size, temperature
        ctx.start, ctx.end, ctx.valid, ctx.reduce_hidden_grad = start, end, valid, reduce_hidden_grad
        if entropy is None:
            return target_logit - lse
        ctx.mark_non_differentiable(entropy)
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_out, *unused):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        acc = _accumulation_dtype(hidden)
        grad_out = grad_out.to(acc)
        ws = _Workspace(min(ctx.chunk_size, max(n, 1)), weight, acc, softmax=False, wgrad=need_weight)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        # The weight gradient sums over every chunk: accumulated in ``acc`` (float32 for 16-bit weights,
        # as Megatron's main_grad), rounded to the weight's dtype once at the end.
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        for lo in range(0, n, ctx.chunk_size):
            hi = min(n, lo + ctx.chunk_size)
            h = hidden[lo:hi]
            x = _chunk_logits(h, weight, ws, ctx.valid, ctx.temperature)
            grad = _logits_grad(x, lse[lo:hi], grad_out[lo:hi], targets[lo:hi], ctx.start, ctx.end,
                                ctx.temperature)
            if grad.dtype != hidden.dtype:  # the GEMMs run in the input dtype, as the output layer's
                grad = ws.logits[:hi - lo].copy_(grad)
            if need_hidden:
                torch.mm(grad, weight, out=grad_hidden[lo:hi])
            if need_weight and ws.wgrad is None:  # same dtype: accumulate inside the GEMM
                grad_weight.addmm_(grad.t(), h)
            elif need_weight:
                grad_weight += torch.mm(grad.t(), h, out=ws.wgrad)
        if need_hidden and ctx.reduce_hidden_grad and _group_size(ctx.group) > 1:
            dist.all_reduce(grad_hidden, group=ctx.group)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk_size: Optional[int], vocab_size: Optional[int]) -> None:
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden shape without the hidden "
                         f"dim {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [vocab_local, {hidden.shape[-1]}] "
                         f"(this rank's vocabulary shard of the output layer)")
    if weight.dtype != hidden.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float dtype")
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
    if vocab_size is not None and targets.numel() and bool((targets >= vocab_size).any()):
        raise ValueError(f"a target id is >= vocab_size={vocab_size} (a padding id cannot be a target)")


def fused_output_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """log softmax((hidden @ weight.T) / temperature)[target] per token, without materialising the logits.

    Args:
        hidden: [..., H] last hidden states (after the final norm), replicated over ``group``; any float
            dtype; not modified.
        weight: [V_local, H] this rank's vocabulary shard of the output layer (rank r holds ids
            [r*V_local, (r+1)*V_local)), the same dtype as ``hidden``; not modified.
        targets: [...] global token ids (int64).
        temperature: the sampling temperature (> 0); the distribution is softmax(logits / temperature),
            the division done in float32 after the logits are upcast (as the sampler does).
        group: the tensor-parallel group the vocabulary is sharded over; None = not sharded.
        vocab_size: number of real tokens; columns >= vocab_size (embedding padding) are left out of the
            softmax. None = all columns are real.
        with_entropy: also return the entropy (nats) of the tempered distribution per token (a metric: no
            gradient flows through it).
        chunk_size: tokens per chunk (default: about 64 MiB of float32 logits per chunk).
        reduce_hidden_grad: True: the gradient of ``hidden`` is all-reduced over ``group`` (the true
            gradient of the replicated input on every rank). False: each rank's own part, for a caller that
            reduces it (a reduce-scatter under sequence parallelism).

    Returns:
        [...] log-probabilities (float32; float64 for float64 inputs), differentiable w.r.t. ``hidden``
        and ``weight``; with ``with_entropy`` a tuple (log-probs, entropy), both [...].
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size, vocab_size)
    lead = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    chunk = chunk_size or _default_chunk(weight.shape[0])
    out = _FusedOutputLogprobs.apply(flat_hidden, weight, flat_targets, group, chunk, vocab_size,
                                     float(temperature), with_entropy, reduce_hidden_grad)
    if with_entropy:
        return out[0].reshape(lead), out[1].reshape(lead)
    return out.reshape(lead)
