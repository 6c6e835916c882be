"""Tokens/s, concurrency and memory of ``generate``'s paged engine against its baselines, each pair
in one run on the same workload, like for like (the same counter-based sampling noise, so every
generator produces the same responses: checked and printed).

* ``--model gpt`` (default): a random 4-layer x 256 GPT. Rows: the static-batch generator
  (Megatron's ``StaticInferenceContext``, every row decoding until the longest finishes), the paged
  engine with all the memory it wants, and under a KV budget of a quarter of what every request
  needs at its longest: the static batches (as many rows as the budget holds at their longest: the
  recipe's condition, where the static context ran 1 of 256 samples per 8 GPUs), and the paged
  engine twice: blocks taken on demand (preempting when the pool runs out) vs reserved for the whole
  response budget at admission (the engine before KV on demand).
* ``--model hybrid``: the same for a random hybrid Mamba-2 / attention / MLP model (``M*M-``): the
  static context was its only KV-cached path before it joined the paged engine.
* Under the same budget, a prompt's samples sharing its full KV blocks (the default) vs a copy of the
  prompt's blocks per sample (the engine before): it matters with long prompts
  (``--prompt-tokens 200 250``; the recipe's prompts run to 32K tokens next to 16 samples each).

Workload (defaults): 16 prompts of 20-60 tokens x 4 samples = 64 requests, temperature 1, up to 256
new tokens; two stop tokens end a response early, so lengths are long-tailed, from a few tokens to
the 256 cap (the table prints them).

Timing: the generators in one process, alternated, best of ``--repeats``. Memory: each in a fresh
process, peak RSS above the RSS after a warm-up call, plus the cache bytes each allocated.

Usage: ``python benchmarks/generation.py [--model gpt|hybrid] [--prompts 16 --samples 4 --max-new-tokens 256]
[--prompt-tokens 20 60]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from dataclasses import dataclass, replace

import psutil
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import HybridConfig
from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer

TOKENIZER = CharTokenizer()
MODELS = {
    "gpt": ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=TOKENIZER.vocab_size,
                       ffn_hidden_size=1024, max_position_embeddings=512, init_method_std=0.05),
    "hybrid": ModelConfig(architecture="hybrid", num_layers=4, hidden_size=256, num_attention_heads=4,
                          num_query_groups=2, vocab_size=TOKENIZER.vocab_size, ffn_hidden_size=1024,
                          max_position_embeddings=512, init_method_std=0.05, position_embedding_type="none",
                          activation="squared_relu",
                          hybrid=HybridConfig(layer_pattern="M*M-", mamba_head_dim=32, mamba_num_groups=2,
                                              mamba_state_dim=32, mamba_chunk_size=64)),
}
STOP_IDS = (17, 42)
BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    prompts: int
    samples: int
    max_new_tokens: int
    seed: int = 0
    prompt_tokens: tuple[int, int] = (20, 60)  # prompt lengths, uniform in [lo, hi]

    def prompt_ids(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.prompt_tokens[0], self.prompt_tokens[1] + 1, (self.prompts,), generator=gen).tolist()
        return [torch.randint(3, TOKENIZER.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, n=self.samples, seed=self.seed,
                              stop_token_ids=STOP_IDS, ignore_eos=True)


def _build(model_cfg: ModelConfig, threads: int):
    from megatron_cascade.model import build_model, initialize_model_parallel

    # One thread by default: on a shared 2-core machine two threads contend (a 16 x 256 x 1024
    # matmul took 4.5 ms with 2 threads under load vs 0.12 ms with 1).
    torch.set_num_threads(threads)
    initialize_model_parallel(ParallelConfig(), seed=1234)
    return build_model(model_cfg, ParallelConfig())


def _run(name: str, model, work: Workload, kv: KVCacheConfig):
    """One generator on the workload: ``static`` (static batches, as many rows as ``kv`` holds) or a
    paged run under ``kv``."""
    batch = generate(model, work.prompt_ids(), work.params(), tokenizer=TOKENIZER, kv_cache=kv,
                     static_batches=name.startswith("static"))
    return [s.response_ids for s in batch], batch.stats


def _static_batches(model, work: Workload, kv: KVCacheConfig) -> list[list[int]]:
    """The static generator's batches (request indices, prompt-major) under ``kv``."""
    from megatron_cascade.rollout.generate import _static_rows
    from megatron_cascade.rollout.batch import RolloutSample
    from megatron_cascade.rollout.model_runner import accepts_padding_mask
    from megatron_cascade.rollout.static import _batches

    rows = [p for p in work.prompt_ids() for _ in range(work.samples)]
    samples = [RolloutSample(prompt_index=0, sample_index=0, prompt_ids=r) for r in rows]
    max_rows = _static_rows(model, samples, [work.max_new_tokens] * len(rows), kv)
    return _batches(rows, accepts_padding_mask(model), max_rows)


