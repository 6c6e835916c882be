"""``rollout/attention_support.py``: generation refuses what flash-attn's paged kernels cannot run,
before the first forward."""

import torch

from megatron_cascade.ops.paged_attention_reference import flash_attn_varlen_func


def test_gpu_generation_refuses_fp32_and_flash_attn2_block_sizes_before_the_first_forward(monkeypatch):
    """On a CUDA device flash-attn's paged kernels take 16-bit K/V in blocks of a multiple of 256
    tokens (flash-attn 2); the engine refuses before the first forward, naming the key. The check
    itself touches no device, so it runs here with the CPU stand-ins in place of flash-attn."""
    import pytest
    from megatron.core.transformer import attention

    from megatron_cascade.rollout.attention_support import check_paged_attention

    monkeypatch.setattr(attention, "flash_attn_varlen_func", flash_attn_varlen_func)  # flash-attn 2.7.3 installed
    monkeypatch.setattr(attention, "is_fa_min_version", lambda version, *args, **kwargs: True)
    monkeypatch.setattr(attention, "HAVE_FA3", False)
    cuda = torch.device("cuda")
    with pytest.raises(RuntimeError, match="model.precision=bf16"):
        check_paged_attention(cuda, torch.float32, 256)
    with pytest.raises(RuntimeError, match="rollout.kv_block_size_tokens=64"):
        check_paged_attention(cuda, torch.bfloat16, 64)
    check_paged_attention(cuda, torch.bfloat16, 512)
    check_paged_attention(torch.device("cpu"), torch.float32, 16)  # the CPU stand-ins take any
    monkeypatch.setattr(attention, "HAVE_FA3", True)
    check_paged_attention(cuda, torch.bfloat16, 64)  # flash-attn 3 pages any block size
