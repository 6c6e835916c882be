"""Tensor transforms between Hugging Face and Megatron layouts (pure functions, no I/O).

Megatron's fused ``linear_qkv`` is laid out per query group: for each of the ``ng`` key/value
heads, its ``nh / ng`` query heads, then its key head, then its value head, each ``head_dim`` rows.
"""

from __future__ import annotations

import torch

from megatron_cascade.config.model import ModelConfig


def _head_dims(model: ModelConfig) -> tuple[int, int, int]:
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.kv_channels or model.hidden_size // heads
    return heads, groups, head_dim


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """HF q [nh*hd, ...], k [ng*hd, ...], v [ng*hd, ...] -> Megatron qkv [ng*(nh/ng+2)*hd, ...].

    Works for weights ([rows, hidden]) and biases ([rows]).
    """
    heads, groups, hd = _head_dims(model)
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def unpack_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_qkv``: Megatron qkv -> HF (q, k, v)."""
    heads, groups, hd = _head_dims(model)
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (heads // groups + 2) * hd, *rest)
    q, k, v = torch.split(per_group, [heads // groups * hd, hd, hd], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """[vocab, hidden] -> [padded_rows, hidden], the extra rows zero."""
    if weight.shape[0] > padded_rows:
        raise ValueError(f"vocab rows {weight.shape[0]} exceed the padded vocab size {padded_rows}")
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad])


def strip_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[padded_vocab, hidden] -> [vocab_size, hidden] (drops the padding rows)."""
    return weight[:vocab_size].contiguous()


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 (SwiGLU [gate; up] -> linear_fc1)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts).contiguous()


def split_rows(t: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Inverse of ``join_rows`` for ``count`` equal parts."""
    return [p.contiguous() for p in torch.chunk(t, count)] if count > 1 else [t]


def to_megatron(meg_name: str, parts: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """The Megatron tensor ``meg_name`` from its HF parts (in ``families`` order)."""
    if meg_name.endswith("linear_qkv.weight") or meg_name.endswith("linear_qkv.bias"):
        return pack_qkv(*parts, model)
    if meg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return pad_vocab(parts[0], model.padded_vocab_size)
    return join_rows(parts)


def to_hf(meg_name: str, tensor: torch.Tensor, count: int, model: ModelConfig) -> list[torch.Tensor]:
    """The HF parts (``count`` of them, in ``families`` order) of the Megatron tensor ``meg_name``."""
    if meg_name.endswith("linear_qkv.weight") or meg_name.endswith("linear_qkv.bias"):
        return list(unpack_qkv(tensor, model))
    if meg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [strip_vocab(tensor, model.vocab_size)]
    return split_rows(tensor, count)
