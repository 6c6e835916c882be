"""Megatron-Core's ``DynamicInferenceContext`` (paged KV blocks, packed requests), as ``generate``
drives it, plus the one operation it lacks: forking a prefilled request into its sibling samples,
which share the prompt's full KV blocks (``block_allocator.SharedBlockAllocator``).

The context holds the block-level KV buffer ``[2, layers, blocks, block_size, kv_heads, head_dim]``
and per-request bookkeeping tensors laid out ``[paused | active | free]``; Megatron's attention
layers read and write it through ``append_key_value_cache`` / ``key_value_cache``. ``engine.py``
adds requests (``add_request``), runs forwards on ``current_input_and_position_ids()`` and calls
``update_requests`` with the sampled tokens, exactly as Megatron's ``TextGenerationController``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

from megatron_cascade.rollout.block_allocator import SharedBlockAllocator, full_blocks
from megatron_cascade.rollout.replica_groups import ReplicaGroups
from megatron_cascade.rollout.kv_budget import KVLayout


class PagedContext(DynamicInferenceContext):
    """``DynamicInferenceContext`` that pads a step's token count only to what the kernels need.

    Megatron rounds every step up to 64 tokens (and the request count to 4) for its CUDA graphs;
    eager steps need no such padding (a decode step with 3 live requests would compute 64 rows), and
    graph steps are padded to their graph's size anyway. Sequence parallelism still needs a multiple
    of the TP size, which ``round_up_tokens`` keeps; FP8 GEMMs need 8 (``build_context``'s
    ``token_multiple`` picks a subclass with that ``TOKEN_ROUNDER``).
    """

    TOKEN_ROUNDER = 1
    REQUEST_ROUNDER = 1

    def __init__(self, *args, share_prompt_blocks: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.share_prompt_blocks = share_prompt_blocks
        allocator = self.block_allocator  # nothing allocated yet: same pool, holder counts added
        self.block_allocator = SharedBlockAllocator(self, allocator.total_count, allocator.paused_count)

    def fork(self, parent_index: int, child_request_id: int) -> None:
        """Append a copy of the request at bookkeeping index ``parent_index`` (a prompt just
        prefilled in this step, before ``update_requests``) under ``child_request_id``: the parent's
        full KV blocks shared, a new block holding a copy of the partly filled last one (every block
        copied with ``share_prompt_blocks=False``), a state slot holding a copy of its Mamba states,
        the same lengths and sampling metadata.

        ``update_requests`` then advances the copy exactly like its parent, so the copy decodes
        from the parent's prompt without a prefill of its own.
        """
        child = self.total_request_count
        if child >= self.max_requests:
            raise RuntimeError(f"fork: {child} requests already fill max_requests={self.max_requests}")
        count = int(self.request_kv_block_counts[parent_index])
        parent_blocks = self.request_to_kv_block_ids[parent_index, :count]
        tokens = int(self.request_kv_length_offsets[parent_index] + self.request_query_lengths[parent_index])
        shared = min(full_blocks(tokens, self.block_size_tokens), count) if self.share_prompt_blocks else 0
        copied = self.block_allocator.allocate_memory_blocks(count - shared) if count > shared else parent_blocks[:0]
        if copied is None:
            raise RuntimeError("fork: no free KV blocks (the engine's reservation should prevent this)")
        self.memory_buffer[:, :, copied.long()] = self.memory_buffer[:, :, parent_blocks[shared:].long()]
        self.block_allocator.share(parent_blocks[:shared])
        blocks = torch.cat([parent_blocks[:shared], copied.to(parent_blocks.dtype)])
        for tensor in (self.request_query_lengths, self.request_output_lengths, self.request_kv_length_offsets,
                       self.request_kv_block_counts, self.request_last_kv_block_offset,
                       *self.request_metadata.values()):
            tensor[child] = tensor[parent_index]
        self.request_ids[child] = child_request_id
        self.request_to_kv_block_ids[child] = -1
        self.request_to_kv_block_ids[child, :count] = blocks
        self.request_last_kv_block_id[child] = blocks[-1]
        if self.is_hybrid_model:  # the prompt's conv and SSM states, after its prefill
            slot = self.mamba_metadata.allocate_slot()
            if slot is None:
                raise RuntimeError("fork: no free Mamba state slot (max_requests should prevent this)")
            parent_slot = self.mamba_metadata.request_to_mamba_state_idx[parent_index].long()
            self.mamba_conv_states[:, slot] = self.mamba_conv_states[:, parent_slot]
            self.mamba_ssm_states[:, slot] = self.mamba_ssm_states[:, parent_slot]
            self.mamba_metadata.request_to_mamba_state_idx[child] = slot
        self.total_request_count += 1

    def blocks_freed_by(self, request_indexes: list[int]) -> int:
        """Blocks that would return to the pool if the requests at these bookkeeping indexes were
        released together (a shared block only with its last holder)."""
        tables = self.request_to_kv_block_ids[torch.tensor(request_indexes, dtype=torch.long,
                                                            device=self.request_to_kv_block_ids.device)]
        return self.block_allocator.blocks_freed_by(tables[tables != -1])

    def active_request_ids(self) -> list[int]:
        """Request ids in the order of this step's logits rows."""
        return self.request_ids[self.paused_request_count:self.total_request_count].tolist()


