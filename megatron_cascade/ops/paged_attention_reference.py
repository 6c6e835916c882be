"""Torch stand-ins for the flash-attention paged-KV kernels (CPU mode; GPU nodes without flash-attn).

Megatron-Core's dynamic inference path (``Attention.flash_decode_and_prefill`` under a
``DynamicInferenceContext``) calls flash-attn's ``flash_attn_varlen_func(..., block_table=)`` for
steps with prefill tokens and ``flash_attn_with_kvcache(..., block_table=)`` for decode-only steps,
and asserts flash-attn >= 2.7.3 first; it has no torch path. ``install()`` (called by
``enable_cpu_mode``) gives it one: same signatures, same results up to float rounding. On a GPU
machine that has only torch, ``megatron_cascade/torch_kernels.py`` installs them too (slow; every
tensor they make is on their inputs' device).

Cache layout (Megatron's): ``k_cache``/``v_cache`` are ``[blocks, block_size, kv_heads, head_dim]``
views of the context's memory buffer; ``block_table [requests, max_blocks]`` lists each request's
blocks in order (-1 = none). Padding requests (the context pads a step's request count) have query
and key length 0; their output rows are zero.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_INSTALLED = False


def _slots(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int, longest: int) -> torch.Tensor:
    """Flat cache slot ``[R, longest]`` of each request's positions. Positions at or beyond a
    request's length point at its position 0 instead: always written, so finite (unwritten slots
    hold torch.empty garbage, possibly NaN, which would leak through a mask as NaN scores)."""
    pos = torch.arange(longest, device=block_table.device)
    slots = block_table[:, pos // block_size].long() * block_size + pos % block_size
    slots = torch.where(pos.unsqueeze(0) < lengths.unsqueeze(1), slots, slots[:, :1])
    return slots.clamp(min=0)  # padding requests (no blocks): any slot, their rows are discarded


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache [blocks, block_size, kv_heads, d]`` at ``slots [R, L]`` -> ``[R, kv_heads, L, d]``."""
    rows = cache.flatten(0, 1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[2:]).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention of ``q [R, sq, h, d]`` over ``k, v [R, hk, sk, d]`` (GQA) where ``allowed
    [R, sq, sk]``; every row must allow at least one key. Returns ``[R, sq, h, d]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed.unsqueeze(1), scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[2])
    return out.transpose(1, 2)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor, causal: bool = True,
                            softmax_scale: Optional[float] = None, **_: object) -> torch.Tensor:
    """Decode: ``q [R, 1, h, d]`` attends to each request's ``cache_seqlens[r]`` cached positions
    (the new token's K/V were appended before the call). Returns ``[R, 1, h, d]``; rows of padding
    requests (length 0) are 0."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    lengths = cache_seqlens.long()
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest == 0:
        return torch.zeros_like(q)
    slots = _slots(block_table, lengths, k_cache.shape[1], longest)
    # Padding rows attend to one slot and are zeroed afterwards.
    allowed = (torch.arange(longest, device=q.device).unsqueeze(0) < lengths.clamp(min=1).unsqueeze(1)).unsqueeze(1)
    out = _attend(q, _gather(k_cache, slots), _gather(v_cache, slots), allowed, scale)
    return out.masked_fill((lengths == 0)[:, None, None, None], 0.0)


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
        lengths = torch.tensor([kv_len[r] for r in decode], device=q.device)
        out[rows] = flash_attn_with_kvcache(q[rows].unsqueeze(1), k, v, lengths, block_table[idx],
                                            softmax_scale=scale).squeeze(1)
    for r, n in enumerate(q_len):
        if n <= 1:
            continue
        slots = _slots(block_table[r:r + 1], torch.tensor([kv_len[r]], device=q.device), k.shape[1], kv_len[r])
        keys, values = _gather(k, slots), _gather(v, slots)
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


def paged_kernels_available() -> bool:
    """Whether Megatron's dynamic-batching attention has paged KV kernels to call: flash-attn >= 2.7.3
    or flash-attn 3 (or these stand-ins, once ``install()`` has run)."""
    from megatron.core.transformer import attention

    return attention.HAVE_FA3 or (attention.flash_attn_varlen_func is not None
                                  and attention.is_fa_min_version("2.7.3"))


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
