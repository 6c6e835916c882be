"""The model's output layer replaced, for one forward, by log-probs straight from the hidden states.

GPTModel (and MambaModel) end with ``logits, _ = self.output_layer(hidden, weight=output_weight, ...)``
and return ``logits.transpose(0, 1)``: [b, S, V/TP] logits, and in training their gradient too.
``fused_logprob_head`` swaps the forward of that ``ColumnParallelLinear`` (the instance attribute
shadows the class method; module hooks still run) for ``ops.fused_output_logprobs``, so the model
returns [b, S, k] float32 instead: k = 1 (log-probs) or 2 (log-probs, entropy). Nothing
[tokens, vocab]-sized is kept, in forward or backward.

Why swap the output layer rather than run the decoder ourselves: the model's own ``forward`` keeps
doing everything else (embedding, rotary, padding masks for MoE routing, packed sequences, the final
norm, Float16Module's casts, DDP's forward hooks), and the weight it passes is the one it would use:
the shared embedding weight with tied embeddings, ``output_layer.weight`` otherwise; its gradient
reaches the parameter through autograd, so DDP's hooks add it to ``main_grad`` as usual (and, with
tied embeddings over several pipeline stages, ``finalize_model_grads`` all-reduces it with the first
stage's copy as usual). Only the chunk holding the output layer (``post_process``: the last pipeline
stage, the last virtual chunk) is affected.

Tensor / sequence parallelism follow ColumnParallelLinear: the hidden states are replicated over
the TP group and their gradient all-reduced in the op; under sequence parallelism they arrive as
[S/TP, b, H] and are all-gathered over the sequence first, whose backward reduce-scatters the
gradient (the op then leaves its hidden gradient unreduced: ``reduce_hidden_grad=False``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from megatron_cascade.config.rules import ConfigError
from megatron_cascade.ops import fused_output_logprobs

# LossSpec.output_head: how the trainer gets log-probs from the model.
OUTPUT_HEADS = ("auto", "fused", "logits")


def _head_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside ``model``'s wrappers (DDP, Float16Module): the one with ``post_process``."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "post_process", return_model_obj=True)


def fused_head_blocker(model: torch.nn.Module) -> Optional[str]:
    """Why the fused head cannot replace ``model``'s output layer (a config key and the reason), or None."""
    config = _head_model(model).config
    if config.defer_embedding_wgrad_compute:
        return ("TransformerConfig.defer_embedding_wgrad_compute=True: the output layer's weight gradient is "
                "computed later from activations it buffers, which the fused head does not fill")
    return None


def check_model_supported(model: torch.nn.Module) -> None:
    """Refuse models the training plug-in cannot run on either path (``ConfigError`` naming the key)."""
    config = _head_model(model).config
    if config.mtp_num_layers:
        raise ConfigError(f"TransformerConfig.mtp_num_layers={config.mtp_num_layers}: multi-token prediction "
                          "needs labels inside the model and its own loss; the training plug-in computes "
                          "log-probs of the sampled tokens only. Build the model without MTP layers")


def use_fused_head(output_head: str, truncated: bool, model: torch.nn.Module) -> bool:
    """Whether log-probs of ``model`` come from the fused head under ``output_head`` ("auto" | "fused" |
    "logits"). "auto": fused unless the spec truncates the distribution (``truncated``: top-k / top-p
    need the whole logit row, ``ops/truncated_logprobs.py``) or the model has a blocker."""
    check_model_supported(model)
    if output_head == "logits" or truncated:
        return False  # LossSpec refuses output_head="fused" with truncation
    blocker = fused_head_blocker(model)
    if blocker is not None and output_head == "fused":
        raise ConfigError(f"output_head='fused' cannot run on this model: {blocker}. Use 'auto' or 'logits'")
    return blocker is None


@contextmanager
def fused_logprob_head(model: torch.nn.Module, targets: torch.Tensor, *, temperature: float,
                       vocab_size: Optional[int], tp_group, with_entropy: bool) -> Iterator[None]:
    """While active, ``model`` (a chunk, possibly wrapped) returns [b, S, k] float32 instead of logits.

    Args:
        model: a model chunk; a chunk without the output layer (``post_process`` False) is left as is.
        targets: [b, S] global token ids of the micro-batch the model runs on (as its ``input_ids``).
        temperature: log-probs are of softmax(logits / temperature) (> 0).
        vocab_size: real vocabulary size; padded embedding rows are left out of the softmax.
        tp_group: the tensor-parallel group (None at TP=1).
        with_entropy: k = 2, channel 1 the entropy (nats, no gradient) of the tempered distribution.
    Output channel 0: log-probs of ``targets``, differentiable w.r.t. the hidden states and weight.
    """
    gpt = _head_model(model)
    if not gpt.post_process:
        yield
        return
    layer = gpt.output_layer

    def head(hidden: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        # hidden [S(/TP under SP), b, H]; weight: the shared embedding weight (tied) or None.
        weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        if hidden.shape[:2] != targets.t().shape:
            raise ValueError(f"fused log-prob head: hidden states {tuple(hidden.shape)} do not match the "
                             f"targets [b, S] {tuple(targets.shape)} (expected [S, b, H])")
        out = fused_output_logprobs(hidden, weight, targets.t(), temperature=temperature, group=tp_group,
                                    vocab_size=vocab_size, with_entropy=with_entropy,
                                    reduce_hidden_grad=not layer.sequence_parallel)
        channels = out if with_entropy else (out,)
        return torch.stack(channels, dim=-1), None  # [S, b, k]; the model transposes it to [b, S, k]

    previous = layer.__dict__.get("forward")  # an instance-level forward someone else set, if any
    layer.forward = head
    try:
        yield
    finally:
        if previous is None:
            del layer.forward  # the class's forward again
        else:
            layer.forward = previous


def split_head_output(output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs [b, S], entropy [b, S] or None) from the fused head's [b, S, k] model output."""
    if output.dim() != 3 or output.shape[:2] != targets.shape or output.shape[-1] not in (1, 2):
        raise ValueError(f"the model returned {tuple(output.shape)}, not the fused head's [b, S, 1|2] for targets "
                         f"{tuple(targets.shape)}: its forward does not end in output_layer(...).transpose(0, 1)")
    return output[..., 0], (output[..., 1] if output.shape[-1] == 2 else None)
