"""MoE load-balancing losses weighted like the policy loss, so that their gradient does not depend on how
the global batch is split (micro-batches, data/tensor/expert/pipeline parallel).

What Megatron-Core does, and why it is wrong here: with ``calculate_per_token_loss=True`` the router
attaches ``aux_loss * local_routed_tokens`` and relies on ``finalize_model_grads`` dividing every
gradient by the global loss-token count. Our losses are already divided by their global normaliser N
(``training/loss_plugin.py``), so finalize passes no token count and the aux-loss gradient would come
out multiplied by the number of routed tokens of each micro-batch and summed over micro-batches and
data-parallel ranks. (Without a padding mask that count is the rank's SP shard of the micro-batch, so
the weight would also shrink with TP: read from megatron-core 0.16.1, not measured.)

The choice made here: the load-balancing loss is averaged *exactly like the policy loss*. Each
sequence b of the global batch gets the weight ``w_b = (its loss tokens) / N`` (MOPD "sequence"
normalisation: ``1[b has a loss token] / N``), computed by the training step
(``training.loss_plugin.aux_loss_row_weights``) and handed to the routers for the forward pass with
``aux_loss_weights``. Then the objective is ``policy loss + coeff * A`` with

* ``seq_aux_loss``: ``A = sum_b w_b * a_b``, ``a_b`` the Switch load-balancing loss of sequence b alone
  (its routed fractions and mean router probabilities over its own non-padding tokens). It decomposes
  per sequence, so the gradient is the same for every split of the batch.
* ``aux_loss``: ``A = sum_k (sum_{b in k} w_b) * a_k``, ``a_k`` the loss of micro-batch k as
  Megatron-Core computes it (statistics over the micro-batch's non-padding tokens, across TP/CP).
  It is nonlinear in the micro-batch, so it is invariant to DP/TP/EP/PP for the same micro-batches but
  changes with the micro-batch size: that is its definition, not a numerical error.

Sequences with no loss token (filtered GRPO groups, rows added to fill a micro-batch) contribute no aux
loss, as they contribute no policy gradient. Padding positions (``TrainBatch.padding_mask``: right
padding, positions added for SP/CP/FP8) are left out of the router statistics through Megatron-Core's
``padding_mask``. The expert-bias token counts use the same mask.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_ROW_WEIGHTS: Optional[torch.Tensor] = None


@contextlib.contextmanager
def aux_loss_weights(weights: torch.Tensor) -> Iterator[None]:
    """Make ``weights`` ([B] float, one per sequence of the micro-batch about to run forward) the
    aux-loss weights that every ``GlobalNormalizedRouter`` reads while the block runs."""
    global _ROW_WEIGHTS
    previous, _ROW_WEIGHTS = _ROW_WEIGHTS, weights
    try:
        yield
    finally:
        _ROW_WEIGHTS = previous


def _current_weights(bsz: Optional[int], device: torch.device) -> torch.Tensor:
    """The [B] weights set by ``aux_loss_weights`` (``bsz``: the rows the router saw, when it knows)."""
    if _ROW_WEIGHTS is None:
        raise RuntimeError(
            "an MoE router computed a load-balancing loss outside megatron_cascade's training step: run training "
            "forwards through training.loss_plugin.make_forward_step (it sets the per-sequence weights), or set "
            "model.moe.router_load_balancing_type=none"
        )
    if bsz is not None and _ROW_WEIGHTS.shape != (bsz,):
        raise RuntimeError(f"aux-loss weights have shape {tuple(_ROW_WEIGHTS.shape)}, the micro-batch has {bsz} rows")
    return _ROW_WEIGHTS.to(device=device, dtype=torch.float32)


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    class GlobalNormalizedRouter(TopKRouter):
        """``TopKRouter`` whose load-balancing losses carry the per-sequence weights of ``aux_loss_weights``
        (see the module docstring). Routing, expert bias and state-dict keys are the parent's."""

        def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                with_padding_mask=False):
            from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

            coeff = self.get_aux_loss_coeff("seq_aux_loss")
            if coeff == 0:
                return probs
            num_experts = self.config.num_moe_experts
            # Tokens are [S_local, B] flattened: per sequence, sum this rank's shard, then over TP x CP.
            scores = scores_for_aux_loss.reshape(seq_length, bsz, num_experts)
            local_counts = routing_map.reshape(seq_length, bsz, num_experts).sum(dim=0).float()
            counts = reduce_from_tensor_model_parallel_region(local_counts, self.tp_cp_group)  # [B, E]
            tokens = counts.sum(dim=-1) / self.topk  # [B] non-padding tokens of each whole sequence
            # Per sequence: E * coeff / (k T_b^2) * sum_i P_bi c_bi, P from this rank's tokens only:
            # summing over TP ranks (the SP grad all-reduce) gives the whole sequence's loss.
            scale = num_experts * coeff / (self.topk * tokens.clamp(min=1.0) ** 2)
            per_sequence = (scores.sum(dim=0) * counts).sum(dim=-1) * scale
            weighted = (per_sequence * _current_weights(bsz, per_sequence.device)).sum()
            self._log_aux_loss("seq_load_balancing_loss", per_sequence.sum() / bsz / coeff)
            return _attach(probs, weighted)

        def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                               reduce_group, reduce_group_has_dp=False, valid_token_count=None):
            # Reached from TopKRouter._apply_aux_loss (micro-batch loss) only: the seq loss is ours and
            # global_aux_loss is refused by the config validation.
            if aux_loss_name != "load_balancing_loss":
                raise NotImplementedError(f"{aux_loss_name} is not supported (model.moe.router_load_balancing_type)")
            self._log_aux_loss(aux_loss_name, aux_loss / aux_loss_coeff)
            return _attach(activation, aux_loss * _current_weights(None, aux_loss.device).sum())

        def _apply_expert_bias(self, routing_map, padding_mask=None):
            # megatron-core 0.16.1 masks [tokens, E] with a [tokens] mask (a broadcast error); the
            # counts must leave padding out, or the bias update would depend on the layout's padding.
            if self.enable_expert_bias and torch.is_grad_enabled():
                with torch.no_grad():
                    if padding_mask is not None:
                        routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                    self.local_tokens_per_expert += routing_map.sum(dim=0)

        def _log_aux_loss(self, name: str, value: torch.Tensor) -> None:
            from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            save_to_aux_losses_tracker(name, value.detach(), self.layer_number, num_layers,
                                       reduce_group=self.tp_cp_group)

    return GlobalNormalizedRouter


def _attach(activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's trick: ``activation`` unchanged forward; backward also sends d(aux_loss) = the
    schedule's loss scale (1, or the fp16 loss scale), so the aux loss joins the policy loss's gradient."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.apply(activation, aux_loss)


_ROUTER = None


def global_normalized_router() -> type:
    """The ``TopKRouter`` subclass to put in MoE layer specs (built once, on first use, because
    megatron-core is imported lazily)."""
    global _ROUTER
    if _ROUTER is None:
        _ROUTER = _router_class()
    return _ROUTER


def with_global_normalized_routers(block_spec):
    """A copy of a decoder block spec whose MoE layers use ``GlobalNormalizedRouter`` (works for the
    local and the Transformer Engine specs: only the router class changes, not module names)."""
    from dataclasses import replace

    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    def swap(layer):
        mlp = layer.submodules.mlp
        if not isinstance(getattr(mlp, "submodules", None), MoESubmodules):
            return layer
        mlp = replace(mlp, submodules=replace(mlp.submodules, router=global_normalized_router()))
        return replace(layer, submodules=replace(layer.submodules, mlp=mlp))

    return replace(block_spec, layer_specs=[swap(layer) for layer in block_spec.layer_specs])
