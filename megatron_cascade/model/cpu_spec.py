"""The layer spec without Transformer Engine (CPU): megatron-core's local spec with a norm that supports
sequence parallelism.

Megatron-Core's local spec builds its norms with ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel``. A norm needs nothing from SP in the forward pass (it is per token,
and each tensor-parallel rank holds whole tokens of its sequence shard); what SP changes is the
gradient: every TP rank sees different tokens, so the weight gradients are partial sums that
``finalize_model_grads`` must all-reduce over TP. It does that for parameters marked
``sequence_parallel=True`` (Transformer Engine's norms mark theirs the same way).

Only the norm classes change: the module names (``input_layernorm``, ``pre_mlp_layernorm``,
``q_layernorm``, ``k_layernorm``, ``decoder.final_layernorm``) and the spec's sharded-state-dict key map
stay those of megatron-core's local spec, so checkpoints are unchanged.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch


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


def _is_torch_norm(spec) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return spec is WrappedTorchNorm


def _swap_norms(spec):
    """A copy of a ``ModuleSpec`` / submodules dataclass tree with ``WrappedTorchNorm`` replaced."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if _is_torch_norm(spec):
        return SequenceParallelNorm
    if isinstance(spec, ModuleSpec):
        return replace(spec, submodules=_swap_norms(spec.submodules))
    if spec is not None and hasattr(spec, "__dataclass_fields__") and not isinstance(spec, type):
        return replace(spec, **{f.name: _swap_norms(getattr(spec, f.name)) for f in fields(spec)})
    return spec


def local_decoder_block_spec(config, normalization: str):
    """Megatron-Core's local (no Transformer Engine) GPT decoder block spec for ``config`` — this
    rank's pipeline stage, dense and MoE layers — with ``SequenceParallelNorm`` for every norm.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization)
    layer_specs = [_swap_norms(layer) for layer in block.layer_specs]
    return replace(block, layer_specs=layer_specs, layer_norm=SequenceParallelNorm)
