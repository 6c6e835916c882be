"""The layer spec without Transformer Engine (CPU): megatron-core's local spec with a norm that supports
sequence parallelism.

Megatron-Core's local spec builds its norms with ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel``. A norm needs nothing from SP in the forward pass (it is per token,
and each tensor-parallel rank holds whole tokens of its sequence shard); what SP changes is the
gradient: every TP rank sees different tokens, so the weight gradients are partial sums that
``finalize_model_grads`` must all-reduce over TP. It does that for parameters marked
``sequence_parallel=True`` (Transformer Engine's norms mark theirs the same way).

Core attention: megatron-core's local ``DotProductAttention`` refuses packed (THD) sequences and context
parallelism (both need Transformer Engine). ``LocalPackedAttention`` adds them in plain torch, exactly:
a packed row is attended one sequence at a time (each with the causal mask the unpacked row would
get, so the numbers are the unpacked ones), and under context parallelism the keys and values are
all-gathered over the CP group and each local query chunk attends to the keys at or before its
global position (the zig-zag split, ``training/context_parallel.py``). Memory and compute are those
of the sequences (sum of L^2), not of the row (T^2). It has no parameters: checkpoints are unchanged.

Only the norm classes and the core attention change: the module names (``input_layernorm``, ``pre_mlp_layernorm``,
``q_layernorm``, ``k_layernorm``, ``decoder.final_layernorm``) and the spec's sharded-state-dict key map
stay those of megatron-core's local spec, so checkpoints are unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace
from typing import Optional

import torch
import torch.distributed as dist


class SequenceParallelNorm:
    """``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` (``config.normalization``) whose parameters are
    marked ``sequence_parallel`` when ``config.sequence_parallel`` is on.

    A class with ``__new__`` (like megatron-core's ``WrappedTorchNorm``) so that ``build_module``
    instantiates it with the same arguments; the returned module normalises the last dimension
    (``hidden_size`` features) of inputs of any leading shape, e.g. [S/TP, B, H] under SP.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("zero-centred gamma norms are not supported by the local (CPU) spec")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported by the local (CPU) spec")
        for param in norm.parameters():
            # finalize_model_grads sums the grads of these over TP (each rank saw other tokens).
            param.sequence_parallel = config.sequence_parallel
        return norm


class _AllGatherKeysValues(torch.autograd.Function):
    """[CP, ...] all-gather of this rank's keys/values over the CP group; every rank's queries read
    every rank's keys, so the backward sums the gradient over the group and keeps this rank's slice
    (a reduce-scatter, as all-reduce + slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _local_attention_class():
    """``LocalPackedAttention``, built on first use (importing this module does not import Megatron)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class LocalPackedAttention(DotProductAttention):
        """Megatron-Core's local ``DotProductAttention`` plus packed (THD) rows and context parallelism
        (see the module docstring). Inputs in THD: query/key/value [T / CP, heads, head_dim]; output
        [T / CP, 1, heads x head_dim]. Without ``packed_seq_params`` it is the parent, unchanged."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     cp_comm_type: Optional[str] = None, pg_collection=None):
            # The parent refuses CP > 1 (it would attend within the local chunks only); this class
            # gathers the keys itself, so it builds the parent for one CP rank and keeps the real config.
            local = config
            if config.context_parallel_size > 1:
                local = copy.copy(config)
                local.context_parallel_size = 1
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.config = config
            self.cp_size = config.context_parallel_size

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                if self.cp_size > 1:
                    raise ValueError("context parallelism on the local (CPU) attention needs packed (THD) rows: "
                                     "run training through training.step (it packs under CP)")
                return super().forward(query, key, value, self._causal_mask(query, key, attention_mask),
                                       attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: "
                                 "only 'thd' is supported")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            segments = (cu[1:] - cu[:-1]).tolist()
            if self.cp_size > 1:
                return self._context_parallel(query, key, value, segments)
            outputs, start = [], 0
            for length in segments:
                piece = slice(start, start + length)
                q, k = query[piece].unsqueeze(1), key[piece].unsqueeze(1)
                outputs.append(super().forward(q, k, value[piece].unsqueeze(1), self._causal_mask(q, k, None)))
                start += length
            return torch.cat(outputs, dim=0)

        def _causal_mask(self, query, key, attention_mask):
            """``attention_mask``, or the causal mask the parent's softmax would build for it, built here
            on the queries' device. The parent builds it with ``device="cuda"``, which CPU mode
            rewrites only in the forward pass: recompute (selective or full) re-runs attention in the
            backward, where that call failed ("Torch not compiled with CUDA enabled")."""
            sq, sk = query.shape[0], key.shape[0]
            if attention_mask is not None or sq == 1 or sq != sk or self.attn_mask_type != AttnMaskType.causal:
                return attention_mask  # what the parent does with it (sq != sk: its assertion)
            return torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(diagonal=1)

        def _context_parallel(self, query, key, value, segments: list[int]):
            """Each local query chunk of each segment against the segment's whole keys/values (gathered
            over CP, put back in sequence order), masked causally by global position."""
            from megatron.core import parallel_state

            from megatron_cascade.ops.zigzag import cp_row_positions

            group = parallel_state.get_context_parallel_group()
            rank = dist.get_rank(group)
            keys = _AllGatherKeysValues.apply(key, group)  # [CP, T/CP, groups, dim]
            values = _AllGatherKeysValues.apply(value, group)
            outputs, start = [], 0
            for length in segments:
                local = length // self.cp_size
                held = cp_row_positions([length], self.cp_size)  # [CP, local]: positions in the segment
                order = held.reshape(-1).argsort()
                k = keys[:, start:start + local].reshape(length, *key.shape[1:])[order]
                v = values[:, start:start + local].reshape(length, *value.shape[1:])[order]
                q_pos = held[rank].to(query.device)
                k_pos = torch.arange(length, device=query.device)
                mask = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).view(1, 1, local, length)
                outputs.append(super().forward(query[start:start + local].unsqueeze(1), k.unsqueeze(1),
                                               v.unsqueeze(1), mask))
                start += local
            return torch.cat(outputs, dim=0)

    return LocalPackedAttention


_LOCAL_ATTENTION = None


def local_packed_attention():
    """The local core attention with packed rows and context parallelism (one class per process)."""
    global _LOCAL_ATTENTION
    if _LOCAL_ATTENTION is None:
        _LOCAL_ATTENTION = _local_attention_class()
    return _LOCAL_ATTENTION


def _is_torch_norm(spec) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return spec is WrappedTorchNorm


def _is_local_attention(spec) -> bool:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return spec is DotProductAttention


def _swap_norms(spec):
    """A copy of a ``ModuleSpec`` / submodules dataclass tree with ``WrappedTorchNorm`` replaced by
    ``SequenceParallelNorm`` and ``DotProductAttention`` by ``LocalPackedAttention``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if _is_torch_norm(spec):
        return SequenceParallelNorm
    if _is_local_attention(spec):
        return local_packed_attention()
    if isinstance(spec, ModuleSpec):
        return replace(spec, submodules=_swap_norms(spec.submodules))
    if spec is not None and hasattr(spec, "__dataclass_fields__") and not isinstance(spec, type):
        return replace(spec, **{f.name: _swap_norms(getattr(spec, f.name)) for f in fields(spec)})
    return spec


def local_decoder_block_spec(config, normalization: str, pp_rank: int | None = None):
    """Megatron-Core's local (no Transformer Engine) GPT decoder block spec for ``config`` — pipeline
    stage ``pp_rank`` (None: this rank's), dense and MoE layers — with ``SequenceParallelNorm`` for
    every norm and ``LocalPackedAttention`` as core attention.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                       pp_rank=pp_rank)
    layer_specs = [_swap_norms(layer) for layer in block.layer_specs]
    return replace(block, layer_specs=layer_specs, layer_norm=SequenceParallelNorm)
