"""The Megatron-Core plug-in: ``forward_step`` returning ``(output, loss_func)`` for any loss kind.

Normalisation (why the losses are exact under any batch split):
    The pure losses divide by a *global* normaliser N (valid tokens, or sequences for MOPD
    "sequence") counted over every micro-batch of every data-parallel rank before the step. Megatron
    would add its own 1/num_microbatches (schedules) and 1/DP (DDP averaging); we switch both off with
    ``config.calculate_per_token_loss = True`` (the schedule then neither divides the loss nor DDP the
    gradients) and a ``finalize_model_grads_func`` that passes no token count. The gradient is then
    the sum over micro-batches and replicas of (partial sum / N): the gradient of the global loss.
    MoE load-balancing losses are weighted per sequence with the same N (``aux_loss_row_weights``,
    ``model/moe_aux_loss.py``).

Sequence padding: each micro-batch is padded to ``model.builder.sequence_length_multiple`` of the
model's layout (SP / CP / FP8) here, outside the loss (loss mask 0, ``padding_mask`` True).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_cascade.config.training import LossConfig
from megatron_cascade.model.builder import sequence_length_multiple
from megatron_cascade.model.moe_aux_loss import aux_loss_weights
from megatron_cascade.ops import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_truncated_logprobs
from megatron_cascade.training.batch import TrainBatch
from megatron_cascade.training.losses import Loss, build_loss, check_needs
from megatron_cascade.training.packing import unpacked_outputs
from megatron_cascade.training.output_head import OUTPUT_HEADS, fused_logprob_head, split_head_output, use_fused_head

# Metric sums the plug-in adds to every loss's own (all-reduced and finalised with them).
POLICY_METRIC_KEYS = ("entropy_sum",)


@dataclass(frozen=True)
class LossSpec:
    """What a training step optimises.

    Attributes:
        kind: a registered loss (``training/losses``: "sft", "grpo", "mopd").
        loss: the loss section of the config.
        temperature: the sampling temperature; log-probs are of softmax(logits / temperature).
        vocab_size: real vocabulary size (padded embedding rows are left out of the softmax).
        top_k, top_p: the sampler's truncation (``rollout.top_k`` / ``rollout.top_p``); log-probs and
            entropy are then those of the truncated, renormalised distribution the responses were
            sampled from (``ops/truncated_logprobs.py``). 0 / 1.0: no truncation.
        output_head: where log-probs come from on the last pipeline stage. "fused": straight from the
            hidden states (``training/output_head.py``: output layer, log-probs and entropy fused and
            chunked over tokens; no [tokens, V/TP] logits or logits gradient is held). "logits": the
            model's logits, then ``token_logprobs``. "auto" (default): fused unless the spec truncates
            (top-k / top-p need whole logit rows) or the model cannot (``fused_head_blocker``).
    """

    kind: str
    loss: LossConfig
    temperature: float = 1.0
    vocab_size: Optional[int] = None
    top_k: int = 0
    top_p: float = 1.0
    output_head: str = "auto"
    objective: Loss = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", build_loss(self.kind, self.loss))
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {self.top_k}, {self.top_p}")
        if self.output_head not in OUTPUT_HEADS:
            raise ValueError(f"output_head must be one of {OUTPUT_HEADS}, got {self.output_head!r}")
        if self.output_head == "fused" and self.truncated:
            raise ValueError(f"output_head='fused' cannot give top-k / top-p truncated log-probs (top_k={self.top_k}, "
                             f"top_p={self.top_p}: rollout.top_k / rollout.top_p): use 'auto' or 'logits'")

    @property
    def truncated(self) -> bool:
        """Whether log-probs are of the top-k / top-p truncated distribution."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def counts_sequences(self) -> bool:
        """Whether the normaliser is a sequence count (MOPD "sequence") rather than a token count."""
        return self.objective.normalization == "sequence"


def local_normalizer_count(spec: LossSpec, batch: TrainBatch) -> torch.Tensor:
    """This rank's contribution to the global normaliser (float64 scalar)."""
    mask = batch.loss_mask.bool()
    count = mask.any(dim=-1).sum() if spec.counts_sequences else mask.sum()
    return count.to(torch.float64)


