"""One generation forward on this rank's pipeline stage: packed tokens ``[1, T]`` under the paged
context, or a dummy forward (expert-parallel lockstep), with hidden states passed between stages.

Pipeline parallelism: every stage holds the same request bookkeeping (each admits and finishes
the same requests from the same broadcast tokens), so each knows the step's token count ``T`` and
can post its receive of ``[T, 1, hidden]`` from the previous stage; the last stage returns logits.
In the overlapped schedule sends do not block and the last stage sends each step's tokens to the
other stages point to point (``send_tokens`` / ``recv_tokens``) instead of a broadcast.

Sequence parallelism is turned off while generating (``sequence_parallel_off``), as Megatron's
text generation controller does for inference: a decode step has a handful of tokens per step and
the packed layout needs every TP rank to see the whole step. MoE layers need no SP for correctness:
with SP off each TP rank routes the full step, the dispatcher's gather over the TP group then
repeats tokens TP times and the combine's reduce-scatter hands each rank one full copy back.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_cascade.rollout.comm import pack, unpack
from megatron_cascade.rollout.replica_groups import replica_groups
from megatron_cascade.rollout.model_runner import unwrap_model
from megatron_cascade.rollout.sampling import SampleOutput


class StageForward:
    """Forwards of the model chunk on this rank (first, middle or last pipeline stage)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.gpt = unwrap_model(model)
        self.groups = replica_groups(self.gpt)
        self.first, self.last = self.groups.first, self.groups.last
        self._prev, self._next = self.groups.prev, self.groups.next
        self.tp_size = self.groups.tp_size
        self.device = next(self.gpt.parameters()).device

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, context,
                 pending: Optional[list] = None) -> Optional[torch.Tensor]:
        """Logits ``[1, R, V_padded]`` (R = the context's active requests, last tokens only; TP-gathered)
        on the last stage, None elsewhere. ``input_ids``/``position_ids``: ``[1, T]``.

        ``pending``: send the hidden states without waiting, appending the send to it (the caller
        waits before the tensors may be reused); None: a blocking send.
        """
        if not self.first:
            cfg = self.gpt.config
            hidden = torch.empty((input_ids.shape[1], 1, cfg.hidden_size),
                                 dtype=cfg.pipeline_dtype or cfg.params_dtype, device=self.device)
            dist.recv(hidden, self._prev)
            self.gpt.set_input_tensor(hidden)
        out = self.model(input_ids, position_ids, None, inference_context=context, runtime_gather_output=True)
        if not self.last:
            out = out.contiguous()
            if pending is None:
                dist.send(out, self._next)
            else:
                pending.append(_Pending(dist.isend(out, self._next), out))
            return None
        return out

    def send_tokens(self, out: SampleOutput) -> list:
        """Last stage: this step's tokens to every other stage (non-blocking sends, to be waited on)."""
        packed = pack(out)
        me = dist.get_rank()
        return [_Pending(dist.isend(packed, rank), packed) for rank in self.groups.pp_ranks if rank != me]

    def recv_tokens(self, batch_size: int) -> SampleOutput:
        """Other stages: the tokens the last stage sent for a step of ``batch_size`` rows."""
        packed = torch.empty((3, batch_size), dtype=torch.float64, device=self.device)
        dist.recv(packed, self.groups.pp_ranks[-1])
        return unpack(packed)

    def dummy(self, tokens: Optional[int] = None) -> None:
        """A forward of ``tokens`` (default ``tp_size``; FP8 needs 8) padding tokens without a context
        (no KV written), through every stage: it takes part in the MoE all-to-alls of the step like a
        real one."""
        tokens = torch.zeros((1, tokens or self.tp_size), dtype=torch.long, device=self.device)
        self(tokens, tokens, None)


# Where Megatron modules keep their sequence-parallel switches (as ``set_model_to_sequence_parallel``).
_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


class _Pending:
    """A non-blocking send and the tensor it reads (kept alive until the send completes)."""

    def __init__(self, work, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()


@contextlib.contextmanager
def sequence_parallel_off(model: torch.nn.Module) -> Iterator[None]:
    """Sequence parallelism off in every module for the duration; each flag restored exactly.

    Megatron's ``set_model_to_sequence_parallel(model, True)`` would set every flag back to True,
    also those that were False before (expert linears with expert_tensor_parallel_size=1): the
    next training forward would then gather expert inputs that are not split. So the flags that
    were True are recorded and only those are restored.
    """
    gpt = unwrap_model(model)
    if not getattr(gpt.config, "sequence_parallel", False):
        yield
        return
    switched = [(module, attr) for module in gpt.modules() for attr in _SP_ATTRS
                if getattr(module, attr, None) is True]
    configs = {id(m.config): m.config for m in gpt.modules()
               if getattr(getattr(m, "config", None), "sequence_parallel", False) is True}
    for module, attr in switched:
        setattr(module, attr, False)
    for cfg in configs.values():
        cfg.sequence_parallel = False
    try:
        yield
    finally:
        for module, attr in switched:
            setattr(module, attr, True)
        for cfg in configs.values():
            cfg.sequence_parallel = True
