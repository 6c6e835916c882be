"""The static-batch generator: all rows of a batch decode in lockstep until the last one finishes.

This was ``generate``'s only path before the paged, continuous-batching one (``engine.py``). It
stays for two uses: ``generate(..., use_kv_cache=False)``, the full-recompute reference that the
paged path is tested against, and ``use_kv_cache=True`` (Megatron's ``StaticInferenceContext``,
one cache sized to the batch's longest row), the baseline of ``benchmarks/generation.py``.

Prompts of different lengths are left-padded into one batch (see ``layout.py``); with attention
that cannot take a padding mask (Transformer Engine) they are batched by prompt length instead.
Finished rows keep decoding (the batch shape is static); their tokens are no longer recorded.

Hybrid (Mamba) models generate here with ``use_kv_cache=True``: the static context also holds each
Mamba layer's conv and SSM state (``model_runner.py``); left padding is kept out of those states
(``mamba_padding.py``). With expert parallelism the ranks of an expert-parallel group
step together (``_ExpertLockstep``), as in the paged engine.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_cascade.cpu_runtime import device_rewrite_paused
from megatron_cascade.rollout.batch import RolloutSample
from megatron_cascade.rollout.comm import share_step
from megatron_cascade.rollout.layout import PaddedBatch, left_pad
from megatron_cascade.rollout.model_runner import StepRunner, accepts_padding_mask
from megatron_cascade.rollout.noise import gumbel_noise, sample_key
from megatron_cascade.rollout.params import SamplingParams
from megatron_cascade.rollout.sampling import SampleOutput, sample
from megatron_cascade.rollout.stopping import StopCriteria
from megatron_cascade.tokenizers.base import Tokenizer

OnFinished = Callable[[int, RolloutSample], None]
# The prefill runs a batch's prompts in one forward: its rows x prompt width is capped like a step of
# the paged engine (Megatron's default step limit), which bounds the layer intermediates of that forward.
MAX_PREFILL_TOKENS = 16384


def generate_static(model: torch.nn.Module, samples: list[RolloutSample], params: SamplingParams, *,
                    tokenizer: Tokenizer, limit: int, use_kv_cache: bool,
                    on_finished: Optional[OnFinished] = None, max_rows: Optional[int] = None) -> None:
    """Fill ``samples`` (prompt-major, ``prompt_ids`` set) in static batches of at most ``max_rows``
    rows (None: no limit); collective over the model-parallel group (and the expert-parallel group).
    The model must already be in eval mode under ``no_grad``."""
    rows = [s.prompt_ids for s in samples]
    device = next(model.parameters()).device
    stop = StopCriteria(params, tokenizer)
    keys = torch.tensor([sample_key(params.seed, s.prompt_index, s.sample_index) for s in samples],
                        dtype=torch.int64, device=device)
    lockstep = _ExpertLockstep.for_model(model)
    for group in _batches(rows, accepts_padding_mask(model), max_rows):
        batch = left_pad([rows[i] for i in group], tokenizer.pad_id, params.max_new_tokens, limit, device)
        runner = StepRunner(model, batch, use_kv_cache)
        try:
            _decode_loop(runner, batch, group, samples, params, stop, keys[group], tokenizer.vocab_size,
                         on_finished, lockstep)
        finally:
            runner.close()
    if lockstep is not None:
        lockstep.finish()


class _ExpertLockstep:
    """MoE all-to-alls need every rank of the expert-parallel group in every forward, but data-parallel
    replicas batch different prompts (other lengths, other counts). Before each forward, one
    all-reduce (MAX over the EP group) of "I have a step to run"; a rank whose batches are done runs
    dummy forwards (``StageForward.dummy``: padding tokens, no cache) until no rank has work left."""

    def __init__(self, model: torch.nn.Module, group) -> None:
        from megatron_cascade.rollout.stage_forward import StageForward

        self.group = group
        self.forward = StageForward(model)
        self.device = next(model.parameters()).device

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Optional["_ExpertLockstep"]:
        """The lockstep of ``model``'s EP group, or None without expert parallelism."""
        from megatron_cascade.rollout.replica_groups import replica_groups
        from megatron_cascade.rollout.model_runner import unwrap_model

        group = replica_groups(unwrap_model(model)).ep
        return None if group is None else cls(model, group)

    def _any(self, has_work: bool) -> bool:
        flag = torch.tensor([int(has_work)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def before_step(self) -> None:
        """This rank runs a real forward next (the others learn that someone has work)."""
        self._any(True)

    def finish(self) -> None:
        """Dummy forwards while any other rank still has steps; returns when none has."""
        while self._any(False):
            self.forward.dummy()


def _batches(rows: Sequence[Sequence[int]], padding_ok: bool, max_rows: Optional[int] = None) -> list[list[int]]:
    """Row indices per forward batch: all rows at once (left-padded), or one batch per prompt
    length where the attention cannot mask padding (no padding is then needed); each cut into
    batches of at most ``max_rows`` rows (the cache budget's)."""
    if not rows:
        return []
    if padding_ok:
        groups = [list(range(len(rows)))]
    else:
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(i)
        groups = list(by_length.values())
    if max_rows is None:
        return groups
    return [group[i:i + max_rows] for group in groups for i in range(0, len(group), max_rows)]


def _decode_loop(runner: StepRunner, batch: PaddedBatch, group: list[int], samples: list[RolloutSample],
                 params: SamplingParams, stop: StopCriteria, keys: torch.Tensor, vocab_size: int,
                 on_finished: Optional[OnFinished], lockstep: Optional[_ExpertLockstep] = None) -> None:
    """Sample column after column until every row of ``group`` is finished."""
    active = set(range(batch.batch_size))
    for column in range(batch.prompt_width, batch.max_length):
        if lockstep is not None:
            lockstep.before_step()
        # Decode steps create no CUDA-device tensors once the prefill has allocated the static
        # context (as in the paged engine): CPU mode's per-op rewriting steps aside for them.
        first = column == batch.prompt_width
        with contextlib.nullcontext() if first else device_rewrite_paused():
            logits = runner.step(column)
        local = None
        if logits is not None:
            positions = torch.full_like(keys, column - batch.prompt_width)
            noise = None if params.greedy else gumbel_noise(keys, positions, logits.shape[-1])
            local = sample(logits, params, vocab_size, None, gumbel=noise)
        out = share_step(local, batch.batch_size, batch.tokens.device, runner.groups)
        batch.append(column, out.tokens)
        active -= _record(out, group, samples, active, stop, batch.budgets, on_finished)
        if not active:
            return


def _record(out: SampleOutput, group: list[int], samples: list[RolloutSample], active: set[int],
            stop: StopCriteria, budgets: list[int], on_finished: Optional[OnFinished]) -> set[int]:
    """Append this step's token to each active row's sample; return the rows that just finished."""
    tokens = out.tokens.tolist()
    temp_lp = out.temperature_logprobs.tolist()
    sampled_lp = out.sampled_logprobs.tolist()
    finished = set()
    for row in sorted(active):
        s = samples[group[row]]
        s.response_ids.append(tokens[row])
        s.response_logprobs.append(temp_lp[row])
        s.sampled_logprobs.append(sampled_lp[row])
        reason = stop.check(s.response_ids, budgets[row])
        if reason is not None:
            s.finish_reason = reason
            finished.add(row)
            if on_finished is not None:
                on_finished(group[row], s)
    return finished
