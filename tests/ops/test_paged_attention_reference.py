"""The CPU stand-ins for flash-attn's paged kernels against plain attention over contiguous K/V:
scattered blocks, GQA, padding requests, prefixes from earlier chunks, and unwritten cache slots
holding NaN (torch.empty garbage) that must not leak through the mask."""

import pytest
import torch
import torch.nn.functional as F

from megatron_cascade.ops.paged_attention_reference import flash_attn_varlen_func, flash_attn_with_kvcache
from megatron_cascade.testing.device_naming import factories_name_their_device


@pytest.fixture(autouse=True)
def _stand_ins_name_their_device():
    """The stand-ins also run on a GPU machine without the CUDA kernels (``torch_kernels.py``): no
    tensor of theirs may land on the default device (on a GPU: a CPU tensor beside CUDA ones)."""
    with factories_name_their_device(["megatron_cascade.ops.paged_attention_reference"]):
        yield


BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def _paged(lengths, gen):
    """A NaN-filled cache holding each request's K/V ``[len, kv_heads, d]`` in shuffled blocks."""
    blocks_per = [-(-n // BLOCK) for n in lengths]
    total = sum(blocks_per) + 3
    k_cache = torch.full((total, BLOCK, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.full((len(lengths), max(blocks_per) + 1), -1, dtype=torch.int32)
    keys, values = [], []
    for r, n in enumerate(lengths):
        k, v = torch.randn(n, KV_HEADS, DIM, generator=gen), torch.randn(n, KV_HEADS, DIM, generator=gen)
        keys.append(k)
        values.append(v)
        for b in range(blocks_per[r]):
            block = order.pop()
            table[r, b] = block
            part = slice(b * BLOCK, min(n, (b + 1) * BLOCK))
            k_cache[block, : part.stop - part.start] = k[part]
            v_cache[block, : part.stop - part.start] = v[part]
    return k_cache, v_cache, table, keys, values


def _reference(q, k, v):
    """Bottom-right causal attention of ``q [sq, h, d]`` over ``k, v [sk, hk, d]``."""
    sq, sk = q.shape[0], k.shape[0]
    allowed = torch.arange(sk).unsqueeze(0) <= torch.arange(sk - sq, sk).unsqueeze(1)
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1)


def test_decode_matches_contiguous_attention():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 4]
    k_cache, v_cache, table, keys, values = _paged(lengths, gen)
    q = torch.randn(len(lengths) + 2, 1, HEADS, DIM, generator=gen)  # 2 padding requests
    table = torch.cat([table, torch.full((2, table.shape[1]), -1, dtype=torch.int32)])
    seqlens = torch.tensor(lengths + [0, 0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    assert torch.isfinite(out).all()
    for r in range(len(lengths)):
        torch.testing.assert_close(out[r], _reference(q[r], keys[r], values[r]), atol=1e-5, rtol=1e-5)
    assert (out[len(lengths):] == 0).all()


def test_mixed_prefill_and_decode_match_contiguous_attention():
    gen = torch.Generator().manual_seed(1)
    kv_lengths, q_lengths = [7, 3, 10, 6], [7, 1, 4, 1]  # prefill, decode, chunk after a prefix, decode
    k_cache, v_cache, table, keys, values = _paged(kv_lengths, gen)
    q = torch.randn(sum(q_lengths) + 3, HEADS, DIM, generator=gen)  # 3 padding tokens at the end
    cu_q = torch.tensor([0] + torch.tensor(q_lengths).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(kv_lengths).cumsum(0).tolist(), dtype=torch.int32)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lengths), max(kv_lengths), causal=True,
                                 block_table=table)
    assert torch.isfinite(out).all()
    for r, (a, b) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        torch.testing.assert_close(out[a:b], _reference(q[a:b], keys[r], values[r]), atol=1e-5, rtol=1e-5)
    assert (out[sum(q_lengths):] == 0).all()