# Transformer Engine's FP8 GEMMs assert that the token dimension is a multiple of 8 (assert_dim_for_fp8_exec).
FP8_TOKEN_MULTIPLE = 8


def step_token_multiple(gpt: torch.nn.Module, groups: ReplicaGroups) -> int:
    """What every generation step's token count (and the request slots, which cap a decode step's
    padding) must be a multiple of: the TP sizes — the replica's, and Megatron's parallel-state one, which
    ``DynamicInferenceContext.round_up_tokens`` reads when a decode copy has its own — and, when the model
    runs FP8 GEMMs, TE's 8 (Megatron's ``TOKEN_ROUNDER`` of 64 is for CUDA graphs; eager steps need no more)."""
    from megatron.core import parallel_state

    multiple = math.lcm(groups.tp_size, parallel_state.get_tensor_model_parallel_world_size()
                        if parallel_state.is_initialized() else 1)
    if getattr(gpt.config, "fp8", None) is not None:
        multiple = math.lcm(multiple, FP8_TOKEN_MULTIPLE)
    return multiple


@functools.lru_cache(maxsize=None)
def _context_class(token_multiple: int) -> type:
    """``PagedContext`` rounding a step's tokens to ``token_multiple`` (a class attribute in Megatron)."""
    if token_multiple == PagedContext.TOKEN_ROUNDER:
        return PagedContext
    return type(f"PagedContext{token_multiple}", (PagedContext,), {"TOKEN_ROUNDER": token_multiple})


def build_context(gpt: torch.nn.Module, layout: KVLayout, groups: ReplicaGroups, blocks: int, max_requests: int,
                  max_tokens: int, max_sequence_length: int, cuda_graphs: Optional[int] = None,
                  token_multiple: int = 1, share_prompt_blocks: bool = True) -> PagedContext:
    """A context with exactly ``blocks`` usable blocks (plus Megatron's dummy block) and
    ``max_requests`` request slots, for this rank's stage ``gpt`` (a hybrid model's slots also hold
    each Mamba layer's conv and SSM state: Megatron's ``MambaInferenceStateConfig``).

    ``cuda_graphs``: Megatron's ``num_cuda_graphs`` for decode-only steps (``KVCacheConfig.cuda_graphs``).
    ``token_multiple``: every step's token count is padded to a multiple of it (``step_token_multiple``;
    ``max_requests`` and ``max_tokens`` must be multiples of it).
    ``share_prompt_blocks``: forks share their prompt's full blocks (``PagedContext.fork``).

    ``materialize_only_last_token_logits``: the output layer runs on each request's last token
    only (sampling needs nothing else; a prefill of P tokens does not compute P vocab rows).
    """
    # Megatron sizes the pool as buffer // (block + one request's Mamba state); the half guards rounding.
    buffer_bytes = (blocks + 1.5) * (layout.block_bytes + layout.state_bytes)
    if max_requests % token_multiple or max_tokens % token_multiple:
        raise ValueError(f"max_requests={max_requests} and max_tokens={max_tokens} must be multiples of {token_multiple}")
    ctx = _context_class(token_multiple)(
        params_dtype=layout.dtype,
        num_layers=layout.layers,
        kv_channels=layout.head_dim,
        num_attention_heads=layout.kv_heads * groups.tp_size,
        max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_bytes / 1024**3,
        max_requests=max_requests,
        max_tokens=max_tokens,
        block_size_tokens=layout.block_size_tokens,
        materialize_only_last_token_logits=True,
        mamba_inference_state_config=_mamba_state_config(gpt) if layout.state_bytes else None,
        num_cuda_graphs=cuda_graphs,
        use_cuda_graphs_for_non_decode_steps=False,
        unified_memory_level=0,
        pg_collection=gpt.pg_collection,
        share_prompt_blocks=share_prompt_blocks,
    )
    if ctx.block_allocator.total_count != blocks + 1:
        raise RuntimeError(f"context has {ctx.block_allocator.total_count} blocks, wanted {blocks + 1}")
    return ctx


def _mamba_state_config(gpt: torch.nn.Module):
    """Megatron's ``MambaInferenceStateConfig`` of this stage; a stage without attention layers gets
    a phantom one at the end of its layer list (the context refuses to run without one)."""
    from dataclasses import replace

    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
    from megatron.core.utils import get_mamba_inference_state_config_from_model

    config = get_mamba_inference_state_config_from_model(gpt)
    if Symbols.ATTENTION not in config.layer_type_list:
        config = replace(config, layer_type_list=list(config.layer_type_list) + [Symbols.ATTENTION])
    return config


def cache_bytes(ctx: PagedContext) -> int:
    """Bytes the context's KV blocks (dummy included) and Mamba state slots hold."""
    buffers = [ctx.memory_buffer] + ([ctx.mamba_conv_states, ctx.mamba_ssm_states] if ctx.is_hybrid_model else [])
    return sum(t.numel() * t.element_size() for t in buffers)
