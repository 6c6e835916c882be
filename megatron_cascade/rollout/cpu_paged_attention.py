"""Torch stand-ins for the flash-attention paged-KV kernels, for CPU mode only.

Megatron-Core's dynamic inference path (``Attention.flash_decode_and_prefill`` under a
``DynamicInferenceContext``) calls flash-attn's ``flash_attn_varlen_func(..., block_table=)`` for
steps with prefill tokens and ``flash_attn_with_kvcache(..., block_table=)`` for decode-only steps,
and asserts flash-attn >= 2.7.3 first; it has no torch path. ``install()`` (called by
``enable_cpu_mode``) gives it one: same signatures, same results up to float rounding, never
used on a GPU (there flash-attn >= 2.7.3 or FA3 is required).

Cache layout (Megatron's): ``k_cache``/``v_cache`` are ``[blocks, block_size, kv_heads, head_dim]``
views of the context's memory buffer; ``block_table [requests, max_blocks]`` lists each request's
blocks in order (-1 = none). Padding requests (the context pads a step's request count) have query
and key length 0; their output rows are zero.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

_INSTALLED = False


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached positions of each request: ``[R, length, kv_heads, d]``."""
    blocks = math.ceil(length / cache.shape[1])
    ids = block_table[:, :blocks].clamp(min=0).long()
    gathered = cache[ids]  # [R, blocks, block_size, kv_heads, d]
    return gathered.flatten(1, 2)[:, :length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Softmax attention of ``q [R, sq, h, d]`` over ``k, v [R, sk, hk, d]`` (GQA: heads repeated)
    where ``allowed [R, sq, sk]``; rows with no allowed key give 0. Returns ``[R, sq, h, d]``."""
    # Unwritten cache slots hold whatever the buffer held (torch.empty): zero the values that no
    # query may see, or 0 * NaN would leak into the output.
    v = v.masked_fill(~allowed.any(dim=1)[:, :, None, None], 0.0)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows (padding) -> 0
    return torch.einsum("rhqk,rkhd->rqhd", probs, v.float()).to(q.dtype)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor, causal: bool = True,
                            softmax_scale: Optional[float] = None, **_: object) -> torch.Tensor:
    """Decode: ``q [R, 1, h, d]`` attends to each request's ``cache_seqlens[r]`` cached positions
    (the new token's K/V were appended before the call). Returns ``[R, 1, h, d]``."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    lengths = cache_seqlens.long()
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest == 0:
        return torch.zeros_like(q)
    k = _gather_kv(k_cache, block_table, longest)
    v = _gather_kv(v_cache, block_table, longest)
    allowed = (torch.arange(longest, device=q.device).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)
    return _attend(q, k, v, allowed, scale)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: Optional[float] = None, causal: bool = True,
                           block_table: Optional[torch.Tensor] = None, **_: object) -> torch.Tensor:
    """Prefill / mixed step: packed queries ``q [T, h, d]`` (request r owns rows
    ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``), keys from the paged cache. Causal alignment is
    bottom-right: a request's last query sees all its ``kv_len`` keys (earlier chunks included).
    Requests with one query (decode rows in a mixed step) run batched; prefills one by one.
    Returns ``[T, h, d]``."""
    assert block_table is not None, "the CPU stand-in serves the paged (block_table) call only"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    q_start, k_start = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    q_len = [b - a for a, b in zip(q_start, q_start[1:])]
    kv_len = [b - a for a, b in zip(k_start, k_start[1:])]
    decode = [r for r, n in enumerate(q_len) if n == 1]
    if decode:
        rows = torch.tensor([q_start[r] for r in decode], device=q.device)
        idx = torch.tensor(decode, device=q.device)
        out[rows] = flash_attn_with_kvcache(q[rows].unsqueeze(1), k, v, torch.tensor([kv_len[r] for r in decode]),
                                            block_table[idx], softmax_scale=scale).squeeze(1)
    for r, n in enumerate(q_len):
        if n <= 1:
            continue
        keys = _gather_kv(k, block_table[r:r + 1], kv_len[r])
        values = _gather_kv(v, block_table[r:r + 1], kv_len[r])
        query_pos = torch.arange(kv_len[r] - n, kv_len[r], device=q.device).unsqueeze(1)
        allowed = (torch.arange(kv_len[r], device=q.device).unsqueeze(0) <= query_pos).unsqueeze(0)
        out[q_start[r]:q_start[r] + n] = _attend(q[q_start[r]:q_start[r] + n].unsqueeze(0), keys, values,
                                                 allowed, scale).squeeze(0)
    return out


def _merge_heads(tensor: torch.Tensor, pattern: str) -> torch.Tensor:
    """The one ``einops.rearrange`` pattern the dynamic attention path uses (einops is optional)."""
    if pattern.replace(" ", "") != "sbhd->sb(hd)":
        raise NotImplementedError(f"CPU-mode rearrange stand-in got pattern {pattern!r}")
    return tensor.reshape(tensor.shape[0], tensor.shape[1], -1)


def install() -> None:
    """Route Megatron's dynamic-batching attention to the torch stand-ins (idempotent; CPU mode)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer import attention

    attention.flash_attn_varlen_func = flash_attn_varlen_func
    attention.flash_attn_with_kvcache = flash_attn_with_kvcache
    # The guard asserts flash-attn >= 2.7.3 for dynamic batching; the stand-ins take its place.
    original_check = attention.is_fa_min_version
    attention.is_fa_min_version = lambda version, *a, **k: True if version == "2.7.3" else original_check(
        version, *a, **k)
    if attention.rearrange is None:
        attention.rearrange = _merge_heads
    _INSTALLED = True
