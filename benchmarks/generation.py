"""Tokens/s and memory of ``generate`` (paged KV cache, continuous batching) vs the static-batch
generator it replaced (Megatron's ``StaticInferenceContext``, all rows decoding until the longest
finishes), on a mixed-length workload.

Workload (defaults): a random 4-layer x 256 GPT (fp32, 4 heads, character vocabulary), 16 prompts of
20-60 tokens x 4 samples = 64 requests, temperature 1, up to 256 new tokens; two stop tokens end a
response early, so lengths spread from a few tokens to the 256 cap (the table prints them). Both
generators draw the same counter-based sampling noise, so they produce the same responses (checked)
and the comparison is like for like.

Timing: both generators in one process, alternated, best of ``--repeats``. Memory: each in a fresh
process, peak RSS above the RSS after a warm-up call, plus the KV bytes each allocated; one more
paged run under a KV budget of a quarter of what all requests need at once shows the cap holds.

Usage: ``python benchmarks/generation.py [--prompts 16 --samples 4 --max-new-tokens 256]``.
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
from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer

TOKENIZER = CharTokenizer()
MODEL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=TOKENIZER.vocab_size,
                    ffn_hidden_size=1024, max_position_embeddings=512, init_method_std=0.05)
STOP_IDS = (17, 42)


@dataclass(frozen=True)
class Workload:
    prompts: int
    samples: int
    max_new_tokens: int
    seed: int = 0

    def prompt_ids(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(20, 61, (self.prompts,), generator=gen).tolist()
        return [torch.randint(3, TOKENIZER.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, n=self.samples, seed=self.seed,
                              stop_token_ids=STOP_IDS, ignore_eos=True)


def static_baseline(model, prompts, params: SamplingParams):
    """The pre-paged generator: one left-padded static batch with Megatron's static KV cache."""
    from megatron_cascade.rollout import RolloutSample
    from megatron_cascade.rollout.static import generate_static

    samples = [RolloutSample(prompt_index=p, sample_index=k, prompt_ids=list(x))
               for p, x in enumerate(prompts) for k in range(params.n)]
    model.eval()
    with torch.no_grad():
        generate_static(model, samples, params, tokenizer=TOKENIZER, limit=MODEL.max_position_embeddings,
                        use_kv_cache=True)
    return samples


def static_kv_bytes(prompts, params: SamplingParams) -> int:
    """What ``StaticInferenceContext`` allocates: K and V ``[batch_width, rows, kv_hidden]`` per layer."""
    width = max(len(p) for p in prompts) + params.max_new_tokens
    rows = len(prompts) * params.n
    return 4 * 2 * MODEL.num_layers * width * rows * MODEL.hidden_size


def _build(threads: int):
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel

    # One thread by default: on a shared 2-core machine two threads contend (a 16 x 256 x 1024
    # matmul took 4.5 ms with 2 threads under load vs 0.12 ms with 1).
    torch.set_num_threads(threads)
    initialize_model_parallel(ParallelConfig(), seed=1234)
    return build_gpt_model(MODEL, ParallelConfig())


def _run(name: str, model, work: Workload, kv: KVCacheConfig | None):
    prompts, params = work.prompt_ids(), work.params()
    if name == "static":
        return static_baseline(model, prompts, params), None
    batch = generate(model, prompts, params, tokenizer=TOKENIZER, kv_cache=kv)
    return list(batch), batch.stats


def timing_worker(work: Workload, repeats: int, budget: int, threads: int) -> dict:
    """Both generators (and the budget-capped paged one) in this process, alternated."""
    model = _build(threads)
    small = replace(work, prompts=2, max_new_tokens=8)
    for name in ("static", "paged"):
        _run(name, model, small, None)  # warm-up
    kinds = {"static": None, "paged": KVCacheConfig(block_size_tokens=64),
             "paged_capped": KVCacheConfig(kv_cache_bytes=budget, block_size_tokens=64)}
    times = {k: [] for k in kinds}
    results = {}
    for _ in range(repeats):
        for name, kv in kinds.items():
            start = time.perf_counter()
            samples, stats = _run("static" if name == "static" else "paged", model, work, kv)
            times[name].append(time.perf_counter() - start)
            results[name] = ([s.response_ids for s in samples], stats)
    return {name: {"seconds": min(t), "median": statistics.median(t), "tokens": results[name][0],
                   "stats": vars(results[name][1]) if results[name][1] else None} for name, t in times.items()}


def memory_worker(name: str, work: Workload, threads: int) -> int:
    """Peak RSS above the RSS after a warm-up call, for one generator (fresh process)."""
    model = _build(threads)
    _run(name, model, replace(work, prompts=2, max_new_tokens=8), KVCacheConfig(block_size_tokens=64))
    baseline = psutil.Process().memory_info().rss
    _run(name, model, work, KVCacheConfig(block_size_tokens=64))
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    work = Workload(args.prompts, args.samples, args.max_new_tokens)
    prompts, params = work.prompt_ids(), work.params()
    block_bytes = 4 * 2 * MODEL.num_layers * 64 * MODEL.hidden_size
    need = sum(-(-(len(p) + params.max_new_tokens) // 64) for p in prompts) * params.n * block_bytes
    budget = need // 4
    res = run_distributed(timing_worker, 1, work, args.repeats, budget, args.threads, timeout_s=3600)[0]
    mem = {name: run_distributed(memory_worker, 1, name, work, args.threads, timeout_s=3600)[0]
           for name in ("static", "paged")}

    lengths = sorted(len(t) for t in res["paged"]["tokens"])
    generated = sum(lengths)
    same = res["paged"]["tokens"] == res["static"]["tokens"] == res["paged_capped"]["tokens"]
    print(f"model 4 layers x {MODEL.hidden_size}, fp32, threads={args.threads}; {len(prompts)} prompts x "
          f"{params.n} samples = {len(lengths)} requests; response lengths min {lengths[0]} / median "
          f"{lengths[len(lengths) // 2]} / mean {generated / len(lengths):.0f} / max {lengths[-1]} "
          f"({generated} tokens); identical responses: {same}")
    print(f"{'generator':<28}{'seconds':>9}{'tokens/s':>10}{'speed-up':>10}{'KV MiB':>9}{'peak RSS MiB':>14}"
          f"{'steps':>7}")
    base = res["static"]["seconds"]
    rows = [("static (before)", "static", static_kv_bytes(prompts, params), mem["static"]),
            ("paged, continuous", "paged", res["paged"]["stats"]["kv_cache_bytes"], mem["paged"]),
            (f"paged, budget {budget / 2**20:.1f} MiB", "paged_capped", res["paged_capped"]["stats"]["kv_cache_bytes"],
             None)]
    for label, key, kv_bytes, rss in rows:
        r = res[key]
        steps = r["stats"]["steps"] if r["stats"] else max(lengths)  # static: the longest response
        rss_text = f"{rss / 2**20:>14.0f}" if rss is not None else f"{'-':>14}"
        print(f"{label:<28}{r['seconds']:>9.2f}{generated / r['seconds']:>10.0f}{base / r['seconds']:>10.2f}"
              f"{kv_bytes / 2**20:>9.1f}{rss_text}{steps:>7}")
    capped = res["paged_capped"]["stats"]
    print(f"budget-capped run: {capped['kv_cache_bytes']} KV bytes allocated <= budget {budget} bytes: "
          f"{capped['kv_cache_bytes'] <= budget}; peak live requests {capped['peak_requests']} of {len(lengths)}")


if __name__ == "__main__":
    main()
