"""Worker functions of the paged-generator tests (module-level so that ``run_distributed`` can pickle
them): KV budget, shared prefills, ``on_finished``, empty calls, and MoE layouts (EP lockstep, TP+SP).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.rollout import KVCacheConfig, generate
from rollout_workers import GREEDY, PROMPTS, SAMPLED, TOKENIZER, _setup, _summary

# Prompts of 7, 16 and 32 tokens + 12 (greedy) or 10 (sampled) need 2, 2 and 3 blocks of 16 tokens at
# their longest: 5 usable blocks reserve room for two requests at a time, while on demand (1, 2 and 3
# blocks at admission) all three start. Bytes per block: fp32 x (K, V) x 2 layers x 16 tokens x 2 KV
# heads x 16.
BLOCK_BYTES = 4 * 2 * 2 * 16 * 2 * 16
SMALL = KVCacheConfig(kv_cache_bytes=6 * BLOCK_BYTES, block_size_tokens=16)  # 5 usable + the dummy
# Worst-case reservation at the same budget (the pre-on-demand behaviour: never a preemption).
RESERVED = replace(SMALL, reserve_full_response=True)
# Exactly the longest request at its longest: every other request is preempted whenever it grows.
TINY = KVCacheConfig(kv_cache_bytes=4 * BLOCK_BYTES, block_size_tokens=16)  # 3 usable + the dummy

MOE = replace(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          vocab_size=TOKENIZER.vocab_size, ffn_hidden_size=64, max_position_embeddings=96),
              moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, token_dispatcher_type="alltoall"))
# By data-parallel rank in the EP=2 x DP=2 test: rank 1's single response ends after 3 tokens.
EP_PROMPTS = {0: PROMPTS[:2], 1: PROMPTS[2:]}
EP_PARAMS = {0: replace(GREEDY, max_new_tokens=10), 1: replace(GREEDY, max_new_tokens=3)}


def budget_worker(weights_dir: str) -> dict:
    """Single process: small KV budget, shared prefills, on_finished, empty and never-fitting calls."""
    from megatron_cascade.rollout import paged_context

    model = _setup(ParallelConfig(), weights_dir, save=True)
    out = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        full = generate(model, PROMPTS, params, tokenizer=TOKENIZER)
        out[name], out[f"{name}_stats"] = _summary(full), vars(full.stats)
        out[f"{name}_nocache"] = _summary(generate(model, PROMPTS, params, tokenizer=TOKENIZER, use_kv_cache=False))
        for budget, kv_cache in (("small", SMALL), ("reserved", RESERVED), ("tiny", TINY)):
            with mock.patch.object(paged_context.PagedContext, "fork", autospec=True,
                                   side_effect=paged_context.PagedContext.fork) as fork:
                small = generate(model, PROMPTS, params, tokenizer=TOKENIZER, kv_cache=kv_cache)
            out[f"{name}_{budget}"] = _summary(small)
            out[f"{name}_{budget}_stats"] = vars(small.stats)
            out[f"{name}_{budget}_forks"] = fork.call_count
    out["fed_tokens"], out["fed_expected"] = _tokens_fed(model)
    out["callbacks"] = _callback_timing(model)
    empty = generate(model, [], SAMPLED, tokenizer=TOKENIZER)
    out["empty"] = (len(empty), empty.stats.steps)
    try:
        generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER,
                 kv_cache=KVCacheConfig(kv_cache_bytes=3 * BLOCK_BYTES, block_size_tokens=16))
        out["never_fits"] = None
    except ValueError as err:
        out["never_fits"] = str(err)
    out["without_flash_attn"] = _without_flash_attn(model)
    return out


def _without_flash_attn(model) -> str:
    """What a GPU without flash-attn gets: the paged kernels missing (as before CPU mode's stand-ins)."""
    from megatron.core.transformer import attention

    with mock.patch.object(attention, "flash_attn_varlen_func", None):
        try:
            generate(model, PROMPTS[:1], GREEDY, tokenizer=TOKENIZER)
        except Exception as err:  # noqa: BLE001 - the test inspects what was raised
            return f"{type(err).__name__}: {err}"
    return "no error"


def _tokens_fed(model) -> tuple[int, int]:
    """Tokens through the embedding for SAMPLED (n=3): each prompt once, then one token per decode
    step of each sample (its last token is never fed back)."""
    fed = []
    hook = model.embedding.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(kwargs["input_ids"].numel()),
                                                     with_kwargs=True)
    try:
        batch = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER)
    finally:
        hook.remove()
    expected = sum(len(p) for p in PROMPTS) + sum(len(s.response_ids) - 1 for s in batch)
    return sum(fed), expected


