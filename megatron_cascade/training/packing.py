"""Padding-free packing: the sequences of a ``TrainBatch`` packed into rows of a token budget (THD).

Why: rollout rows are right-padded to the longest response of the batch, so with lengths spread
over 64..1024 tokens most of a padded micro-batch is padding that attention, the MLPs and the MoE
routers all process. A packed row holds several whole sequences back to back (Megatron-Core's
``thd`` format: one row, ``cu_seqlens`` marking where each sequence starts); attention stays inside
each sequence (Transformer Engine's THD kernels on GPU, ``model/cpu_spec.py`` on CPU) and RoPE
restarts at position 0 for every sequence, so each sequence computes what it computes alone.

What a sequence is: a row of the source batch up to its last loss position. What follows carries no
loss and, attention being causal, no earlier position sees it (the rule ``TrainBatch.loss_rows_only``
uses too); rows without a loss token are not run (their forward log-probs come back as 0).

How rows are filled: first-fit decreasing into rows of ``max_tokens_per_row`` tokens (a sequence
longer than that gets a row of its own), which gives the fewest rows; then the same number of rows
is refilled longest-first into the least loaded row, which evens out their token counts (and so the
micro-batches' cost) whenever that still fits the budget. Each packed row is one micro-batch.

What does not change: the loss is computed on the sequences as rows of the source batch
(``unpacked_outputs``: the packed log-probs are scattered back into ``[n, L]``), so every loss, its
per-sequence terms (MOPD "sequence" normalisation, [B] advantages) and its metrics are the ones of
the unpacked batch; the global normaliser is counted on the source batch before packing.

Layout padding: every sequence is padded to ``sequence_multiple`` (2 x CP under context parallelism:
each CP rank takes two of its 2 x CP chunks), and the row's tail to ``row_multiple`` (SP / CP / FP8,
``model.builder.sequence_length_multiple``) by a padding segment of its own. Padding positions carry no
loss and are masked out of the MoE router statistics (``padding_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.ops.zigzag import zigzag_positions
from megatron_cascade.training.batch import PackedLayout, TrainBatch
from megatron_cascade.training.context_parallel import gather_row_from_cp


def sequence_lengths(batch: TrainBatch) -> torch.Tensor:
    """[B] int64 tokens of each row's sequence: up to its last loss position (0: no loss token)."""
    mask = batch.loss_mask.bool()
    steps = torch.arange(1, batch.seq_length + 1, device=mask.device).expand_as(mask)
    return torch.where(mask, steps, torch.zeros_like(steps)).amax(dim=1) if batch.seq_length else \
        torch.zeros(batch.size, dtype=torch.long)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped into bins of at most ``capacity`` (an item larger than that gets
    a bin of its own): first-fit decreasing, the fewest bins this greedy finds. Deterministic."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def balanced_bins(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``count`` bins, longest first into the least loaded bin (LPT): the
    bins' loads are as even as this greedy makes them. Deterministic (ties by index)."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(count), key=lambda k: (loads[k], k))
        bins[b].append(i)
        loads[b] += sizes[i]
    return bins


