"""The training batch: padded token tensors aligned so that position t predicts token t+1, and the
layout of a packed row (``PackedLayout``; ``packing.py`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

import torch


@dataclass
class TrainBatch:
    """One data-parallel rank's share of a rollout batch.

    All per-token tensors are [B, S] and aligned to ``target_ids``: entry t concerns the prediction
    of ``target_ids[:, t] == input_ids[:, t + 1]`` from the prefix ``input_ids[:, :t + 1]``.

    Attributes:
        input_ids: [B, S] int64 tokens fed to the model (prompt + response, right-padded).
        target_ids: [B, S] int64 next tokens.
        loss_mask: [B, S] 1 where the target is a response token that counts in the loss.
        advantages: [B] or [B, S] GRPO advantages.
        inference_logprobs: [B, S] log-probs of the targets under the sampler (mismatch correction).
        teacher_logprobs: [B, S] log-probs of the targets under the MOPD teacher.
        old_logprobs: [B, S] log-probs under the policy that sampled (PPO epochs > 1).
        ref_logprobs: [B, S] log-probs under the KL reference.
        padding_mask: [B, S] bool, True where the position holds no token of the sequence (right
            padding, or positions added to fit the parallel layout). MoE routers leave these out of
            their load-balancing statistics and expert-bias counts; None = every position is a token.
        packing: set on a packed row (``training/packing.py``, B = 1): where its sequences lie (THD
            ``cu_seqlens``), this context-parallel rank's positions, and the sequences as rows of
            the source batch, on which the loss is computed. None: one sequence per row.
    """

    input_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    inference_logprobs: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None
    packing: Optional["PackedLayout"] = None

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        for f in _tensor_fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "advantages":
                continue
            if tuple(value.shape) != shape:
                raise ValueError(f"TrainBatch.{f.name} has shape {tuple(value.shape)}, input_ids has {shape}")
        if self.advantages is not None and tuple(self.advantages.shape) not in (shape[:1], shape):
            raise ValueError(f"TrainBatch.advantages has shape {tuple(self.advantages.shape)}; "
                             f"expected [{shape[0]}] or {list(shape)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    def position_ids(self) -> torch.Tensor:
        """[B, S] int64 positions the model embeds and rotates: 0..S-1 per row, or, in a packed row,
        positions restarting at 0 for every sequence (this context-parallel rank's share)."""
        if self.packing is not None:
            return self.packing.position_ids.unsqueeze(0)
        ids = self.input_ids
        return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)

    @property
    def packed_seq_params(self):
        """Megatron-Core ``PackedSeqParams`` (qkv_format "thd", ``cu_seqlens``) of a packed row, for any
        model that takes them (GPTModel, MambaModel); None for a batch of one sequence per row."""
        return None if self.packing is None else self.packing.packed_seq_params()

    def select(self, rows: slice | torch.Tensor) -> "TrainBatch":
        """The sub-batch of ``rows`` (a slice or an index tensor)."""
        _refuse_packed(self, "select")
        return replace(self, **{f.name: _take(getattr(self, f.name), rows) for f in _tensor_fields(self)})

    def to(self, device: torch.device) -> "TrainBatch":
        """The batch with every tensor on ``device`` (rollouts and data are built on the CPU)."""
        moved = replace(self, **{f.name: _move(getattr(self, f.name), device) for f in _tensor_fields(self)})
        return moved if self.packing is None else replace(moved, packing=self.packing.to(device))

    def padded_to_multiple(self, multiple: int) -> "TrainBatch":
        """Append fully masked rows (no loss token, all padding) so that the batch size is a multiple
        of ``multiple``."""
        extra = -self.size % multiple
        if extra == 0:
            return self
        _refuse_packed(self, "padded_to_multiple")
        batch = self.with_padding_mask()
        return replace(batch, **{f.name: _pad(batch, f.name, extra, dim=0) for f in _tensor_fields(batch)})

    def padded_sequences_to_multiple(self, multiple: int) -> "TrainBatch":
        """Append padding positions (loss mask 0, ``padding_mask`` True) so that the sequence length is
        a multiple of ``multiple`` (``model.builder.sequence_length_multiple``: SP / CP / FP8 layouts).

        Sequences are right-padded and attention is causal, so no real position sees the new ones:
        the loss and its gradient are unchanged. A packed row is returned as it is: it was laid out
        for the layout when it was packed (``training/packing.py``; under context parallelism its
        length is this rank's share, not a multiple of the whole layout's).
        """
        extra = -self.seq_length % multiple
        if extra == 0 or self.packing is not None:
            return self
        batch = self.with_padding_mask()
        return replace(batch, **{f.name: _pad(batch, f.name, extra, dim=1) for f in _tensor_fields(batch)})

    def loss_rows_only(self) -> "TrainBatch":
        """The rows with at least one loss token, cut after the last position that carries loss.

        What is dropped adds nothing to a loss, its gradient or its metrics (all sums over loss
        positions), and attention is causal, so no kept position saw a dropped one: a dense model
        computes the same loss on the smaller batch. Filtered GRPO groups, masked overlong responses
        and padding rows are dropped this way. One (fully masked) row of one position is kept when
        no row has loss, so that the caller still runs a forward and its collectives.
        """
        mask = self.loss_mask.bool()
        rows = mask.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return self.select(slice(0, 1)).truncated(1)
        columns = int(mask[rows].any(dim=0).nonzero().max()) + 1
        if rows.numel() == self.size and columns == self.seq_length:
            return self
        return self.select(rows).truncated(columns)

    def truncated(self, seq_length: int) -> "TrainBatch":
        """The first ``seq_length`` positions of every row ([B] advantages are kept whole)."""
        if seq_length >= self.seq_length:
            return self
        _refuse_packed(self, "truncated")
        return replace(self, **{f.name: _first_positions(getattr(self, f.name), seq_length)
                                for f in _tensor_fields(self)})

    def with_padding_mask(self) -> "TrainBatch":
        """The batch with ``padding_mask`` materialised (all False when it was None)."""
        if self.padding_mask is not None:
            return self
        return replace(self, padding_mask=torch.zeros(self.input_ids.shape, dtype=torch.bool,
                                                      device=self.input_ids.device))

    def micro_batches(self, micro_batch_size: int) -> Iterator["TrainBatch"]:
        """Consecutive micro-batches of ``micro_batch_size`` rows (the batch must divide evenly)."""
        if self.size % micro_batch_size:
            raise ValueError(f"batch of {self.size} rows does not split into micro-batches of {micro_batch_size}")
        for start in range(0, self.size, micro_batch_size):
            yield self.select(slice(start, start + micro_batch_size))