def _callback_timing(model) -> dict:
    """Which forward each on_finished call came after: the longest prompt gets 3 tokens under the
    sequence limit, the others 12, so its sample must be handed over after forward 3 of 12."""
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    calls = []
    try:
        batch = generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, max_sequence_length=len(PROMPTS[-1]) + 3,
                         on_finished=lambda i, s: calls.append((i, len(forwards), len(s.response_ids))))
    finally:
        hook.remove()
    return {"calls": calls, "forwards": len(forwards), "same_objects": [len(s.response_ids) for s in batch]}


def moe_worker(parallel: ParallelConfig, weights_dir: str, init: bool, cuda_graphs=None) -> dict:
    """MoE greedy generation: one process runs both ranks' prompt sets; with DP=2 each rank its own
    (rank 1's ends early), then rank 1 with no prompts at all while rank 0 generates. ``cuda_graphs``:
    decode steps padded to graph sizes (``padded_steps`` counts those that were)."""
    from megatron.core import parallel_state as ps

    from megatron_cascade.testing.checkpoints import model_with_shared_weights

    model = model_with_shared_weights(MOE, parallel, weights_dir, init, seed=3)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [rank] if dp > 1 else [0, 1]
    before = _sequence_parallel_state(model)
    out = {}
    kv_cache = KVCacheConfig(cuda_graphs=cuda_graphs)
    with _counting_padded_steps() as padded:
        for r in mine:
            batch = generate(model, EP_PROMPTS[r], EP_PARAMS[r], tokenizer=TOKENIZER, kv_cache=kv_cache)
            out[r] = {"tokens": [s.response_ids for s in batch], "steps": batch.stats.steps,
                      "dummy": batch.stats.dummy_steps}
        if dp > 1:
            prompts = EP_PROMPTS[0] if rank == 0 else []
            batch = generate(model, prompts, EP_PARAMS[0], tokenizer=TOKENIZER, kv_cache=kv_cache)
            out["alone"] = {"tokens": [s.response_ids for s in batch], "steps": batch.stats.steps,
                            "dummy": batch.stats.dummy_steps}
    out["padded_steps"] = padded
    out["sequence_parallel_restored"] = model.config.sequence_parallel == parallel.sequence_parallel
    out["sequence_parallel_state"] = (before, _sequence_parallel_state(model))
    return out


@contextlib.contextmanager
def _counting_padded_steps():
    """Yields a list that collects, per step run on a graph size, (real tokens, padded tokens)."""
    from megatron_cascade.rollout.paged_context import PagedContext

    padded = []
    original = PagedContext.initialize_attention_state

    def counting(ctx, *args, **kwargs):
        original(ctx, *args, **kwargs)
        if ctx.using_cuda_graph_this_step():
            padded.append((ctx.active_token_count, ctx.padded_active_token_count))

    with mock.patch.object(PagedContext, "initialize_attention_state", counting):
        yield padded


def graph_padding_worker(weights_dir: str) -> dict:
    """The long-tailed workload (requests finishing at many different steps) with decode steps padded
    to 4 graph sizes, under an unlimited budget and a tight one (preemptions), vs eager steps."""
    model = _setup(ParallelConfig(), weights_dir, save=False)
    prompts, params = _long_tail_workload()
    eager = generate(model, prompts, params, tokenizer=TOKENIZER)
    out = {"eager": _summary(eager)}
    budget = KVCacheConfig(kv_cache_bytes=12 * BLOCK_BYTES, block_size_tokens=16)
    for name, kv_cache in (("graphs", KVCacheConfig(cuda_graphs=4)), ("graphs_tight", replace(budget, cuda_graphs=4)),
                           ("tight", budget)):
        with _counting_padded_steps() as padded:
            batch = generate(model, prompts, params, tokenizer=TOKENIZER, kv_cache=kv_cache)
        out[name], out[f"{name}_padded"], out[f"{name}_stats"] = _summary(batch), padded, vars(batch.stats)
    with fp8_token_multiple(model) as fed:
        batch = generate(model, prompts, params, tokenizer=TOKENIZER, kv_cache=budget)
    out["fp8"], out["fp8_fed"], out["fp8_stats"] = _summary(batch), fed, vars(batch.stats)
    return out


