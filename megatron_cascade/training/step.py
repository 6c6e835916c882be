"""One optimizer step on a rollout batch, and forward-only log-probs (teacher / reference / old)."""

from __future__ import annotations

import logging
import torch
import torch.distributed as dist

from dataclasses import replace
from typing import Optional

from megatron_cascade.algorithms import finalize_metrics
from megatron_cascade.config.rules import ConfigError
from megatron_cascade.config.training import TrainingConfig
from megatron_cascade.training.batch import TrainBatch
from megatron_cascade.training.loss_plugin import (
    POLICY_METRIC_KEYS,
    LossSpec,
    local_normalizer_count,
    make_forward_step,
    make_logprob_step,
    model_sequence_multiple,
)
from megatron_cascade.training.packing import default_row_budget, gather_batch, pack_batch, rows_for_rank
from megatron_cascade.training.policy import Policy

log = logging.getLogger(__name__)

def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _tp_group():
    ps = _parallel_state()
    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def global_normalizer(spec: LossSpec, batch: TrainBatch) -> torch.Tensor:
    """Valid tokens (or sequences) of the whole global batch: summed over data-parallel ranks."""
    count = local_normalizer_count(spec, batch)
    dist.all_reduce(count, group=_parallel_state().get_data_parallel_group())
    return count


def _run_schedule(chunks: list, forward_step, micros: list[TrainBatch], forward_only: bool) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(micros) for _ in chunks],
        model=chunks,
        num_microbatches=len(micros),
        # The whole row under context parallelism: the schedule divides it by CP itself.
        seq_length=micros[0].seq_length if micros[0].packing is None else micros[0].packing.row_length,
        micro_batch_size=micros[0].size,
        forward_only=forward_only,
    )


def _schedulable(batch: TrainBatch, chunks: list, micro_batch_size: int) -> TrainBatch:
    """``batch`` padded to whole micro-batches and to the layout's sequence multiple (SP / CP / FP8).

    The sequence padding happens here, for the whole batch, because the pipeline schedule sends
    [S/TP, b, H] activations between stages with one shape for every micro-batch (padding inside
    the loss would be too late under PP). Padding rows and positions carry no loss."""
    return batch.padded_to_multiple(micro_batch_size).padded_sequences_to_multiple(
        model_sequence_multiple(chunks[0]))


def _metrics_device(keys: tuple, per_micro: list[dict]) -> torch.device:
    """Where the loss metrics live (the model's device); ranks without them (pipeline stages
    before the last) use the current accelerator, or the CPU."""
    for metrics in per_micro:
        return metrics[keys[0]].device
    return _current_device()


def _current_device() -> torch.device:
    """The current accelerator (where collectives of NCCL groups need their tensors), or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reduce_metric_sums(keys: tuple, per_micro: list[dict]) -> dict[str, float]:
    """Sum metric dicts over micro-batches, data-parallel ranks and pipeline stages (only the last
    stage has them), so that every rank holds the global sums (float64, on the metrics' device)."""
    ps = _parallel_state()
    sums = torch.zeros(len(keys), dtype=torch.float64, device=_metrics_device(keys, per_micro))
    for metrics in per_micro:
        sums += torch.stack([metrics[k].to(torch.float64).reshape(()) for k in keys])
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())
    return dict(zip(keys, sums.tolist()))


def _grads_are_finite(policy: Policy) -> bool:
    grads = [p.main_grad for p in policy.chunks[0].parameters() if getattr(p, "main_grad", None) is not None]
    # One device-side reduction, one host sync: the sum of norms is finite iff every entry is.
    total = torch.stack(torch._foreach_norm(grads)).sum().float().cpu() if grads else torch.zeros(())
    bad = torch.tensor(0.0 if torch.isfinite(total) else 1.0)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


def _has_grad_scaler(policy: Policy) -> bool:
    """Whether Megatron's optimizer scales the loss (fp16): it then finds non-finite gradients itself,
    skips the step and lowers the scale; a skip decided before it would never lower the scale."""
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    return any(getattr(opt, "grad_scaler", None) is not None for opt in optimizers)


def _zero_grads(policy: Policy) -> None:
    for chunk in policy.chunks:
        chunk.zero_grad_buffer()
    policy.optimizer.zero_grad()


