"""The continuous-batching generator: every prompt x sample of a ``generate`` call through one
paged KV cache, requests entering as blocks free up and leaving the moment they finish.

Each step: admit waiting prompts (FIFO) while the KV budget, the request slots and the step's
token limit allow; run one forward over the packed tokens of every live request (prefill chunks
of new prompts and one decode token per older request, mixed); sample one token per request
(``sampling.sample``: the trainer's log-prob convention); record it, test the stop criteria and
hand finished samples to ``on_finished``; then let the context release their blocks.

A prompt's ``n`` samples share one prefill: the prompt enters as one request, its logits give the
first token of each sample admitted with it, and the context forks the request before the step's
bookkeeping (``PagedContext.fork``): the samples share the prompt's full KV blocks and each gets a
copy of the partly filled last one (``KVCacheConfig.share_prompt_blocks``).

Memory (KV on demand): blocks are taken one at a time as a response grows. A request is admitted
when the free blocks, less those the live requests still need to reach their expected length
(``KVCacheConfig.expected_response_fraction`` of their response budget), hold it at its expected
length (every sample admitted with a prompt counts, the prompt's shared blocks once). When a step's requests need
more new blocks than are free (responses longer than expected), the most recently admitted
requests are preempted (vLLM's recompute policy): their blocks are freed and they go back to the
front of the queue with their tokens so far, to be prefilled again from prompt + response when
blocks free up. Their sampled tokens do not change: sampling noise is a hash of (seed, prompt,
sample, position), never of the batch (``noise.py``); their log-probs change by float rounding only
(a prefill instead of decode steps). The oldest request is never
preempted, so every call finishes as long as one request fits the budget at its longest (checked
up front). ``KVCacheConfig.reserve_full_response`` restores worst-case reservation (blocks for the
whole response budget at admission, never a preemption): the benchmark's baseline.

Expert-parallel lockstep: MoE all-to-alls need every rank of the expert-parallel group in every
forward. One all-reduce (MAX over the EP group) per step decides whether any rank still has work;
a rank without (finished early, or called with no prompts) runs a dummy forward instead.

CUDA graphs (``KVCacheConfig.cuda_graphs``): the context pads each decode-only step to the smallest
of its graph batch sizes that holds it (Megatron's ``CUDAGraphBatchDimensionBuilder``: padding
tokens read and write the dummy block, padding requests have no keys); the logits rows of padding
requests are never sampled, so the tokens are those of an eager step. With EP the ranks agree on
one size per step (a MAX over the EP group inside the context; idle ranks join it).

Pipeline parallelism: by default one lane (one KV cache), every step through all stages in turn.
With ``overlap_pipeline_stages`` the requests are split over one lane per stage and the stages
work on different lanes at once (``_run_pipelined``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_cascade.rollout.batch import GenerationStats, RolloutSample
from megatron_cascade.rollout.block_allocator import full_blocks
from megatron_cascade.rollout.comm import share_step
from megatron_cascade.rollout.cuda_graphs import release_cuda_graphs
from megatron_cascade.rollout.kv_budget import cache_capacity, kv_layout
from megatron_cascade.rollout.noise import gumbel_noise, sample_key
from megatron_cascade.rollout.paged_context import PagedContext, build_context, cache_bytes, step_token_multiple
from megatron_cascade.rollout.attention_support import check_paged_attention
from megatron_cascade.rollout.params import KVCacheConfig, SamplingParams
from megatron_cascade.rollout.sampling import sample
from megatron_cascade.rollout.stage_forward import StageForward
from megatron_cascade.rollout.stopping import StopCriteria
from megatron_cascade.tokenizers.base import Tokenizer

OnFinished = Callable[[int, RolloutSample], None]
# Megatron's default step limit (prefill activation memory); raised to fit the longest prompt.
_MAX_TOKENS_PER_STEP = 16384


class _Lane:
    """One paged KV cache and the requests in it. One lane without pipeline parallelism; with it,
    one lane per stage so that the stages work on different lanes at once (see ``_run_pipelined``)."""

    def __init__(self, ctx: PagedContext, usable: int) -> None:
        self.ctx = ctx
        self.usable = usable  # blocks for requests
        self.reserved = 0  # reserve_full_response: blocks reserved by live requests (their whole budget)
        self.admitted: dict[int, int] = {}  # live request id -> admission order (preemption: newest first)
        self.forks: dict[int, list[int]] = {}  # request id -> samples to fork from it after its prefill
        self.awaiting: Optional[tuple] = None  # non-last stages: the step whose tokens are on the way

    @property
    def has_work(self) -> bool:
        return self.ctx.total_request_count > 0


class PagedGenerator:
    """Runs one ``generate`` call's samples to completion on this rank (collective over the
    model-parallel group, and over the expert-parallel group when EP > 1).

    Args:
        samples: one per (prompt, sample), prompt-major, ``prompt_ids`` set; filled in place.
        budgets: per sample, the most tokens it may generate (>= 1).
    """

    def __init__(self, model: torch.nn.Module, samples: list[RolloutSample], budgets: list[int],
                 params: SamplingParams, tokenizer: Tokenizer, kv_cache: KVCacheConfig,
                 on_finished: Optional[OnFinished] = None, overlap_pipeline_stages: bool = False) -> None:
        self.overlap = overlap_pipeline_stages
        self.forward = StageForward(model)
        self.groups = self.forward.groups
        self.samples, self.budgets, self.params = samples, budgets, params
        self.vocab_size = tokenizer.vocab_size
        self.stop = StopCriteria(params, tokenizer)
        self.on_finished = on_finished
        self.device = self.forward.device
        self.keys = torch.tensor([sample_key(params.seed, s.prompt_index, s.sample_index) for s in samples],
                                 dtype=torch.int64, device=self.device)
        self.queue: deque[list[int]] = deque(_groups(samples))
        self.reserve_full_response = kv_cache.reserve_full_response
        self.share_prompt_blocks = kv_cache.share_prompt_blocks
        self.cuda_graphs = kv_cache.cuda_graphs
        # Every step's tokens padded to a multiple of it: TP (SP-split MoE layers), FP8 GEMMs (TE needs 8).
        self.token_multiple = step_token_multiple(self.forward.gpt, self.groups)
        self._admissions = 0
        self.pp_size = self.groups.pp_size
        self.ep_group = self.groups.ep
        self.lanes: list[_Lane] = []
        self.stats = GenerationStats()
        if samples:
            self._build(kv_cache)

    def _build(self, kv_cache: KVCacheConfig) -> None:
        layout = kv_layout(self.forward.gpt, kv_cache.block_size_tokens, self.groups.tp_size)
        check_paged_attention(self.device, layout.dtype, kv_cache.block_size_tokens)
        self.layout = layout
        lengths = [len(s.prompt_ids) + b for s, b in zip(self.samples, self.budgets)]
        self.reserve = [layout.blocks_for(n) for n in lengths]
        # Blocks of each sample at its expected length: what admission keeps free for it to grow into.
        self.expected = [layout.blocks_for(len(s.prompt_ids) + math.ceil(kv_cache.expected_response_fraction * b))
                         for s, b in zip(self.samples, self.budgets)]
        # Blocks a prompt's forks share with it (its full blocks): held once per group, not per sample.
        shared = sum((len(group) - 1) * self._shared_blocks(len(self.samples[group[0]].prompt_ids))
                     for group in self.queue)
        capacity = cache_capacity(kv_cache, layout, self.device, self.groups, needed=sum(self.reserve) - shared,
                                  largest=max(self.reserve), requests=len(self.samples),
                                  expected_blocks=math.ceil((sum(self.expected) - shared) / len(self.expected)))
        usable = capacity.blocks
        lanes = self._lane_count(usable, max(self.reserve))
        # A preempted request is prefilled again from prompt + response: the step must hold the longest.
        longest = max(lengths) if not self.reserve_full_response else max(len(s.prompt_ids) for s in self.samples)
        multiple = self.token_multiple
        for _ in range(lanes):
            share = usable // lanes
            max_requests = min(len(self.samples), share, max(1, capacity.slots // lanes))
            max_tokens = max(_MAX_TOKENS_PER_STEP, longest + max_requests)
            # Both padded to multiples of the TP size (sequence-parallel MoE layers split the step).
            ctx = build_context(self.forward.gpt, layout, self.groups, share, _round_up(max_requests, multiple),
                                _round_up(max_tokens, multiple), max(lengths), kv_cache.cuda_graphs, multiple,
                                share_prompt_blocks=self.share_prompt_blocks)
            self.lanes.append(_Lane(ctx, share))
            self.stats.kv_cache_bytes += cache_bytes(ctx)

    def _shared_blocks(self, prompt_tokens: int) -> int:
        """Blocks each fork of a prompt of ``prompt_tokens`` tokens shares with it (``PagedContext.fork``)."""
        return full_blocks(prompt_tokens, self.layout.block_size_tokens) if self.share_prompt_blocks else 0

    def _lane_count(self, usable: int, largest: int) -> int:
        """One lane per pipeline stage when overlap is asked for and possible: PP > 1, at least two
        requests, and a lane's share of the blocks still holds the largest request. Not with expert
        parallelism, whose lockstep counts forwards of the single lane."""
        lanes = self.pp_size
        if (not self.overlap or lanes == 1 or self.ep_group is not None or len(self.samples) < 2
                or usable // lanes < largest):
            return 1
        return lanes

    def run(self) -> None:
        """Generate until every sample (on every rank of the EP group) is finished."""
        try:
            if len(self.lanes) > 1:
                self._run_pipelined()
            else:
                self._run_lockstep()
        finally:
            if self.cuda_graphs is not None:
                release_cuda_graphs()  # they point into this call's KV buffer

    def _run_lockstep(self) -> None:
        """One lane; with EP, one all-reduce per step decides whether any EP rank has work."""
        lane = self.lanes[0] if self.lanes else None
        while True:
            if lane is not None:
                self._admit(lane)
            has_work = lane is not None and lane.has_work
            if self.queue and not has_work:
                raise RuntimeError("generate: requests wait but none runs (KV reservation bookkeeping is off)")
            any_work = has_work
            if self.ep_group is not None:
                flag = torch.tensor([int(has_work)], dtype=torch.int64, device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ep_group)
                any_work = bool(flag.item())
            if not any_work:
                return
            self.stats.steps += 1
            if has_work:
                order, rows, sources, children, logits = self._forward_lane(lane, async_send=False)
                out = share_step(self._sample(logits, rows, sources), len(rows), self.device, self.groups)
                self._apply(lane, order, rows, children, out)
            else:
                self.stats.dummy_steps += 1
                if self.cuda_graphs is not None:
                    _join_graph_match(self.ep_group)
                self.forward.dummy(self.token_multiple)

    def _run_pipelined(self) -> None:
        """Pipeline stages overlapped: lane after lane, each stage runs its part of a lane's step
        and moves on to the next lane while later stages work on this one.

        With lanes A, B on two stages: stage 0 runs A, sends A's hidden states (non-blocking) and
        runs B while stage 1 runs A; stage 1 samples A and sends the tokens back (non-blocking)
        before taking B; stage 0 applies A's tokens and starts A's next step. Every stage keeps
        the same bookkeeping (admissions in lane order, updates from the same tokens), so all
        agree on which lanes have work, and when to stop.
        """
        pending: list = []
        while True:
            progressed = False
            for lane in self.lanes:
                if lane.awaiting is not None:
                    self._receive_tokens(lane)
                self._admit(lane)
                if not lane.has_work:
                    continue
                if self.queue and not any(x.has_work for x in self.lanes):
                    raise RuntimeError("generate: requests wait but none runs")
                progressed = True
                self.stats.steps += 1
                order, rows, sources, children, logits = self._forward_lane(lane, async_send=True, pending=pending)
                if self.forward.last:
                    out = share_step(self._sample(logits, rows, sources), len(rows), self.device, self.groups,
                                     pipeline=False)
                    pending.extend(self.forward.send_tokens(out))
                    self._apply(lane, order, rows, children, out)
                else:
                    lane.awaiting = (order, rows, children)
            for handle in pending:
                handle.wait()
            pending.clear()
            if not progressed and all(lane.awaiting is None for lane in self.lanes):
                return

    def _receive_tokens(self, lane: _Lane) -> None:
        order, rows, children = lane.awaiting
        lane.awaiting = None
        self._apply(lane, order, rows, children, self.forward.recv_tokens(len(rows)))

    def _admit(self, lane: _Lane) -> None:
        """Add waiting requests while blocks, request slots and the step's token limit allow; FIFO
        (preempted requests wait at the front), so the order of admission is deterministic.

        A waiting group is a prompt's samples (one prefill, then forks) or one preempted sample
        (prefilled again from its prompt + response so far). On demand, each sample admitted needs
        the blocks of its expected length (at least its tokens so far plus the next one), less the
        prompt blocks it shares with the first (counted once), out of the free blocks less those
        promised to the live requests up to their expected lengths; with ``reserve_full_response``,
        the blocks of its whole budget, held until it finishes.
        """
        from megatron.core.inference.inference_request import DynamicInferenceRequest
        from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams

        ctx = lane.ctx
        pending_forks = 0
        # Blocks already promised: the forks of this round's prefills (taken in ``_apply``) and what the
        # live requests still need to reach their expected length.
        promised = 0 if self.reserve_full_response else sum(self._growth(i) for i in lane.admitted)
        while self.queue:
            group = self.queue[0]
            first = group[0]
            sample = self.samples[first]
            tokens = sample.prompt_ids + sample.response_ids
            if ctx.active_token_count + len(tokens) > ctx.max_tokens:
                return
            slots = ctx.max_requests - ctx.total_request_count - pending_forks
            if self.reserve_full_response:
                fits = (lane.usable - lane.reserved) // self.reserve[first]
            else:
                need = max(self.layout.blocks_for(len(tokens) + 1), self.expected[first])
                shared = self._shared_blocks(len(tokens)) if len(group) > 1 else 0
                room = ctx.block_allocator.total_avail - promised
                fits = 0 if room < need else 1 + (room - need) // (need - shared)
            take = min(len(group), slots, fits)
            if take <= 0:  # promised blocks can exceed the free ones (live requests growing): none fits
                return
            admitted, rest = group[:take], group[take:]
            if rest:
                self.queue[0] = rest
            else:
                self.queue.popleft()
            remaining = self.budgets[first] - len(sample.response_ids)
            request = DynamicInferenceRequest(
                request_id=first, prompt_tokens=torch.tensor(tokens, dtype=torch.long, device=self.device),
                sampling_params=MegatronSamplingParams(num_tokens_to_generate=remaining, termination_id=-1))
            ctx.add_request(request)
            if sample.response_ids:
                self.stats.recomputed_tokens += len(sample.response_ids)
            self._admissions += 1
            for i in admitted:
                lane.admitted[i] = self._admissions
            lane.reserved += sum(self.reserve[i] for i in admitted)
            lane.forks[first] = admitted[1:]
            pending_forks += take - 1
            if not self.reserve_full_response:
                forked = self.layout.blocks_for(len(tokens)) - shared  # blocks each fork copies in ``_apply``
                promised += (take - 1) * forked + sum(self._growth(i) for i in admitted)

    def _growth(self, index: int) -> int:
        """Blocks sample ``index`` still needs to reach its expected length (0 once past it)."""
        s = self.samples[index]
        return max(0, self.expected[index] - self.layout.blocks_for(len(s.prompt_ids) + len(s.response_ids) + 1))

    def _forward_lane(self, lane: _Lane, async_send: bool, pending: Optional[list] = None):
        """This stage's forward of one step of ``lane``. Returns the step's request order, the rows
        to sample (a prefilled request once per sample admitted with it), each row's logits row,
        the forks to make ``(logits row, child)`` and the logits (None off the last stage)."""
        ctx = lane.ctx
        self.stats.peak_requests = max(self.stats.peak_requests, ctx.total_request_count)
        ctx.initialize_attention_state()
        input_ids, position_ids = ctx.current_input_and_position_ids()
        logits = self.forward(input_ids, position_ids, ctx, pending=pending if async_send else None)
        order = ctx.active_request_ids()
        rows, sources, children = [], [], []
        for j, rid in enumerate(order):
            rows.append(rid)
            sources.append(j)
            for child in lane.forks.pop(rid, ()):
                rows.append(child)
                sources.append(j)
                children.append((j, child))
        return order, rows, sources, children, logits

    def _apply(self, lane: _Lane, order: list[int], rows: list[int], children: list, out) -> None:
        """Record the step's tokens, fork new samples from their prompt's request, and let the
        context advance (finished requests release their blocks)."""
        ctx = lane.ctx
        for j, child in children:
            ctx.fork(ctx.paused_request_count + j, child)
        # Bookkeeping order after the forks: the step's requests, then the forked children.
        bookkeeping = order + [child for _, child in children]
        finished = self._record(lane, rows, out)
        preempted = set() if self.reserve_full_response else self._preempt(lane, bookkeeping, finished)
        position = {rid: i for i, rid in enumerate(rows)}
        take = torch.tensor([position[rid] for rid in bookkeeping], device=self.device)
        mask = torch.tensor([rid not in finished and rid not in preempted for rid in bookkeeping],
                            dtype=torch.uint8, device=self.device)
        ctx.update_requests(mask, out.tokens[take].clone())
        if ctx.paused_request_count:
            raise RuntimeError(f"{ctx.paused_request_count} requests paused: preemption should have made room")

    def _preempt(self, lane: _Lane, bookkeeping: list[int], finished: set[int]) -> set[int]:
        """Requests to take out of the cache before the context advances: the newest admitted,
        until the free blocks (with those the finished requests release) hold one new block for
        every request whose last block this step filled. Each goes back to the front of the queue
        (the oldest of them first) with its tokens so far. ``bookkeeping``: request ids in the
        context's index order (after the step's forks)."""
        ctx = lane.ctx
        live = [rid for rid in bookkeeping if rid not in finished]
        if not live:
            return set()
        filled = (ctx.request_last_kv_block_offset[:len(bookkeeping)] == ctx.block_size_tokens - 1).tolist()
        full = dict(zip(bookkeeping, filled))
        index = {rid: ctx.paused_request_count + i for i, rid in enumerate(bookkeeping)}

        def free_after(released: list[int]) -> int:  # a shared prompt block frees with its last holder only
            return ctx.block_allocator.total_avail + ctx.blocks_freed_by([index[rid] for rid in released])

        free = free_after(list(finished))
        need = sum(full[rid] for rid in live)
        victims: list[int] = []
        for rid in sorted(live, key=lambda r: (lane.admitted[r], r), reverse=True):
            if need <= free:
                break
            if len(victims) == len(live) - 1:
                raise RuntimeError("generate: the oldest request cannot grow (the budget check should prevent it)")
            victims.append(rid)
            need -= full[rid]
            free = free_after(list(finished) + victims)
        for rid in victims:  # newest first, so the oldest victim ends up first in the queue
            del lane.admitted[rid]
            self.queue.appendleft([rid])
        self.stats.preemptions += len(victims)
        return set(victims)

    def _sample(self, logits: Optional[torch.Tensor], rows: list[int], sources: list[int]):
        """This step's tokens for ``rows`` (the last pipeline stage only; None elsewhere)."""
        if logits is None:
            return None
        step_logits = logits[0, torch.tensor(sources, device=logits.device)]  # [B, V_padded]
        noise = None
        if not self.params.greedy:
            index = torch.tensor(rows, device=self.device)
            positions = torch.tensor([len(self.samples[r].response_ids) for r in rows], device=self.device)
            noise = gumbel_noise(self.keys[index], positions, step_logits.shape[-1])
        return sample(step_logits, self.params, self.vocab_size, None, gumbel=noise)

    def _record(self, lane: _Lane, rows: list[int], out) -> set[int]:
        """Append each row's token; return the rows that finished (their reservations released)."""
        tokens = out.tokens.tolist()
        temp_lp = out.temperature_logprobs.tolist()
        sampled_lp = out.sampled_logprobs.tolist()
        finished = set()
        for i, rid in enumerate(rows):
            s = self.samples[rid]
            s.response_ids.append(tokens[i])
            s.response_logprobs.append(temp_lp[i])
            s.sampled_logprobs.append(sampled_lp[i])
            reason = self.stop.check(s.response_ids, self.budgets[rid])
            if reason is None:
                continue
            s.finish_reason = reason
            finished.add(rid)
            lane.reserved -= self.reserve[rid]
            del lane.admitted[rid]
            if self.on_finished is not None:
                self.on_finished(rid, s)
        return finished


def _join_graph_match(ep_group) -> None:
    """An idle rank's part in the step's graph choice: with CUDA graphs, each working EP rank's
    ``initialize_attention_state`` takes the MAX of the step's token count over the EP group (so that
    every rank pads to the same graph, or all run eagerly); a rank without requests joins that
    all-reduce with an empty step, then runs its eager dummy forward."""
    from megatron.core.inference.batch_dimensions_utils import InferenceBatchDimensions

    InferenceBatchDimensions.adjust_batch_dims_for_expert_parallelism(
        InferenceBatchDimensions(), strict=False, decode_only_cuda_graphs=True, ep_group=ep_group)


def _groups(samples: list[RolloutSample]) -> list[list[int]]:
    """Sample indices per prompt, in prompt order (each group shares one prefill)."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_index, []).append(i)
    return list(groups.values())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