def tempered(logits: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``logits / temperature`` (the logits themselves at temperature 1), divided in float32 as the
    sampler divides (``rollout/sampling.py``): 16-bit logits divided in their own dtype are rounded to
    8 (bf16) or 11 (fp16) bits after the division, log-prob errors of ~1e-2 at T=0.7. One float32 copy
    of the logits where the 16-bit quotient was one 16-bit copy; the fused head avoids both."""
    if spec.temperature == 1.0:
        return logits
    if logits.dtype in (torch.bfloat16, torch.float16):
        return logits.float().div_(spec.temperature)  # .float() made a copy: dividing it in place is safe
    return logits / spec.temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, spec: LossSpec, tp_group, *,
                   with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs [B, S] of ``targets`` under the sampling distribution — softmax(logits / temperature),
    truncated to the sampler's top-k / top-p when the spec has them — and, with ``with_entropy``, that
    distribution's entropy [B, S] (nats, no gradient; else None). logits [B, S, V/TP]."""
    scaled = tempered(logits, spec)
    if spec.truncated:
        return vocab_parallel_truncated_logprobs(scaled, targets, top_k=spec.top_k, top_p=spec.top_p, group=tp_group,
                                                 vocab_size=spec.vocab_size, with_entropy=with_entropy)
    logprobs = vocab_parallel_logprobs(scaled, targets, group=tp_group, vocab_size=spec.vocab_size)
    entropy = None
    if with_entropy:
        entropy = vocab_parallel_entropy(scaled.detach(), group=tp_group, vocab_size=spec.vocab_size)
    return logprobs, entropy


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 sum of ``values`` where ``mask`` is set (e.g. the ``entropy_sum`` metric over loss tokens)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum().to(torch.float64)


def compute_loss(spec: LossSpec, logprobs: torch.Tensor, micro: TrainBatch, normalizer: torch.Tensor):
    """The configured loss on one micro-batch: ``(loss, metric sums)``."""
    check_needs(spec.objective, micro)
    return spec.objective(logprobs, micro, normalizer)


def aux_loss_row_weights(spec: LossSpec, micro: TrainBatch, normalizer: torch.Tensor) -> torch.Tensor:
    """[b] float32 weight of each sequence's MoE load-balancing loss: its share of the global
    normaliser N (loss tokens / N; MOPD "sequence": 1[any loss token] / N), so that the aux loss is
    averaged exactly like the policy loss (``model/moe_aux_loss.py``)."""
    mask = micro.loss_mask.bool()
    counts = mask.any(dim=-1) if spec.counts_sequences else mask.sum(dim=-1)
    return (counts.to(torch.float64) / normalizer.to(counts.device).clamp(min=1)).to(torch.float32)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def model_sequence_multiple(model: torch.nn.Module) -> int:
    """The multiple (tokens) that ``model``'s layout needs sequence lengths padded to (SP / CP / FP8;
    ``model.builder.sequence_length_multiple``). ``model`` may be wrapped (DDP, Float16Module)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return sequence_length_multiple(
        tensor_parallel=config.tensor_model_parallel_size, sequence_parallel=config.sequence_parallel,
        context_parallel=config.context_parallel_size, fp8=bool(config.fp8),
    )


def _prepared(micro: TrainBatch, model: torch.nn.Module) -> TrainBatch:
    """The micro-batch on the model's device, its sequences padded for the model's parallel layout
    (a no-op when the caller padded the whole batch already)."""
    return micro.to(_device_of(model)).padded_sequences_to_multiple(model_sequence_multiple(model))


def _run_model(model: torch.nn.Module, micro: TrainBatch) -> torch.Tensor:
    """[b, S, V/TP] logits (last stage; under the fused head [b, S, k] log-probs, ``training/output_head.py``;
    [S, b, H] hidden states before) of ``micro``; MoE layers get its padding mask, a packed row its
    ``packed_seq_params`` (THD) and per-sequence positions (``training/packing.py``)."""
    from megatron.core.utils import get_model_config

    kwargs = {}
    config = get_model_config(model)
    if config.num_moe_experts and micro.padding_mask is not None:
        kwargs["padding_mask"] = _stage_padding_mask(micro.padding_mask, config)
    if micro.packing is not None:
        kwargs["packed_seq_params"] = micro.packed_seq_params
    return model(micro.input_ids, micro.position_ids(), None, **kwargs)


def _stage_padding_mask(padding_mask: torch.Tensor, config) -> torch.Tensor:
    """[b, S] mask as this pipeline stage's GPTModel takes it. The first stage scatters it over the
    sequence-parallel ranks itself; later stages receive SP-split hidden states but would get the
    mask whole (megatron-core 0.16.1 scatters only where it embeds), so they get this rank's slice."""
    from megatron.core import parallel_state as ps

    if not config.sequence_parallel or ps.is_pipeline_first_stage(ignore_virtual=True):
        return padding_mask
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return padding_mask.chunk(tp, dim=1)[rank].contiguous()


def _logprob_head(spec: LossSpec, model: torch.nn.Module, micro: TrainBatch, tp_group, with_entropy: bool):
    """(context for the model call, fused): the fused log-prob head over ``model`` for ``micro`` where
    ``spec.output_head`` and the model allow it (``training/output_head.py``), else a no-op."""
    if not use_fused_head(spec.output_head, spec.truncated, model):
        return nullcontext(), False
    head = fused_logprob_head(model, micro.target_ids, temperature=spec.temperature, vocab_size=spec.vocab_size,
                              tp_group=tp_group, with_entropy=with_entropy)
    return head, True


def _output_logprobs(output: torch.Tensor, micro: TrainBatch, spec: LossSpec, tp_group, fused: bool,
                     with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[b, S] log-probs (and entropy) of ``micro.target_ids`` from the last stage's model output:
    the fused head's [b, S, k], or [b, S, V/TP] logits."""
    if fused:
        return split_head_output(output, micro.target_ids)
    return token_logprobs(output, micro.target_ids, spec, tp_group, with_entropy=with_entropy)


def make_forward_step(spec: LossSpec, normalizer: torch.Tensor, tp_group) -> Callable:
    """A Megatron ``forward_step_func`` over an iterator of ``TrainBatch`` micro-batches.

    Its ``loss_func`` returns ``(loss, num_tokens, metric_sums)``, the per-token-loss form of the
    schedules (requires ``config.calculate_per_token_loss = True``, see module docstring).
    """

    def forward_step(data_iterator, model):
        micro = _prepared(next(data_iterator), model)
        head, fused = _logprob_head(spec, model, micro, tp_group, with_entropy=True)
        with aux_loss_weights(aux_loss_row_weights(spec, micro, normalizer)), head:
            output = _run_model(model, micro)

        def loss_func(output: torch.Tensor):
            logprobs, entropy = _output_logprobs(output, micro, spec, tp_group, fused, with_entropy=True)
            # A packed row's loss is computed on its sequences as rows (training/packing.py).
            logprobs, entropy, seqs = unpacked_outputs(logprobs, entropy, micro)
            loss, metrics = compute_loss(spec, logprobs, seqs, normalizer)
            num_tokens = seqs.loss_mask.bool().sum().to(torch.int)
            # Clones: Megatron may scale the returned loss in place.
            reported = {k: v.detach().clone() for k, v in metrics.items()}
            reported["loss"] = loss.detach().clone()
            # Policy entropy over loss tokens (``entropy_mean`` after finalising).
            reported["entropy_sum"] = masked_sum(entropy, seqs.loss_mask)
            return loss, num_tokens, reported

        return output, loss_func

    return forward_step


def make_logprob_step(spec: LossSpec, tp_group, sink: list) -> Callable:
    """A forward-only ``forward_step_func`` that appends each micro-batch's [b, S] log-probs to ``sink``."""

    def forward_step(data_iterator, model):
        original = next(data_iterator)
        micro = _prepared(original, model)
        head, fused = _logprob_head(spec, model, micro, tp_group, with_entropy=False)
        with head:
            output = _run_model(model, micro)

        def loss_func(output: torch.Tensor):
            logprobs, _ = _output_logprobs(output, micro, spec, tp_group, fused, with_entropy=False)
            logprobs, _, _ = unpacked_outputs(logprobs, None, micro)  # a packed row: [n, L] of its sequences
            if micro.packing is None:
                logprobs = logprobs[:, : original.seq_length]
            sink.append(logprobs.detach().cpu())
            return torch.zeros((), device=output.device), {}

        return output, loss_func

    return forward_step
