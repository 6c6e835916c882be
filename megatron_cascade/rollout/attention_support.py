"""Whether Megatron's paged attention can run here: what ``generate`` checks before its first forward."""

from __future__ import annotations

import torch

from megatron_cascade.ops.paged_attention_reference import paged_kernels_available
from megatron_cascade.rollout.params import FLASH_ATTN2_BLOCK_MULTIPLE


def check_paged_attention(device: torch.device, dtype: torch.dtype, block_size_tokens: int) -> None:
    """Megatron's paged attention needs flash-attn >= 2.7.3 or FA3 (CPU mode installs torch stand-ins),
    and on GPU 16-bit K/V and, with flash-attn 2, blocks of a multiple of 256 tokens; without them it
    would fail deep in the first forward (``megatron-cascade doctor CONFIG`` says so before a run)."""
    from megatron.core.transformer import attention

    if not paged_kernels_available():
        raise RuntimeError("generate() runs Megatron's paged KV cache, which needs flash-attn >= 2.7.3 or "
                           "flash-attn 3 on GPU (pip install 'flash-attn>=2.7.3'); use_kv_cache=False "
                           "recomputes instead (slow)")
    if device.type != "cuda":
        return
    if dtype == torch.float32:
        raise RuntimeError("flash-attn's paged kernels take bf16/fp16 K/V only: set model.precision=bf16 to generate "
                           "on GPU")
    if not attention.HAVE_FA3 and block_size_tokens % FLASH_ATTN2_BLOCK_MULTIPLE:
        raise RuntimeError(f"rollout.kv_block_size_tokens={block_size_tokens}: flash-attn 2's paged kernels need a "
                           f"multiple of {FLASH_ATTN2_BLOCK_MULTIPLE} tokens (flash-attn 3 takes any)")
