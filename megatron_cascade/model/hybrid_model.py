"""Megatron-Core's ``MambaModel`` with the one piece of ``GPTModel.forward`` it lacks.

Under sequence parallelism each tensor-parallel rank holds ``seq / TP`` positions of the hidden
states, but ``MambaModel.forward`` (0.16.1) passes the MoE layers the padding mask of the whole
sequence: the routers then mask ``[tokens / TP, E]`` routing maps with ``tokens`` flags (a shape
error, measured). ``GPTModel`` scatters the mask to the rank's sequence shard; so does this class,
on every pipeline stage (each stage's MoE layers see sharded hidden states).
"""

from __future__ import annotations

from typing import Optional

import torch


def _mamba_model_class() -> type:
    from megatron.core import tensor_parallel
    from megatron.core.models.mamba import MambaModel

    class HybridModel(MambaModel):
        """``MambaModel`` whose padding mask ([batch, seq], True = padding) follows the SP split."""

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, runtime_gather_output: Optional[bool] = None, *,
                    inference_params=None, packed_seq_params=None,
                    padding_mask: Optional[torch.Tensor] = None):
            if padding_mask is not None and self.config.sequence_parallel:
                padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(
                    padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                   inference_context, runtime_gather_output, inference_params=inference_params,
                                   packed_seq_params=packed_seq_params, padding_mask=padding_mask)

    return HybridModel


_CLASS = None


def hybrid_model_class() -> type:
    """The ``MambaModel`` subclass to build (created on first use: megatron-core is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _mamba_model_class()
    return _CLASS
