"""One forward step of the static generation path (``static.py``): Megatron's static KV cache, or
recomputing the whole prefix.

With ``use_kv_cache=True`` the model runs under Megatron-Core's ``StaticInferenceContext`` (passed
as ``inference_context=``): the first step (prefill) encodes the prompts, each later step feeds one
token per row and the attention layers read the earlier keys/values from the context's per-layer
cache. Megatron writes the new K/V at ``sequence_len_offset``, one offset for the whole batch, which
this runner advances after every step (Megatron's own generation controller does the same).

With ``use_kv_cache=False`` every step runs the full prefix with no context: the reference the
cached path is tested against, and the baseline of the benchmark.

Hybrid (Mamba) models keep their SSM state in the same context: each Mamba layer stores a conv
state ``[B, conv_channels, kernel]`` and an SSM state ``[B, heads, head_dim, state]`` under its
layer number (Megatron's ``MambaMixer._get_states_from_cache``); the prefill writes them, each decode
step advances them by one token. Left padding reaches neither (``mamba_padding.py``).

Pipeline parallelism: the stages run one after another for each step. A stage receives the
hidden states ``[s, B, hidden]`` of the previous stage (``recv``), runs its layers (each stage
caches the K/V of its own layers) and sends its output on; the last stage returns logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.rollout.layout import PaddedBatch
from megatron_cascade.rollout.mamba_padding import MambaPaddingMask


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (they all keep it in ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_hybrid(model: torch.nn.Module) -> bool:
    """Whether the model is a hybrid ``MambaModel`` (on any pipeline stage, Mamba layers or not)."""
    return bool(getattr(unwrap_model(model).config, "is_hybrid_model", False))


def accepts_padding_mask(model: torch.nn.Module) -> bool:
    """Whether every attention layer is Megatron's local ``DotProductAttention``, which applies an
    arbitrary boolean mask. Transformer Engine's attention reads masks by mask type (and ignores
    them under the ``no_mask`` type Megatron switches to when decoding), so it gets no padding.
    Mamba layers of a hybrid model take padding through ``MambaPaddingMask`` (``StepRunner``).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m.core_attention for m in unwrap_model(model).modules() if hasattr(m, "core_attention")]
    return all(isinstance(c, DotProductAttention) for c in cores)


class StepRunner:
    """Runs generation steps for one ``PaddedBatch`` on this rank's pipeline stage."""

    def __init__(self, model: torch.nn.Module, batch: PaddedBatch, use_kv_cache: bool) -> None:
        from megatron_cascade.rollout.replica_groups import replica_groups

        self.model = model
        self.gpt = unwrap_model(model)
        self.groups = replica_groups(self.gpt)
        self.batch = batch
        self.use_kv_cache = use_kv_cache
        self.context = self._new_context() if use_kv_cache else None
        self.first_stage, self.last_stage = self.groups.first, self.groups.last
        self.pp_size = self.groups.pp_size
        self._prev_rank, self._next_rank = self.groups.prev, self.groups.next
        self.mamba_padding = MambaPaddingMask(self.gpt) if batch.padded and is_hybrid(model) else None

    def close(self) -> None:
        """Release what the runner installed on the model (the Mamba padding hooks)."""
        if self.mamba_padding is not None:
            self.mamba_padding.remove()

    def _new_context(self):
        from megatron.core.inference.contexts import StaticInferenceContext

        return StaticInferenceContext(self.batch.batch_size, self.batch.max_length)

    def step(self, end: int) -> Optional[torch.Tensor]:
        """Logits ``[B, V_padded]`` (float, TP-gathered) predicting column ``end`` from ``[0, end)``.

        Returns None on pipeline stages other than the last. The KV-cached runner feeds only the
        columns it has not seen yet, so ``end`` must grow by one per call after the first.
        """
        start = self.context.sequence_len_offset if self.use_kv_cache else 0
        if start >= end:
            raise ValueError(f"step(end={end}) but the cache already holds {start} columns")
        out = self._forward_stage(start, end)
        if self.use_kv_cache:
            self.context.increment_sequence_len_offset(end - start)
        if not self.last_stage:
            return None
        # Logits are [B, s, V]; with the cache Megatron returns the last column only (s = 1).
        return out[:, -1, :]

    def _forward_stage(self, start: int, end: int) -> torch.Tensor:
        b = self.batch
        if not self.first_stage:
            self.gpt.set_input_tensor(self._recv_hidden(end - start))
        if self.mamba_padding is not None:
            self.mamba_padding.set(~b.valid[:, start:end])
        out = self.model(
            b.tokens[:, start:end],
            b.position_ids[:, start:end],
            b.attention_mask(start, end),
            inference_context=self.context,
            # Megatron asserts this under an inference context; without one, we want full-vocab
            # logits all the same (sampling needs the whole distribution on every TP rank).
            runtime_gather_output=True,
        )
        if not self.last_stage:
            dist.send(out.contiguous(), self._next_rank)
        return out

    def _recv_hidden(self, seq: int) -> torch.Tensor:
        cfg = self.gpt.config
        buf = torch.empty((seq, self.batch.batch_size, cfg.hidden_size), dtype=cfg.pipeline_dtype or cfg.params_dtype,
                          device=self.batch.tokens.device)
        dist.recv(buf, self._prev_rank)
        return buf