def plan_rows(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` (tokens) grouped into packed rows of at most ``capacity`` tokens: as few
    rows as first-fit decreasing needs, their loads evened out (``balanced_bins``) where that still
    fits ``capacity``. Rows are ordered by their first index, each row's indices ascending."""
    if not sizes:
        return []
    capacity = max(capacity, max(sizes))
    rows = first_fit_decreasing(sizes, capacity)
    even = balanced_bins(sizes, len(rows))
    if all(sum(sizes[i] for i in row) <= capacity for row in even):
        rows = even
    return sorted((sorted(row) for row in rows if row), key=lambda row: row[0])


@dataclass(frozen=True)
class PackingPlan:
    """The packed rows of one batch: source-batch row indices per packed row, and each row's length."""

    rows: list[list[int]]
    lengths: torch.Tensor  # [B] int64 sequence tokens of every source row
    padded_lengths: list[int]  # per source row: length rounded up to the sequence multiple
    row_lengths: list[int]  # per packed row: tokens including the tail padding


def plan_packing(batch: TrainBatch, *, max_tokens_per_row: int, sequence_multiple: int = 1, row_multiple: int = 1,
                 equal_rows: bool = False) -> PackingPlan:
    """Which rows of ``batch`` go into which packed row.

    Args:
        max_tokens_per_row: the token budget of a row (a longer sequence gets a row of its own).
        sequence_multiple: every sequence is padded to a multiple of this (2 x CP).
        row_multiple: every row is padded to a multiple of this (``sequence_length_multiple``; a
            multiple of ``sequence_multiple``).
        equal_rows: pad every row to the longest one (the pipeline schedule sends one activation
            shape for all micro-batches).
    Rows without a loss token are left out; when no row has one, row 0 is kept (one position) so
    that the caller still runs a forward and its collectives.
    """
    if row_multiple % sequence_multiple:
        raise ValueError(f"row_multiple={row_multiple} is not a multiple of sequence_multiple={sequence_multiple}")
    lengths = sequence_lengths(batch).cpu()
    if batch.size and not bool((lengths > 0).any()):
        lengths = lengths.clone()
        lengths[0] = 1
    padded = [_round_up(int(n), sequence_multiple) for n in lengths.tolist()]
    kept = [i for i, n in enumerate(lengths.tolist()) if n > 0]
    rows = [[kept[j] for j in row] for row in plan_rows([padded[i] for i in kept], max_tokens_per_row)]
    row_lengths = [_round_up(sum(padded[i] for i in row), row_multiple) for row in rows]
    if equal_rows and row_lengths:
        row_lengths = [max(row_lengths)] * len(row_lengths)
    return PackingPlan(rows, lengths, padded, row_lengths)


def _segments(row: list[int], plan: PackingPlan, row_length: int) -> tuple[list[int], list[int]]:
    """Real and padded lengths of the row's segments: its sequences, then the tail padding (if any)."""
    real = [int(plan.lengths[i]) for i in row]
    padded = [plan.padded_lengths[i] for i in row]
    tail = row_length - sum(padded)
    if tail:
        real.append(tail)
        padded.append(tail)
    return real, padded


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _row_tensor(batch: TrainBatch, name: str, row: list[int], padded: list[int], row_length: int, fill):
    """[row_length] the row's values of field ``name``: each sequence's positions, then ``fill``."""
    value = getattr(batch, name)
    out = torch.full((row_length,), fill, dtype=value.dtype, device=value.device)
    start = 0
    for i, width in zip(row, padded):
        n = min(width, batch.seq_length)
        out[start:start + n] = value[i, :n]
        start += width
    return out


def packed_row(batch: TrainBatch, plan: PackingPlan, index: int, *, cp_size: int = 1, cp_rank: int = 0) -> TrainBatch:
    """Packed row ``index`` of ``plan`` as a [1, T / CP] ``TrainBatch`` (this CP rank's positions),
    its ``packing`` layout attached. Positions after a sequence's length are padding (no loss)."""
    row, row_length = plan.rows[index], plan.row_lengths[index]
    real, padded = _segments(row, plan, row_length)
    positions = zigzag_positions(padded, cp_size, cp_rank)
    offsets = torch.cat([torch.arange(n) for n in padded])
    source = batch.with_padding_mask()
    # Positions beyond a sequence's length, and the tail, are padding whatever the source held there.
    in_sequence = torch.cat([torch.arange(w) < n for w, n in zip(padded, real[: len(row)])] +
                            ([torch.zeros(row_length - sum(padded[: len(row)]), dtype=torch.bool)]))
    ids = _row_tensor(source, "input_ids", row, padded[: len(row)], row_length, 0)
    targets = _row_tensor(source, "target_ids", row, padded[: len(row)], row_length, 0)
    loss = _row_tensor(source, "loss_mask", row, padded[: len(row)], row_length, 0) * in_sequence
    pad = _row_tensor(source, "padding_mask", row, padded[: len(row)], row_length, True) | ~in_sequence
    rows = torch.tensor(row, dtype=torch.long)
    lengths = plan.lengths[rows]
    sequences = batch.select(rows).truncated(int(lengths.max()))
    layout = PackedLayout(sequences=sequences, source_rows=rows, lengths=lengths, cu_seqlens=_cumulative(real),
                          cu_seqlens_padded=_cumulative(padded), positions=positions,
                          position_ids=offsets[positions], cp_size=cp_size)
    local = lambda t: t[positions].unsqueeze(0)  # noqa: E731
    return TrainBatch(input_ids=local(ids), target_ids=local(targets), loss_mask=local(loss),
                      padding_mask=local(pad), packing=layout)


def pack_batch(batch: TrainBatch, *, max_tokens_per_row: int, sequence_multiple: int = 1, row_multiple: int = 1,
               equal_rows: bool = False, cp_size: int = 1, cp_rank: int = 0) -> tuple[PackingPlan, list[TrainBatch]]:
    """``batch`` packed into rows (``plan_packing``), each a [1, T / CP] micro-batch for this CP rank."""
    plan = plan_packing(batch, max_tokens_per_row=max_tokens_per_row, sequence_multiple=sequence_multiple,
                        row_multiple=row_multiple, equal_rows=equal_rows)
    rows = [packed_row(batch, plan, i, cp_size=cp_size, cp_rank=cp_rank) for i in range(len(plan.rows))]
    return plan, rows


def unpacked_outputs(logprobs: torch.Tensor, entropy: Optional[torch.Tensor], micro: TrainBatch,
                     cp_group=None) -> tuple[torch.Tensor, Optional[torch.Tensor], TrainBatch]:
    """The loss function's view of a micro-batch: for a packed row, its [1, T / CP] log-probs (and
    entropy) as [n, L] rows of its sequences, and those sequences as the batch (gathered over the
    context-parallel group first, differentiably); anything else is returned as it is."""
    layout = micro.packing
    if layout is None:
        return logprobs, entropy, micro
    if layout.cp_size > 1 and cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()

    def whole(values: torch.Tensor) -> torch.Tensor:
        row = values.reshape(-1)
        if layout.cp_size > 1:
            row = gather_row_from_cp(row, layout.row_length, cp_group, segment_lengths=layout.segment_lengths)
        return layout.unpack(row)

    return whole(logprobs), None if entropy is None else whole(entropy), layout.sequences


def default_row_budget(batch: TrainBatch, micro_batch_size: int) -> int:
    """The token budget of a packed row when ``training.max_tokens_per_row`` is null: what a padded
    micro-batch of ``micro_batch_size`` rows of this batch holds (so no row needs more memory)."""
    return micro_batch_size * max(int(sequence_lengths(batch).max()) if batch.size else 1, 1)


def gather_batch(batch: TrainBatch, group, device: torch.device) -> TrainBatch:
    """The batches of every rank of ``group`` as one (rows in rank order; shorter rows right-padded:
    loss 0, ``padding_mask`` True). Collective; every rank must hold the same fields (None or not).
    ``device``: where the collectives run (the accelerator under NCCL); the result is on the CPU."""
    shape = torch.tensor(batch.input_ids.shape, dtype=torch.long, device=device)
    shapes = [torch.empty_like(shape) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shapes, shape, group=group)
    rows = [int(s[0]) for s in shapes]
    width = max(int(s[1]) for s in shapes)
    padded = batch.with_padding_mask().padded_sequences_to_multiple(width) if batch.seq_length < width else \
        batch.with_padding_mask()
    gathered = {}
    for f in fields(TrainBatch):
        value = getattr(padded, f.name)
        if f.name == "packing" or value is None:
            continue
        wire = value.to(device=device, dtype=torch.uint8 if value.dtype == torch.bool else value.dtype)
        full = torch.zeros((max(rows), *wire.shape[1:]), dtype=wire.dtype, device=device)
        full[: wire.shape[0]] = wire
        parts = [torch.empty_like(full) for _ in rows]
        dist.all_gather(parts, full, group=group)
        joined = torch.cat([part[:n] for part, n in zip(parts, rows)]).cpu()
        gathered[f.name] = joined.bool() if value.dtype == torch.bool else joined
    return TrainBatch(**gathered)


def rows_for_rank(row_lengths: list[int], ranks: int, rank: int) -> list[int]:
    """Indices of the packed rows data-parallel rank ``rank`` of ``ranks`` runs: rows dealt longest
    first to the rank with the fewest tokens so far (``balanced_bins``), so that every replica
    processes about as many tokens. Deterministic: every rank computes every rank's share."""
    return sorted(balanced_bins(row_lengths, ranks)[rank])
