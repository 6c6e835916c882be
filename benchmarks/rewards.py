"""Reward benchmarks. Run: ``python benchmarks/rewards.py [--n 200]``.

``bench_code_verifier``: sandboxed code-verifier throughput (programs/s) for ``n`` small
programs, pooled (``CodeSandbox.run_many``, ``os.cpu_count()`` workers) vs one at a time.
"""

from __future__ import annotations

import argparse
import os
import time

from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits


def _programs(n: int) -> list[Program]:
    source = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"
    return [Program(source, f"{1000 + i}\n") for i in range(n)]


def bench_code_verifier(n: int = 200, timeout_s: float = 5.0) -> dict[str, float]:
    """Programs per second, sequential vs pooled; returns the figures and prints a table."""
    programs = _programs(n)
    limits = SandboxLimits(timeout_s=timeout_s)
    box = CodeSandbox()
    backend = box.backend  # probe outside the timed region
    start = time.perf_counter()
    sequential = [box.run(p, limits) for p in programs]
    seq_s = time.perf_counter() - start
    start = time.perf_counter()
    pooled = box.run_many(programs, limits)
    pool_s = time.perf_counter() - start
    assert all(r.ok for r in sequential + pooled), "benchmark programs must succeed"
    out = {"n": n, "workers": os.cpu_count() or 1, "sequential_per_s": n / seq_s,
           "pooled_per_s": n / pool_s, "speedup": seq_s / pool_s}
    print(f"code verifier ({backend} sandbox, {n} programs, {out['workers']} workers)")
    print(f"{'one-at-a-time':>16} {'pooled':>10} {'ratio':>8}")
    print(f"{out['sequential_per_s']:>12.1f}/s {out['pooled_per_s']:>8.1f}/s "
          f"{out['speedup']:>7.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200, help="number of programs")
    args = parser.parse_args()
    bench_code_verifier(args.n)
    bench_generation()


# ---------------------------------------------------------------------------------------------
# Rollout generation: tokens/s with Megatron's static KV cache vs recomputing the whole prefix.


def _generation_worker(batch_size: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Runs in a 1-process gloo group with Megatron's CPU mode (GPU if there is one)."""
    import torch

    from megatron_cascade.config import ModelConfig, ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import CharTokenizer

    tokenizer = CharTokenizer()
    model_cfg = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=tokenizer.vocab_size,
                            max_position_embeddings=prompt_len + new_tokens)
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_gpt_model(model_cfg, ParallelConfig())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(7, tokenizer.vocab_size, (prompt_len,), generator=gen).tolist()
               for _ in range(batch_size)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, cached in (("kv_cache", True), ("recompute", False)):
        generate(model, prompts[:2], SamplingParams(max_new_tokens=4), tokenizer=tokenizer, use_kv_cache=cached)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            batch = generate(model, prompts, params, tokenizer=tokenizer, use_kv_cache=cached)
            best = min(best, time.perf_counter() - start)
        out[name] = sum(len(s.response_ids) for s in batch) / best
    return out


def bench_generation(batch_size: int = 8, prompt_len: int = 64, new_tokens: int = 128,
                     repeats: int = 2) -> dict[str, float]:
    """Generated tokens/s of a 4-layer, hidden-256 model: KV cache vs full-prefix recomputation.

    Same process, same prompts and sampling; the best of ``repeats`` timed runs each. Prints a table.
    """
    from megatron_cascade.testing import run_distributed

    figures = run_distributed(_generation_worker, 1, batch_size, prompt_len, new_tokens, repeats,
                              cpu_mode=not _cuda_available(), timeout_s=1800)[0]
    figures["speedup"] = figures["kv_cache"] / figures["recompute"]
    print(f"generation (4 layers, hidden 256, batch {batch_size}, prompt {prompt_len}, {new_tokens} new tokens)")
    print(f"{'kv cache':>14} {'recompute':>14} {'ratio':>8}")
    print(f"{figures['kv_cache']:>12.1f}/s {figures['recompute']:>12.1f}/s {figures['speedup']:>7.2f}x")
    return figures


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