def _cache_bytes(model, work: Workload, name: str, stats, kv: KVCacheConfig) -> int:
    """Bytes the generator's cache held: the paged context's (its stats), or the largest static
    batch's K/V of every row at the batch's width plus the Mamba states (``static_row_bytes``)."""
    from megatron_cascade.rollout.kv_budget import static_row_bytes

    if stats is not None:
        return stats.kv_cache_bytes
    prompts = work.prompt_ids()
    width = max(len(p) for p in prompts) + work.max_new_tokens
    return static_row_bytes(model, width) * max(len(b) for b in _static_batches(model, work, kv))


def timing_worker(model_cfg: ModelConfig, work: Workload, repeats: int, budget: int, threads: int,
                  expected_fraction: float) -> dict:
    """Every generator in this process, alternated; best and median seconds, tokens, stats."""
    model = _build(model_cfg, threads)
    roomy = KVCacheConfig(block_size_tokens=BLOCK_TOKENS, kv_cache_bytes=2**31)
    capped = KVCacheConfig(kv_cache_bytes=budget, block_size_tokens=BLOCK_TOKENS)
    kinds = {"static": roomy, "paged": roomy, "static_capped": capped, "on_demand": capped,
             "on_demand_tuned": replace(capped, expected_response_fraction=expected_fraction),
             "copied_prompts": replace(capped, share_prompt_blocks=False),
             "reserved": replace(capped, reserve_full_response=True)}
    for name, kv in kinds.items():
        _run(name, model, replace(work, prompts=2, max_new_tokens=8), kv)  # warm-up
    times = {k: [] for k in kinds}
    results = {}
    for _ in range(repeats):
        for name, kv in kinds.items():
            start = time.perf_counter()
            tokens, stats = _run(name, model, work, kv)
            times[name].append(time.perf_counter() - start)
            if stats is None:
                batches = _static_batches(model, work, kv)
                steps = sum(max(len(tokens[i]) for i in batch) for batch in batches)  # each to its longest
                at_once = max(len(batch) for batch in batches)
            else:
                steps, at_once = stats.steps, stats.peak_requests
            results[name] = (tokens, stats, _cache_bytes(model, work, name, stats, kv), steps, at_once)
    return {name: {"seconds": min(t), "median": statistics.median(t), "tokens": results[name][0],
                   "stats": vars(results[name][1]) if results[name][1] else None, "cache_bytes": results[name][2],
                   "steps": results[name][3], "at_once": results[name][4]}
            for name, t in times.items()}


def memory_worker(model_cfg: ModelConfig, name: str, work: Workload, threads: int) -> int:
    """Peak RSS above the RSS after a warm-up call, for one generator (fresh process)."""
    model = _build(model_cfg, threads)
    roomy = KVCacheConfig(block_size_tokens=BLOCK_TOKENS, kv_cache_bytes=2**31)
    _run(name, model, replace(work, prompts=2, max_new_tokens=8), roomy)
    baseline = psutil.Process().memory_info().rss
    _run(name, model, work, roomy)
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline)


