"""``generate``: batched sampling from the Megatron-Core model being trained."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from megatron_cascade.rollout.batch import RolloutBatch, RolloutSample
from megatron_cascade.rollout.comm import share_step
from megatron_cascade.rollout.layout import PaddedBatch, left_pad
from megatron_cascade.rollout.model_runner import StepRunner, accepts_padding_mask, unwrap_model
from megatron_cascade.rollout.params import SamplingParams
from megatron_cascade.rollout.sampling import SampleOutput, sample
from megatron_cascade.rollout.stopping import StopCriteria
from megatron_cascade.tokenizers.base import Tokenizer


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    tokenizer: Tokenizer,
    max_sequence_length: Optional[int] = None,
    use_kv_cache: bool = True,
) -> RolloutBatch:
    """Sample ``params.n`` responses for each prompt; collective over the model-parallel group.

    Every TP and PP rank of a model replica must call it with the same arguments; all of them
    return the same ``RolloutBatch``. The model runs in eval mode under ``torch.no_grad()`` and is
    put back into its previous mode afterwards.

    Args:
        model: this rank's ``GPTModel`` (optionally inside DDP / Float16Module); not a list of
            virtual-pipeline chunks.
        prompts: token ids per prompt (lengths may differ).
        params: sampling parameters.
        tokenizer: its ``vocab_size`` bounds the ids that can be sampled (the model's padded
            vocabulary rows beyond it never are), its ``eos_id`` stops responses unless
            ``params.ignore_eos``, and ``decode`` serves ``params.stop_strings``; its ``pad_id``
            fills the padding.
        max_sequence_length: prompt + response limit in tokens; default the model's
            ``max_sequence_length`` (``model.max_position_embeddings``).
        use_kv_cache: True: Megatron's static KV cache; False: recompute the prefix every token.

    Prompts of different lengths are left-padded into one batch (see ``layout.py``); with attention
    that cannot take a padding mask (Transformer Engine) they are batched by prompt length instead.
    One generator seeded with ``params.seed`` drives all batches, so the result is reproducible for
    the same prompts, params and model; across TP/PP layouts it agrees up to the float rounding of
    the logits (the tests check TP=2 and PP=2 against one process). Data-parallel replicas are
    independent: each calls ``generate`` on its own prompts (give them different seeds).

    Returns:
        ``RolloutBatch`` with ``len(prompts) * params.n`` samples, prompt-major.
    """
    gpt = _check_model(model)
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    rows = [list(p) for p in prompts for _ in range(params.n)]
    limit = max_sequence_length or gpt.max_sequence_length
    device = next(gpt.parameters()).device
    samples = [RolloutSample(prompt_index=i // params.n, sample_index=i % params.n, prompt_ids=row)
               for i, row in enumerate(rows)]
    stop = StopCriteria(params, tokenizer)
    generator = torch.Generator(device=device).manual_seed(params.seed)
    with _eval_mode(model), torch.no_grad():
        for group in _batches(rows, accepts_padding_mask(model)):
            batch = left_pad([rows[i] for i in group], tokenizer.pad_id, params.max_new_tokens, limit, device)
            runner = StepRunner(model, batch, use_kv_cache)
            _decode_loop(runner, batch, [samples[i] for i in group], params, stop, generator,
                         tokenizer.vocab_size)
    return RolloutBatch(samples, params)


def _batches(rows: list[list[int]], padding_ok: bool) -> list[list[int]]:
    """Row indices per forward batch: all rows at once (left-padded), or one batch per prompt
    length where the attention cannot mask padding (no padding is then needed)."""
    if padding_ok:
        return [list(range(len(rows)))]
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(i)
    return list(by_length.values())


def _decode_loop(runner: StepRunner, batch: PaddedBatch, samples: list[RolloutSample], params: SamplingParams,
                 stop: StopCriteria, generator: torch.Generator, vocab_size: int) -> None:
    """Sample column after column until every row is finished; fills ``samples`` (one per row)."""
    active = set(range(batch.batch_size))
    for column in range(batch.prompt_width, batch.max_length):
        logits = runner.step(column)
        local = sample(logits, params, vocab_size, generator) if logits is not None else None
        out = share_step(local, batch.batch_size, batch.tokens.device)
        batch.append(column, out.tokens)
        # Finished rows keep being fed their sampled tokens (the batch shape is static); their
        # results are no longer recorded and the padding mask does not matter for them.
        active -= _record(out, samples, active, stop, batch.budgets)
        if not active:
            return


def _record(out: SampleOutput, samples: list[RolloutSample], active: set[int], stop: StopCriteria,
            budgets: list[int]) -> set[int]:
    """Append this step's token to each active sample; return the rows that just finished."""
    tokens = out.tokens.tolist()
    temp_lp = out.temperature_logprobs.tolist()
    sampled_lp = out.sampled_logprobs.tolist()
    finished = set()
    for row in active:
        s = samples[row]
        s.response_ids.append(tokens[row])
        s.response_logprobs.append(temp_lp[row])
        s.sampled_logprobs.append(sampled_lp[row])
        reason = stop.check(s.response_ids, budgets[row])
        if reason is not None:
            s.finish_reason = reason
            finished.add(row)
    return finished


def _check_model(model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        raise ValueError("generate() takes one model chunk; virtual pipeline parallelism is not supported")
    gpt = unwrap_model(model)
    if getattr(gpt.config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("generate() does not support virtual pipeline parallelism "
                         "(parallel.virtual_pipeline_model_parallel_size)")
    if getattr(gpt.config, "sequence_parallel", False) or getattr(gpt.config, "context_parallel_size", 1) > 1:
        raise ValueError("generate() does not support parallel.sequence_parallel or "
                         "parallel.context_parallel_size > 1 (decode steps have one token per row)")
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
