"""Megatron-Core's ``MambaModel`` with the pieces of ``GPTModel`` / ``TransformerBlock`` it lacks.

* The padding mask under sequence parallelism: each tensor-parallel rank holds ``seq / TP`` positions
  of the hidden states, but ``MambaModel.forward`` (0.16.1) passes the MoE layers the padding mask of
  the whole sequence: the routers then mask ``[tokens / TP, E]`` routing maps with ``tokens`` flags (a
  shape error, measured). ``GPTModel`` scatters the mask to the rank's sequence shard; so does this
  class, on every pipeline stage (each stage's MoE layers see sharded hidden states).
* Full-layer activation recompute (``model.recompute: full``): 0.16.1's ``MambaStack`` ignores
  ``recompute_granularity='full'`` (only ``TransformerBlock`` checkpoints layers), so every Mamba,
  attention and MoE layer kept its activations for backward. ``RecomputedMambaStack`` checkpoints the
  stack's layers in uniform chunks of ``model.recompute_num_layers`` with Megatron's
  ``tensor_parallel.checkpoint`` (which saves and restores the CPU, CUDA and model-parallel RNG
  states, so dropout draws the same masks when a chunk runs again), as ``TransformerBlock`` does.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Optional

import torch


def _stack_class() -> type:
    from megatron.core import tensor_parallel
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.ssm.mamba_block import MambaStack
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import WrappedTensor, make_viewless_tensor

    class RecomputedMambaStack(MambaStack):
        """``MambaStack`` that, in training under ``recompute_granularity='full'``, keeps only the input
        of each chunk of ``recompute_num_layers`` layers and runs the chunk again in backward.

        Hidden states are [seq (/ TP under sequence parallelism), batch, hidden]. Generation (an
        inference context: the Mamba conv/SSM states and the KV cache are updated in place), eval mode
        and forwards without autograd (log-prob passes) run the layers once, as ``MambaStack`` does.
        """

        def recomputes(self, inference_context) -> bool:
            """Whether this forward checkpoints its layers (only a training forward that will run backward)."""
            return (self.config.recompute_granularity == "full" and self.training and inference_context is None
                    and torch.is_grad_enabled())

        def forward(self, hidden_states, attention_mask, inference_context=None, rotary_pos_emb=None, *,
                    inference_params=None, packed_seq_params=None, padding_mask=None):
            if not self.recomputes(inference_context or inference_params):
                return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                                       inference_params=inference_params, packed_seq_params=packed_seq_params,
                                       padding_mask=padding_mask)
            if not self.pre_process:
                hidden_states = self.input_tensor  # from the previous pipeline stage (set_input_tensor)
            if isinstance(hidden_states, WrappedTensor):
                hidden_states = hidden_states.unwrap()
            delayed_fp8 = self.config.fp8 and self.config.fp8_recipe == "delayed"
            with get_fp8_context(self.config) if delayed_fp8 else nullcontext():
                hidden_states = self._checkpointed_layers(hidden_states, attention_mask, rotary_pos_emb,
                                                          packed_seq_params, padding_mask)
            if self.post_process and self.post_layer_norm:
                hidden_states = self.final_norm(hidden_states)
            # Pipeline schedules free the output's storage after sending it: it must not be a view.
            return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                        keep_graph=True)

        def _checkpointed_layers(self, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params,
                                 padding_mask):
            if self.config.recompute_method != "uniform":
                raise ValueError(f"recompute_method={self.config.recompute_method!r}: the hybrid stack recomputes "
                                 "uniform chunks only (model.recompute_num_layers)")
            step = self.config.recompute_num_layers
            for start in range(0, len(self.layers), step):
                run = self._chunk(start, min(start + step, len(self.layers)), packed_seq_params)
                hidden_states = self._checkpoint(run, hidden_states, attention_mask, rotary_pos_emb, padding_mask)
            return hidden_states

        def _checkpoint(self, run: Callable, *args):
            if self.config.fp8:
                # TE's checkpoint also restores the FP8 scaling state for the recomputed GEMMs.
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return te_checkpoint(run, self.config.distribute_saved_activations,
                                     tensor_parallel.random.get_cuda_rng_tracker, self.tp_group, *args)
            return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations, *args)

        def _chunk(self, start: int, end: int, packed_seq_params) -> Callable:
            """Layers ``start..end-1`` as one function of the tensors the checkpoint saves."""
            inner_fp8 = self.config.fp8 and self.config.fp8_recipe != "delayed"

            def run(hidden_states, attention_mask, rotary_pos_emb, padding_mask):
                for layer in self.layers[start:end]:
                    context = get_fp8_context(self.config, layer.layer_number - 1) if inner_fp8 else nullcontext()
                    with context:
                        if isinstance(layer, TransformerLayer):
                            hidden_states, _ = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                                     rotary_pos_emb=rotary_pos_emb,
                                                     packed_seq_params=packed_seq_params, padding_mask=padding_mask)
                        else:  # MambaLayer
                            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                                  packed_seq_params=packed_seq_params)
                return hidden_states

            return run

    return RecomputedMambaStack


def _mamba_model_class() -> type:
    from megatron.core import tensor_parallel
    from megatron.core.models.mamba import MambaModel
    from megatron.core.ssm.mamba_block import MambaStack

    class HybridModel(MambaModel):
        """``MambaModel`` whose padding mask ([batch, seq], True = padding) follows the SP split and whose
        stack recomputes whole layers under ``model.recompute: full`` (``RecomputedMambaStack``)."""

        def __init__(self, config, mamba_stack_spec, *args, **kwargs):
            if mamba_stack_spec.module is MambaStack:
                mamba_stack_spec = replace(mamba_stack_spec, module=recomputed_stack_class())
            super().__init__(config, mamba_stack_spec, *args, **kwargs)

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


_CLASSES: dict[str, type] = {}


def recomputed_stack_class() -> type:
    """The ``MambaStack`` subclass with full-layer recompute (created on first use: megatron-core is
    imported lazily)."""
    if "stack" not in _CLASSES:
        _CLASSES["stack"] = _stack_class()
    return _CLASSES["stack"]


def hybrid_model_class() -> type:
    """The ``MambaModel`` subclass to build (created on first use: megatron-core is imported lazily)."""
    if "model" not in _CLASSES:
        _CLASSES["model"] = _mamba_model_class()
    return _CLASSES["model"]