@contextlib.contextmanager
def fp8_token_multiple(model):
    """The step padding of an FP8 model (which CPU mode cannot build: FP8 needs TE): the engine's token
    multiple 8, as ``step_token_multiple`` gives with ``config.fp8`` set. Yields the token count of
    every forward through the embedding."""
    from megatron_cascade.rollout import engine
    from megatron_cascade.rollout.paged_context import FP8_TOKEN_MULTIPLE

    fed = []
    hook = model.embedding.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(kwargs["input_ids"].numel()),
                                                     with_kwargs=True)
    try:
        with mock.patch.object(engine, "step_token_multiple", return_value=FP8_TOKEN_MULTIPLE):
            yield fed
    finally:
        hook.remove()


def _long_tail_workload():
    """8 prompts of 5-29 tokens x 3 samples, stopping at four frequent tokens (some run to the cap of 48)."""
    import torch

    from megatron_cascade.rollout import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TOKENIZER.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 30, (8,), generator=gen)]
    params = SamplingParams(temperature=1.0, max_new_tokens=48, n=3, seed=3, stop_token_ids=(17, 42, 50, 61),
                            ignore_eos=True)
    return prompts, params


def _sequence_parallel_state(model) -> list:
    """Every module's sequence-parallel flags (generation turns them off, then must restore them)."""
    attrs = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
    return [(name, attr, getattr(module, attr)) for name, module in model.named_modules() for attr in attrs
            if hasattr(module, attr)] + [("config", "sequence_parallel", model.config.sequence_parallel)]


def long_tail_worker(weights_dir: str, block_tokens: int, fraction_of_need: float) -> dict:
    """Long-tailed responses (two frequent stop tokens; some run to the cap) under a budget of a
    fraction of what all requests need at their longest, on demand and reserved, vs an unlimited one."""
    from megatron_cascade.rollout.kv_budget import kv_layout

    model = _setup(ParallelConfig(), weights_dir, save=False)
    prompts, params = _long_tail_workload()
    layout = kv_layout(model, block_tokens, tp=1)
    need = sum(layout.blocks_for(len(p) + params.max_new_tokens) for p in prompts) * params.n * layout.block_bytes
    budget = int(need * fraction_of_need) + layout.block_bytes
    out = {"full": [s.response_ids for s in generate(model, prompts, params, tokenizer=TOKENIZER)]}
    for name, reserve in (("demand", False), ("reserved", True)):
        batch = generate(model, prompts, params, tokenizer=TOKENIZER,
                         kv_cache=KVCacheConfig(kv_cache_bytes=budget, block_size_tokens=block_tokens,
                                                reserve_full_response=reserve))
        out[name] = [s.response_ids for s in batch]
        out[f"{name}_stats"] = vars(batch.stats)
    return out


def shared_prompt_worker(weights_dir: str, save: bool = False) -> dict:
    """Long prompts x 4 samples under a budget of about two copied samples: prompt blocks shared
    (the default) vs copied per sample, against an unlimited budget; every context's blocks counted
    back when its call ends."""
    import torch

    from megatron_cascade.rollout import SamplingParams, engine
    from megatron_cascade.rollout.kv_budget import kv_layout

    model = _setup(ParallelConfig(), weights_dir, save=save)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TOKENIZER.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(40, 64, (4,), generator=gen)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=5, stop_token_ids=(17, 42, 50),
                            ignore_eos=True)
    layout = kv_layout(model, 8, tp=1)
    out = {"full": [s.response_ids for s in generate(model, prompts, params, tokenizer=TOKENIZER)],
           "prompt_lengths": [len(p) for p in prompts]}
    for name, share in (("shared", True), ("copied", False)):
        contexts = []

        def recording(*args, **kwargs):
            contexts.append(build(*args, **kwargs))
            return contexts[-1]

        build = engine.build_context
        with mock.patch.object(engine, "build_context", side_effect=recording):
            batch = generate(model, prompts, params, tokenizer=TOKENIZER,
                             kv_cache=KVCacheConfig(kv_cache_bytes=24 * layout.block_bytes, block_size_tokens=8,
                                                    share_prompt_blocks=share))
        out[name] = [s.response_ids for s in batch]
        out[f"{name}_stats"] = vars(batch.stats)
        allocators = [ctx.block_allocator for ctx in contexts]
        out[f"{name}_returned"] = [(a.total_avail, a.total_count - 1, int(a.holders.sum())) for a in allocators]
    return out
