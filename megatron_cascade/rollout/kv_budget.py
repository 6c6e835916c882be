"""Sizing the paged KV cache: how many blocks the budget buys, and who can never fit."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from megatron_cascade.rollout.replica_groups import ReplicaGroups, replica_groups
from megatron_cascade.rollout.params import KVCacheConfig


@dataclass(frozen=True)
class KVLayout:
    """This rank's share of the paged generation cache.

    Attributes:
        layers: attention layers on this pipeline stage.
        kv_heads: key/value heads on this tensor-parallel rank (query groups / TP).
        head_dim: channels per head.
        dtype: the cache dtype (the model's ``params_dtype``).
        block_size_tokens: tokens per block.
        state_bytes: per request, the conv and SSM states of this stage's Mamba layers (hybrid
            models; 0 for GPT models): a fixed-size slot whatever the request's length.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size_tokens: int
    state_bytes: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of ``block_size_tokens`` tokens in every attention layer."""
        return self.dtype.itemsize * 2 * self.layers * self.block_size_tokens * self.kv_heads * self.head_dim

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens (prompt + response) occupies at its longest."""
        return math.ceil(tokens / self.block_size_tokens)


@dataclass(frozen=True)
class CacheCapacity:
    """What one ``generate`` call allocates on this rank (agreed on by the model-parallel group).

    Attributes:
        blocks: KV blocks for requests (the context adds one dummy block).
        slots: request slots; each holds a Mamba state (hybrid models) and at least one block.
    """

    blocks: int
    slots: int


def kv_layout(gpt: torch.nn.Module, block_size_tokens: int, tp: int) -> KVLayout:
    """The generation-cache layout of this rank's ``GPTModel`` / ``MambaModel`` stage at tensor-parallel size ``tp``."""
    cfg = gpt.config
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if groups % tp:
        raise ValueError(f"model.num_query_groups={groups} is not divisible by tensor parallel size {tp}")
    attention, states = _stage_layers(gpt)
    state_elements = sum(math.prod(conv) + math.prod(ssm) for conv, ssm in states)
    # Megatron's context needs an attention layer: a hybrid stage of Mamba / MoE layers only gets a
    # phantom one (``paged_context.build_context``), whose blocks are allocated and never read.
    return KVLayout(layers=max(attention, 1), kv_heads=groups // tp, head_dim=cfg.kv_channels, dtype=cfg.params_dtype,
                    block_size_tokens=block_size_tokens, state_bytes=state_elements * cfg.params_dtype.itemsize)


def _stage_layers(gpt: torch.nn.Module) -> tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """This stage's attention layer count and each Mamba layer's (conv, SSM) state shape per request."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.attention import Attention

    attention, states = 0, []
    for layer in gpt.decoder.layers:
        if isinstance(layer, MambaLayer):
            states.append(layer.mamba_state_shapes_per_request())
        elif isinstance(getattr(layer, "self_attention", None), Attention):  # not the MLP / MoE-only layers
            attention += 1
    return attention, states


def budget_bytes(cfg: KVCacheConfig, device: torch.device) -> int:
    """The byte budget: ``kv_cache_bytes``, else ``kv_cache_fraction`` of free memory now (on GPU
    after ``torch.cuda.empty_cache()``)."""
    if cfg.kv_cache_bytes is not None:
        return int(cfg.kv_cache_bytes)
    if device.type == "cuda":
        # Blocks the caching allocator holds but no tensor uses (training's activations, freed
        # gradients) count as free: hand them back first, then read what the device has.
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = available_ram_bytes()
    return int(free * cfg.kv_cache_fraction)


def available_ram_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (free pages plus reclaimable caches), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_capacity(cfg: KVCacheConfig, layout: KVLayout, device: torch.device, groups: ReplicaGroups, *,
                   needed: int, largest: int, requests: int, expected_blocks: int) -> CacheCapacity:
    """Blocks and request slots to allocate: what the budget buys, at most what the call can use,
    agreed on (MIN) by every rank of the model-parallel group (TP ranks and PP stages must admit
    the same requests).

    GPT models: every block the budget buys (at most ``needed``), a slot per request. Hybrid models
    also hold a Mamba state per slot: as many slots as requests of ``expected_blocks`` blocks each
    (with their states) fit, at most ``requests``; the rest of the budget is blocks.

    Args:
        needed: blocks all requests of the call would occupy at their longest.
        largest: blocks of the longest single request.
        requests: samples in the call.
        expected_blocks: blocks of a request at its expected length (sizes the hybrid slots).

    Raises:
        ValueError: the budget cannot hold ``largest`` blocks and one slot (that request could never run).
    """
    budget = budget_bytes(cfg, device)
    slots = requests
    if layout.state_bytes:
        slots = max(1, min(requests, budget // (layout.state_bytes + expected_blocks * layout.block_bytes)))
    # One block is Megatron's dummy block (padding tokens write there).
    affordable = (budget - slots * layout.state_bytes) // layout.block_bytes - 1
    blocks, slots = groups.agree_min([min(affordable, needed), slots], device)
    if blocks < largest:
        state = f" and {layout.state_bytes} bytes of Mamba state per request" if layout.state_bytes else ""
        raise ValueError(
            f"the KV cache budget holds {max(blocks, 0)} blocks of {layout.block_size_tokens} tokens "
            f"({layout.block_bytes} bytes each on this rank{state}), but one request (prompt + max_new_tokens) "
            f"needs {largest}: raise rollout.kv_cache_bytes (or rollout.kv_cache_fraction), or lower "
            f"rollout.max_new_tokens / the prompt length")
    return CacheCapacity(blocks=blocks, slots=min(slots, blocks))


def static_row_bytes(gpt: torch.nn.Module, row_tokens: int) -> int:
    """Bytes one row of a static generation batch holds on this rank (``rollout/static.py``): the K/V of ``row_tokens`` positions in each attention layer of this
    stage (its TP share of the KV heads) plus each Mamba layer's conv and SSM state."""
    layout = kv_layout(gpt, block_size_tokens=1, tp=replica_groups(gpt).tp_size)
    return layout.block_bytes * row_tokens + layout.state_bytes


def static_batch_rows(gpt: torch.nn.Module, cfg: KVCacheConfig, device: torch.device, row_tokens: int) -> int:
    """Rows of one static generation batch the budget (``kv_cache_bytes``, else ``kv_cache_fraction``
    of free memory) holds at ``row_tokens`` positions each, agreed on (MIN) by every rank of the
    model-parallel group (they must batch alike).

    Raises:
        ValueError: not even one row fits the budget.
    """
    per_row = static_row_bytes(gpt, row_tokens)
    count, = replica_groups(gpt).agree_min([budget_bytes(cfg, device) // max(per_row, 1)], device)
    if count < 1:
        raise ValueError(
            f"the generation cache budget cannot hold one row of {row_tokens} tokens ({per_row} bytes of "
            "attention K/V and Mamba state on this rank): raise rollout.kv_cache_bytes (or "
            "rollout.kv_cache_fraction), or lower rollout.max_new_tokens / the prompt length")
    return count
