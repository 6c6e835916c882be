"""``generate``: sampling from the Megatron-Core model being trained, on a paged KV cache."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from megatron_cascade.rollout.batch import RolloutBatch, RolloutSample
from megatron_cascade.rollout.engine import PagedGenerator
from megatron_cascade.rollout.kv_budget import static_batch_rows
from megatron_cascade.rollout.model_runner import unwrap_model
from megatron_cascade.rollout.params import KVCacheConfig, SamplingParams
from megatron_cascade.rollout.stage_forward import sequence_parallel_off
from megatron_cascade.rollout.static import MAX_PREFILL_TOKENS, generate_static
from megatron_cascade.cpu_runtime import device_rewrite_paused
from megatron_cascade.tokenizers.base import Tokenizer


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    tokenizer: Tokenizer,
    max_sequence_length: Optional[int] = None,
    use_kv_cache: bool = True,
    kv_cache: Optional[KVCacheConfig] = None,
    on_finished: Optional[Callable[[int, RolloutSample], None]] = None,
    overlap_pipeline_stages: bool = False,
    static_batches: bool = False,
) -> RolloutBatch:
    """Sample ``params.n`` responses for each prompt; collective over the model-parallel group
    (and over the expert-parallel group: see below).

    Every TP and PP rank of a model replica must call it with the same arguments; all of them
    return the same ``RolloutBatch``. The model runs in eval mode under ``torch.no_grad()`` with
    sequence parallelism off, and is put back as it was afterwards.

    Args:
        model: this rank's ``GPTModel`` (optionally inside DDP / Float16Module); not a list of
            virtual-pipeline chunks.
        prompts: token ids per prompt (lengths may differ); may be empty (an empty batch returns,
            after taking part in the expert-parallel lockstep).
        params: sampling parameters.
        tokenizer: its ``vocab_size`` bounds the ids that can be sampled (the model's padded
            vocabulary rows beyond it never are), its ``eos_id`` stops responses unless
            ``params.ignore_eos``, and ``decode`` serves ``params.stop_strings``; its ``pad_id``
            fills the static path's padding.
        max_sequence_length: prompt + response limit in tokens; default the model's
            ``max_sequence_length`` (``model.max_position_embeddings``).
        use_kv_cache: True: continuous batching over Megatron's paged KV cache (``engine.py``; a
            hybrid (Mamba) model's requests also hold a slot of conv and SSM states each). False:
            the static batch recomputing the whole prefix every token (the reference).
        kv_cache: the paged cache's memory budget and block size (default ``KVCacheConfig()``:
            half the free memory); blocks are taken on demand, requests that do not fit wait (or
            are preempted and recomputed), one that never can is refused.
        on_finished: called as ``on_finished(sample_index, sample)`` on every rank the moment a
            sample finishes, while the others decode on (``sample_index`` indexes the returned
            batch); e.g. to start scoring it.
        overlap_pipeline_stages: with PP > 1 (and EP = 1), split the requests into one KV lane per
            stage so that stages work on different lanes at once instead of waiting for each other
            (``engine._run_pipelined``). Same tokens either way. Off by default: on the shared
            2-core CPU machine it was slower (twice the steps of half the rows, no spare core to
            overlap on); meant for GPUs, where each stage has its own device, to be measured there.
        static_batches: with ``use_kv_cache``, static batches over Megatron's static context
            instead of the paged engine (``static.py``; every row of a batch decodes until its longest
            finishes; the Mamba states cached alongside): as many rows per batch as ``kv_cache``'s
            budget holds at the longest row and a prefill of at most ``MAX_PREFILL_TOKENS`` prompt
            tokens allows. The reference the paged engine is tested against, and the benchmarks'
            baseline.

    Sampling noise is a hash of (``params.seed``, prompt index, sample index, position), so a
    response does not depend on the batch it ran in, the KV budget or the TP/PP layout (up to the
    float rounding of the logits: the tests check TP=2, PP=2 and TP=2+SP against one process).
    Data-parallel replicas are independent: each calls ``generate`` on its own prompts (give them
    different seeds), except that with expert parallelism the ranks of an EP group step together.

    Returns:
        ``RolloutBatch`` with ``len(prompts) * params.n`` samples, prompt-major.
    """
    gpt = _check_model(model)
    if use_kv_cache and static_batches and overlap_pipeline_stages:
        raise ValueError("overlap_pipeline_stages splits the paged engine's requests over KV lanes; "
                         "static_batches has no lanes")
    limit = max_sequence_length or gpt.max_sequence_length
    samples = [RolloutSample(prompt_index=p, sample_index=k, prompt_ids=list(prompt))
               for p, prompt in enumerate(prompts) for k in range(params.n)]
    budgets = _budgets(samples, params.max_new_tokens, limit)
    stats = None
    if getattr(gpt.config, "fp8", None) is not None:
        gpt.set_is_first_microbatch()  # TE recasts the FP8 weights (else: the cast of before the last update)
    with _eval_mode(model), torch.no_grad(), sequence_parallel_off(model):
        if use_kv_cache and static_batches:
            rows = _static_rows(gpt, samples, budgets, kv_cache or KVCacheConfig())
            generate_static(model, samples, params, tokenizer=tokenizer, limit=limit, use_kv_cache=True,
                            on_finished=on_finished, max_rows=rows)
        elif use_kv_cache:
            engine = PagedGenerator(model, samples, budgets, params, tokenizer, kv_cache or KVCacheConfig(),
                                    on_finished, overlap_pipeline_stages)
            # The model and KV cache exist: decoding creates no CUDA-device tensors, so CPU mode's
            # per-op device rewriting (a third of a small model's decode time) can step aside.
            with device_rewrite_paused():
                engine.run()
            stats = engine.stats
        else:  # also with no samples: the expert-parallel lockstep needs every rank
            generate_static(model, samples, params, tokenizer=tokenizer, limit=limit, use_kv_cache=False,
                            on_finished=on_finished)
    return RolloutBatch(samples, params, stats)


def _static_rows(gpt: torch.nn.Module, samples: list[RolloutSample], budgets: list[int],
                 kv_cache: KVCacheConfig) -> Optional[int]:
    """Rows per static batch: what ``kv_cache``'s budget holds (a row at its longest: the longest
    prompt + the largest response budget), at most ``MAX_PREFILL_TOKENS`` prompt tokens per prefill
    (at least one row); None without samples."""
    if not samples:
        return None
    width = max(len(s.prompt_ids) for s in samples)
    rows = static_batch_rows(gpt, kv_cache, next(gpt.parameters()).device, width + max(budgets))
    return min(rows, max(1, MAX_PREFILL_TOKENS // width))


def _budgets(samples: list[RolloutSample], max_new_tokens: int, limit: int) -> list[int]:
    """Per sample ``min(max_new_tokens, limit - len(prompt))``; raises if a prompt is empty or
    leaves no room under ``limit``."""
    if any(not s.prompt_ids for s in samples):
        raise ValueError("every prompt must have at least one token")
    budgets = [min(max_new_tokens, limit - len(s.prompt_ids)) for s in samples]
    if budgets and min(budgets) < 1:
        longest = max(len(s.prompt_ids) for s in samples)
        raise ValueError(f"a prompt has {longest} tokens, leaving no room to generate under "
                         f"max_sequence_length={limit}")
    return budgets


def _check_model(model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        raise ValueError("generate() takes one model chunk; virtual pipeline parallelism is not supported")
    gpt = unwrap_model(model)
    if getattr(gpt.config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("generate() does not support virtual pipeline parallelism "
                         "(parallel.virtual_pipeline_model_parallel_size)")
    if getattr(gpt.config, "context_parallel_size", 1) > 1:
        raise ValueError("generate() does not support parallel.context_parallel_size > 1 "
                         "(decode steps have one token per request)")
    return gpt


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout; Megatron only uses the inference context when not training)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