def _need_bytes(model_cfg: ModelConfig, work: Workload) -> int:
    """What every request needs at its longest: its KV blocks (and Mamba state) on one process."""
    layout = run_distributed(_layout_worker, 1, model_cfg)[0]
    blocks = sum(-(-(len(p) + work.max_new_tokens) // BLOCK_TOKENS) for p in work.prompt_ids()) * work.samples
    return blocks * layout[0] + work.prompts * work.samples * layout[1]


def _layout_worker(model_cfg: ModelConfig) -> tuple[int, int]:
    from megatron_cascade.rollout.kv_budget import kv_layout

    layout = kv_layout(_build(model_cfg, 1), BLOCK_TOKENS, tp=1)
    return layout.block_bytes, layout.state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(20, 60), metavar=("LO", "HI"),
                        help="prompt lengths, uniform in [LO, HI] (prompt + max_new_tokens <= 512)")
    parser.add_argument("--expected-response-fraction", type=float, default=0.25,
                        help="rollout.expected_response_fraction of the tuned on-demand row: the workload's mean "
                             "response length over its cap (response/length_mean over max_new_tokens in a run's "
                             "metrics); the other rows use the default 0.5")
    args = parser.parse_args()
    model_cfg = MODELS[args.model]
    work = Workload(args.prompts, args.samples, args.max_new_tokens, prompt_tokens=tuple(args.prompt_tokens))
    budget = _need_bytes(model_cfg, work) // 4
    res = run_distributed(timing_worker, 1, model_cfg, work, args.repeats, budget, args.threads,
                          args.expected_response_fraction, timeout_s=3600)[0]
    mem = {name: run_distributed(memory_worker, 1, model_cfg, name, work, args.threads, timeout_s=3600)[0]
           for name in ("static", "paged")}

    lengths = sorted(len(t) for t in res["paged"]["tokens"])
    generated = sum(lengths)
    same = all(res[k]["tokens"] == res["static"]["tokens"] for k in res)
    print(f"model {args.model} ({model_cfg.num_layers} layers x {model_cfg.hidden_size}, fp32), threads={args.threads}; "
          f"{work.prompts} prompts x {work.samples} samples = {len(lengths)} requests; response lengths min "
          f"{lengths[0]} / median {lengths[len(lengths) // 2]} / mean {generated / len(lengths):.0f} / max "
          f"{lengths[-1]} ({generated} tokens); identical responses in every row: {same}")
    print(f"{'generator':<36}{'seconds':>9}{'tokens/s':>10}{'vs static':>10}{'cache MiB':>10}{'peak RSS MiB':>14}"
          f"{'steps':>7}{'at once':>9}{'preempted':>11}")
    base = res["static"]["seconds"]
    rows = [("static batches (before)", "static", mem["static"]), ("paged, all memory", "paged", mem["paged"]),
            (f"static batches, {budget / 2**20:.2f} MiB", "static_capped", None),
            (f"paged, {budget / 2**20:.2f} MiB, KV on demand", "on_demand", None),
            (f"  ... expected fraction {args.expected_response_fraction:g}", "on_demand_tuned", None),
            ("  ... prompt blocks copied per sample", "copied_prompts", None),
            (f"paged, {budget / 2**20:.2f} MiB, reserved", "reserved", None)]
    for label, key, rss in rows:
        r = res[key]
        stats = r["stats"] or {}
        steps = r["steps"]
        rss_text = f"{rss / 2**20:>14.0f}" if rss is not None else f"{'-':>14}"
        print(f"{label:<36}{r['seconds']:>9.2f}{generated / r['seconds']:>10.0f}{base / r['seconds']:>10.2f}"
              f"{r['cache_bytes'] / 2**20:>10.2f}{rss_text}{steps:>7}{r['at_once']:>9}"
              f"{stats.get('preemptions', 0):>11}")
    reserved = res["reserved"]
    print(f"observed mean response / cap: {generated / len(lengths) / work.max_new_tokens:.2f}")
    for key in ("on_demand", "on_demand_tuned"):
        demand = res[key]
        print(f"at a fixed budget of {budget} bytes, KV on demand ({key}) vs reserved: "
              f"{demand['stats']['peak_requests'] / reserved['stats']['peak_requests']:.2f}x requests at once, "
              f"{reserved['seconds'] / demand['seconds']:.2f}x tokens/s, {reserved['steps'] / demand['steps']:.2f}x fewer "
              f"decode steps ({demand['stats']['preemptions']} preemptions, "
              f"{demand['stats']['recomputed_tokens']} tokens prefilled again); caches within the budget: "
              f"{max(demand['cache_bytes'], reserved['cache_bytes']) <= budget}")
    demand, copied = res["on_demand"], res["copied_prompts"]
    print(f"at the same budget, prompt blocks shared vs copied per sample: "
          f"{demand['stats']['peak_requests'] / copied['stats']['peak_requests']:.2f}x requests at once, "
          f"{copied['seconds'] / demand['seconds']:.2f}x tokens/s ({demand['stats']['preemptions']} vs "
          f"{copied['stats']['preemptions']} preemptions)")
    print(f"paged (all memory) vs static batches: {base / res['paged']['seconds']:.2f}x tokens/s; at the budget, "
          f"paged on demand vs static batches: {res['static_capped']['seconds'] / res['on_demand']['seconds']:.2f}x "
          f"tokens/s, {res['static_capped']['steps'] / res['on_demand']['steps']:.2f}x fewer forward steps")
    print("(a step's time grows with its rows on CPU, where decode is compute-bound; a GPU decode step of a few "
          "dozen rows is bound by reading the weights, so there tokens/s follows the steps)")


if __name__ == "__main__":
    main()