def _tensor_fields(batch: TrainBatch) -> list:
    """The dataclass fields of ``batch`` that hold tensors (all but ``packing``)."""
    return [f for f in fields(batch) if f.name != "packing"]


def _refuse_packed(batch: TrainBatch, what: str) -> None:
    if batch.packing is not None:
        raise ValueError(f"TrainBatch.{what} on a packed row: its sequences' boundaries would no longer match "
                         "(select or cut the batch before packing it)")


def _take(value: Optional[torch.Tensor], rows) -> Optional[torch.Tensor]:
    return None if value is None else value[rows]


def _first_positions(value: Optional[torch.Tensor], seq_length: int) -> Optional[torch.Tensor]:
    return value if value is None or value.dim() < 2 else value[:, :seq_length]


def _move(value: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if value is None else value.to(device, non_blocking=True)


def _pad(batch: TrainBatch, name: str, extra: int, dim: int) -> Optional[torch.Tensor]:
    """Field ``name`` with ``extra`` entries appended along ``dim`` (0 rows, 1 positions): zeros, and
    True in ``padding_mask``. [B] fields (advantages) have no position dimension to pad."""
    value = getattr(batch, name)
    if value is None or dim >= value.dim():
        return value
    shape = list(value.shape)
    shape[dim] = extra
    fill = True if name == "padding_mask" else 0
    return torch.cat([value, torch.full(shape, fill, dtype=value.dtype, device=value.device)], dim=dim)


@dataclass(frozen=True)
class PackedLayout:
    """Where the sequences of one packed row lie, and which of its positions this CP rank holds.

    Attributes:
        sequences: the packed sequences as rows of the source batch, [n, L] (L = the longest
            sequence's length): what the loss is computed on.
        source_rows: [n] int64 row of each sequence in the source batch.
        lengths: [n] int64 tokens of each sequence (up to its last loss position).
        cu_seqlens: [m + 1] int32 starts of the m segments (the n sequences, then the tail padding
            segment when there is one) in the whole row, by their real lengths.
        cu_seqlens_padded: [m + 1] int32 the same by padded lengths (multiples of 2 x CP): where
            each segment lies in the row.
        positions: [T / CP] int64 the row positions this context-parallel rank holds (all of them
            without CP), in the order the rank holds them.
        position_ids: [T / CP] int64 each held position's offset inside its segment (RoPE / learned
            position embeddings restart per sequence).
        cp_size: context-parallel ranks the row is split over.
    """

    sequences: TrainBatch
    source_rows: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    positions: torch.Tensor
    position_ids: torch.Tensor
    cp_size: int = 1

    @property
    def row_length(self) -> int:
        """Tokens of the whole row (all CP ranks), padding included."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def segment_lengths(self) -> list[int]:
        """Padded tokens of each segment of the row (its sequences, then the tail padding)."""
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).tolist()

    @property
    def max_seqlen(self) -> int:
        """The longest padded segment (tokens): Megatron's rotary table length for the row."""
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())

    def packed_seq_params(self):
        """Megatron-Core ``PackedSeqParams`` of the row (qkv_format "thd"; ``cu_seqlens`` of the whole
        row: Megatron and Transformer Engine divide them by CP themselves)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cp_group = None
        if self.cp_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen, cp_group=cp_group,
        )

    def unpack(self, row_values: torch.Tensor) -> torch.Tensor:
        """[n, L] per-sequence values from [T] values of the whole row (differentiable; 0 after each
        sequence's end)."""
        steps = torch.arange(self.sequences.seq_length, device=row_values.device)
        starts = self.cu_seqlens_padded[:-1][: self.lengths.numel()].to(row_values.device, torch.long)
        index = starts.unsqueeze(1) + steps.unsqueeze(0)
        valid = steps.unsqueeze(0) < self.lengths.to(row_values.device).unsqueeze(1)
        picked = row_values[index.clamp(max=row_values.numel() - 1)]
        return torch.where(valid, picked, torch.zeros_like(picked))

    def to(self, device: torch.device, non_blocking: bool = False) -> "PackedLayout":
        """The layout with its tensors on ``device`` (``cu_seqlens`` go where attention runs)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, sequences=self.sequences.to(device), cu_seqlens=move(self.cu_seqlens),
                       cu_seqlens_padded=move(self.cu_seqlens_padded), positions=move(self.positions),
                       position_ids=move(self.position_ids))