def _regrouping_is_exact(model: torch.nn.Module) -> bool:
    """Whether the training loss of ``model`` is a plain sum over rows, so that rows and positions
    without loss can be dropped and micro-batches regrouped without changing the gradient.

    Not for MoE models (routers count every non-padding token of a micro-batch in their
    load-balancing statistics and expert-bias loads, and expert-parallel all-to-alls need the same
    forwards on every rank), nor with dropout (its masks are drawn per element of the batch shape).
    """
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return not (config.num_moe_experts or config.hidden_dropout > 0 or config.attention_dropout > 0)


def _training_work(batch: TrainBatch, model: torch.nn.Module, micro_batch_size: int) -> tuple[TrainBatch, int]:
    """What the training forward/backward runs of ``batch``, and its rows per micro-batch.

    Where that is exact (``_regrouping_is_exact``): only the rows with loss tokens, up to the last
    loss position (``TrainBatch.loss_rows_only``: filtered GRPO groups, masked overlong responses
    and padding rows are not run), in as many micro-batches as ``micro_batch_size`` allows, evenly
    filled (8 rows at ``micro_batch_size`` 16 run as one micro-batch of 8, not 16 with 8 padding
    rows). Otherwise ``batch`` and ``micro_batch_size`` as they are.
    """
    if not _regrouping_is_exact(model):
        return batch, micro_batch_size
    work = batch.loss_rows_only()
    micros = -(-work.size // micro_batch_size)
    return work, -(-work.size // micros)


def _context_parallel_size(model: torch.nn.Module) -> int:
    from megatron.core.utils import get_model_config

    return get_model_config(model).context_parallel_size


def packs(model: torch.nn.Module, sequence_packing: bool) -> bool:
    """Whether passes of ``model`` run on packed rows (``training/packing.py``): when
    ``training.sequence_packing`` asks for it, and always under context parallelism (the CP split
    is per sequence)."""
    return sequence_packing or _context_parallel_size(model) > 1


def _check_packable(model: torch.nn.Module) -> None:
    """Refuse the MoE setting packing would change silently (``ConfigError`` naming the keys)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if config.num_moe_experts and config.moe_router_load_balancing_type == "seq_aux_loss" and config.moe_aux_loss_coeff:
        raise ConfigError("training.sequence_packing (or parallel.context_parallel_size > 1) with "
                          "model.moe.router_load_balancing_type=seq_aux_loss: the router would take a packed row "
                          "for one sequence; use aux_loss or none, or turn packing off")


def packed_micro_batches(batch: TrainBatch, chunks: list, micro_batch_size: int,
                         max_tokens_per_row: Optional[int]) -> list[TrainBatch]:
    """``batch`` packed into rows for ``chunks``' layout (``training/packing.py``), one [1, T / CP]
    micro-batch per row for this CP rank: sequences padded to 2 x CP, rows to the layout's sequence
    multiple, every row as long as the longest under pipeline parallelism (one activation shape)."""
    ps = _parallel_state()
    _check_packable(chunks[0])
    cp = _context_parallel_size(chunks[0])
    budget = max_tokens_per_row or default_row_budget(batch, micro_batch_size)
    _, rows = pack_batch(batch, max_tokens_per_row=budget, sequence_multiple=2 * cp if cp > 1 else 1,
                         row_multiple=model_sequence_multiple(chunks[0]),
                         equal_rows=ps.get_pipeline_model_parallel_world_size() > 1,
                         cp_size=cp, cp_rank=ps.get_context_parallel_rank() if cp > 1 else 0)
    return rows


def _without_loss(row: TrainBatch) -> TrainBatch:
    """A packed row that runs like ``row`` but carries no loss (a lockstep dummy micro-batch)."""
    seqs = row.packing.sequences
    quiet = replace(seqs, loss_mask=torch.zeros_like(seqs.loss_mask))
    return replace(row, loss_mask=torch.zeros_like(row.loss_mask), packing=replace(row.packing, sequences=quiet))


def _in_lockstep(rows: list[TrainBatch], model: torch.nn.Module) -> list[TrainBatch]:
    """``rows`` plus loss-free copies of its first row up to the largest row count of any
    data-parallel replica, for an MoE whose experts span replicas (``expert_lockstep_needed``)."""
    if not expert_lockstep_needed(model):
        return rows
    return rows + [_without_loss(rows[0])] * (lockstep_count(len(rows)) - len(rows))


def _dp_balanced_rows(batch: TrainBatch, chunks: list, training: TrainingConfig) -> list[TrainBatch]:
    """This data-parallel rank's packed rows when the replicas' sequences are packed together: the
    global batch is gathered over the DP group, packed the same way on every rank, and its rows
    dealt out by token count (``rows_for_rank``). Exact: each rank's loss is a partial sum over the
    global normaliser and the gradients are summed over DP. A rank left without a row runs a
    loss-free copy of one (its collectives)."""
    ps = _parallel_state()
    group = ps.get_data_parallel_group()
    whole = gather_batch(batch, group, _current_device())
    rows = packed_micro_batches(whole, chunks, training.micro_batch_size, training.max_tokens_per_row)
    mine = rows_for_rank([row.packing.row_length for row in rows], ps.get_data_parallel_world_size(),
                         ps.get_data_parallel_rank())
    return [rows[i] for i in mine] if mine else [_without_loss(rows[0])]


def _training_micro_batches(policy: Policy, batch: TrainBatch, training: TrainingConfig) -> list[TrainBatch]:
    """The micro-batches the training forward/backward runs: packed rows (``packs``; balanced over
    data-parallel ranks when there are several), or the rows of ``_training_work`` padded for the
    layout."""
    if packs(policy.chunks[0], training.sequence_packing):
        if _parallel_state().get_data_parallel_world_size() > 1:
            rows = _dp_balanced_rows(batch, policy.chunks, training)
        else:
            rows = packed_micro_batches(batch, policy.chunks, training.micro_batch_size, training.max_tokens_per_row)
        return _in_lockstep(rows, policy.chunks[0])
    work, micro_rows = _training_work(batch, policy.chunks[0], training.micro_batch_size)
    return list(_schedulable(work, policy.chunks, micro_rows).micro_batches(micro_rows))


def compute_gradients(policy: Policy, batch: TrainBatch, spec: LossSpec, training: TrainingConfig) -> dict:
    """Forward+backward of the global loss; leaves the finalised (DP-reduced) gradient in the
    policy's grad buffers. Collective over all ranks; returns global loss metrics (same on all ranks).

    With ``training.sequence_packing`` or context parallelism the sequences run packed
    (``training/packing.py``, ``training/context_parallel.py``); the loss, normaliser and metrics
    are those of the unpacked batch.
    """
    normalizer = global_normalizer(spec, batch)  # of the whole batch, before loss-free rows are dropped
    micros = _training_micro_batches(policy, batch, training)
    _zero_grads(policy)
    for chunk in policy.chunks:
        chunk.train()
    per_micro = _run_schedule(policy.chunks, make_forward_step(spec, normalizer, _tp_group()), micros, False)
    sums = _reduce_metric_sums(("loss", *spec.objective.metric_keys, *POLICY_METRIC_KEYS), per_micro)
    metrics = {k: float(v) for k, v in finalize_metrics(sums).items()}
    metrics["normalizer"] = float(normalizer)
    return metrics


def apply_gradients(policy: Policy, training: TrainingConfig, *, empty: bool = False) -> dict[str, float]:
    """Clip and apply the gradient in the grad buffers, then advance the lr schedule.

    A step is skipped on all ranks (weights, optimizer state and schedule untouched; logged) when
    the global batch had no valid token (``empty``: Adam momentum and weight decay would still move
    the weights), or when a gradient holds NaN/inf on any rank and ``training.skip_nonfinite_steps``.
    With fp16 loss scaling Megatron's optimizer makes that call (always): it skips the step and
    lowers the loss scale, which grows back after ``optimizer.loss_scale_window`` clean steps.
    Returns ``grad_norm``, ``lr``, ``skipped`` (0 or 1) and, with fp16, ``loss_scale``.
    """
    scaled = _has_grad_scaler(policy)
    if empty or (training.skip_nonfinite_steps and not scaled and not _grads_are_finite(policy)):
        log.warning("skipping optimizer step: %s", "no valid token in the batch" if empty else "non-finite gradients")
        _zero_grads(policy)
        out = {"grad_norm": float("nan") if not empty else 0.0, "skipped": 1.0}
    else:
        ok, grad_norm, _ = policy.optimizer.step()
        if ok:
            policy.scheduler.step(increment=1)
        else:
            log.warning("optimizer skipped the step: non-finite gradients (fp16 loss scale now %g)",
                        float(policy.optimizer.get_loss_scale()))
        out = {"grad_norm": float(grad_norm or 0.0) if ok else float("nan"), "skipped": 0.0 if ok else 1.0}
    out["lr"] = _current_lr(policy)
    if scaled:
        out["loss_scale"] = float(policy.optimizer.get_loss_scale())
    return out


def train_step(policy: Policy, batch: TrainBatch, spec: LossSpec, training: TrainingConfig) -> dict[str, float]:
    """One optimizer step on this rank's share of the global batch; collective over all ranks.

    Returns global metrics (the same on every rank): ``loss``, the loss metrics as means (e.g.
    ``is_abs_log_ratio_mean``, ``clip_frac``, ``reverse_kl_mean``), ``tokens``, ``grad_norm``, ``lr``
    and ``skipped`` (1.0 when the step was skipped for non-finite gradients).
    """
    metrics = compute_gradients(policy, batch, spec, training)
    metrics.update(apply_gradients(policy, training, empty=metrics.pop("normalizer") == 0))
    return metrics


def _current_lr(policy: Policy) -> float:
    return float(policy.optimizer.param_groups[0]["lr"])


def optimize_on_batch(policy: Policy, batch: TrainBatch, spec: LossSpec, training: TrainingConfig) -> dict:
    """``training.ppo_epochs`` optimizer steps on one rollout batch (1 = strictly on-policy).

    With several epochs, the log-probs of the policy before the first update become
    ``old_logprobs`` (the PPO ratio's denominator). Returns the last step's metrics.
    """
    if training.ppo_epochs > 1 and batch.old_logprobs is None:
        batch.old_logprobs = forward_logprobs(policy.chunks, batch, spec, **logprob_pass_options(training))
    metrics: dict = {}
    for _ in range(training.ppo_epochs):
        metrics = train_step(policy, batch, spec, training)
    return metrics


def expert_lockstep_needed(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an MoE whose expert-parallel group holds ranks of other data-parallel
    replicas: their MoE all-to-alls then pair this rank's forwards with theirs, so every replica
    must run as many forwards (a rank with less work runs dummy ones). No communication: a
    comparison of group memberships. ``model`` may be wrapped (DDP, Float16Module)."""
    from megatron.core.utils import get_model_config

    ps = _parallel_state()
    if not get_model_config(model).num_moe_experts or ps.get_expert_model_parallel_world_size() <= 1:
        return False
    experts = set(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    replica = set(dist.get_process_group_ranks(ps.get_model_parallel_group()))
    return not experts <= replica


def lockstep_count(local: int) -> int:
    """The largest ``local`` over all data-parallel replicas (one all-reduce of one integer).

    Reduced over the data-parallel group rather than the expert-parallel group: every replica is
    in it, so all ranks of a replica (its TP/PP ranks too, which sit in different EP groups) get
    the same figure and keep their own collectives in step as well."""
    count = torch.tensor([local], dtype=torch.int64, device=_current_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=_parallel_state().get_data_parallel_group())
    return int(count.item())


def _with_rows(batch: TrainBatch, rows: int) -> TrainBatch:
    """``batch`` with fully masked padding rows appended up to ``rows`` rows (an empty batch becomes
    all padding: a dummy forward that keeps this rank in step, its log-probs thrown away)."""
    if batch.size == 0:
        shape = (rows, max(batch.seq_length, 1))
        zeros = torch.zeros(shape, dtype=torch.long)
        return TrainBatch(input_ids=zeros, target_ids=zeros, loss_mask=torch.zeros(shape),
                          padding_mask=torch.ones(shape, dtype=torch.bool))
    return batch.padded_to_multiple(rows) if rows > batch.size else batch


def _run_forward_only(chunks: list, forward_step, micros: list[TrainBatch]) -> None:
    """The forward-only schedule over ``micros`` with ``chunks`` in eval mode (modes restored)."""
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        _run_schedule(chunks, forward_step, micros, True)
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)


def _from_last_stage(out: torch.Tensor) -> torch.Tensor:
    """``out`` (CPU) as the last pipeline stage holds it, on every stage (a broadcast under PP, on
    the current accelerator: NCCL groups take no CPU tensors)."""
    ps = _parallel_state()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        last = ps.get_pipeline_model_parallel_last_rank()
        wire = out.to(_current_device())
        dist.broadcast(wire, src=last, group=ps.get_pipeline_model_parallel_group())
        out = wire.cpu()
    return out


def _packed_forward_logprobs(chunks: list, batch: TrainBatch, spec: LossSpec, micro_batch_size: int,
                             max_tokens_per_row: Optional[int]) -> torch.Tensor:
    """``forward_logprobs`` on packed rows: each row's [n, L] log-probs written back to its
    sequences' rows of a [B, S] result (0 after each sequence's last loss position)."""
    rows = packed_micro_batches(batch, chunks, micro_batch_size, max_tokens_per_row) if batch.size else []
    count = lockstep_count(len(rows)) if expert_lockstep_needed(chunks[0]) else len(rows)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    if count == 0:
        return out
    if not rows:  # this replica has nothing to run: dummy rows keep it in step with the others
        rows = packed_micro_batches(_with_rows(batch, 1), chunks, micro_batch_size, max_tokens_per_row)
    micros = rows + [rows[0]] * (count - len(rows))
    sink: list[torch.Tensor] = []
    _run_forward_only(chunks, make_logprob_step(spec, _tp_group(), sink), micros)
    for row, values in zip(rows if batch.size else [], sink):
        out[row.packing.source_rows, : values.shape[1]] = values
    return _from_last_stage(out)


@torch.no_grad()
def logprob_pass_options(training: TrainingConfig) -> dict:
    """The ``forward_logprobs`` keyword arguments a stage's ``training`` section sets (micro-batch size,
    packing): the old-policy, KL-reference and teacher passes run batches as the training step does."""
    return {"micro_batch_size": training.micro_batch_size, "sequence_packing": training.sequence_packing,
            "max_tokens_per_row": training.max_tokens_per_row}


def forward_logprobs(chunks: list, batch: TrainBatch, spec: LossSpec, micro_batch_size: int, *,
                     sequence_packing: bool = False, max_tokens_per_row: Optional[int] = None) -> torch.Tensor:
    """[B, S] log-probs of ``batch.target_ids`` under the model in ``chunks`` (forward only).

    Works for the policy and for frozen models (teachers, references); the result is broadcast from
    the last pipeline stage, so every rank gets it. Collective over the model-parallel group and,
    for an MoE whose experts span data-parallel ranks (``expert_lockstep_needed``), over the
    data-parallel group: every replica then runs the largest micro-batch count of any (its own
    rows padded, no loss), as the MoE all-to-all needs. ``B`` may be 0 (dummy forwards only).

    ``sequence_packing`` / ``max_tokens_per_row`` (``training.*``): run packed rows (always under
    context parallelism); positions after a row's last loss token then come back as 0.
    """
    if packs(chunks[0], sequence_packing):
        return _packed_forward_logprobs(chunks, batch, spec, micro_batch_size,
                                        max_tokens_per_row if sequence_packing else None)
    micros = -(-batch.size // micro_batch_size)
    if expert_lockstep_needed(chunks[0]):
        micros = lockstep_count(micros)
    if micros == 0:
        return torch.empty(batch.input_ids.shape, dtype=torch.float32)
    padded = _schedulable(_with_rows(batch, micros * micro_batch_size), chunks, micro_batch_size)
    sink: list[torch.Tensor] = []
    _run_forward_only(chunks, make_logprob_step(spec, _tp_group(), sink), list(padded.micro_batches(micro_batch_size)))
    out = torch.cat(sink) if sink else torch.empty(padded.input_ids.shape, dtype=torch.float32)
    return _from_last_stage(out)[: batch.size, : batch.seq_length]
