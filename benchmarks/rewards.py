"""Reward benchmarks. Run: ``python benchmarks/rewards.py [--n 200] [--only code|generation|streaming]``.

``bench_code_verifier``: sandboxed code-verifier throughput (programs/s) for ``n`` small
programs, pooled (``CodeSandbox.run_many``, ``os.cpu_count()`` workers) vs one at a time.

``bench_streaming_rewards``: generation + scoring wall time of one rollout batch with a slow
reward (a sleep standing in for a sandbox run or an HTTP reward model), scoring after generation
(``score_responses``, the stage's old path) vs scoring each sample as it finishes
(``RolloutScorer`` on ``generate``'s ``on_finished``), same process, same prompts and scores.
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
    """Programs per second, sequential vs pooled, in the isolated sandbox and, side by side in the
    same run, in the unsafe (rlimits-only) mode as the baseline cost of a bare process; returns the
    figures and prints a table."""
    programs = _programs(n)
    limits = SandboxLimits(timeout_s=timeout_s)
    out: dict[str, float] = {"n": n, "workers": os.cpu_count() or 1}
    print(f"code verifier ({n} programs, {out['workers']} workers)")
    print(f"{'mode':>10} {'one-at-a-time':>16} {'pooled':>10} {'ratio':>8}")
    for mode in ("isolated", "unsafe"):
        box = CodeSandbox(_backend=mode)
        box.run(programs[0], limits)  # interpreter query, filter build: outside the timed region
        start = time.perf_counter()
        sequential = [box.run(p, limits) for p in programs]
        seq_s = time.perf_counter() - start
        start = time.perf_counter()
        pooled = box.run_many(programs, limits)
        pool_s = time.perf_counter() - start
        failed = [r for r in sequential + pooled if not r.ok]
        assert not failed, f"{len(failed)} benchmark programs failed, e.g. {failed[0]}"
        out.update({f"{mode}_sequential_per_s": n / seq_s, f"{mode}_pooled_per_s": n / pool_s,
                    f"{mode}_speedup": seq_s / pool_s})
        print(f"{mode:>10} {n / seq_s:>14.1f}/s {n / pool_s:>8.1f}/s {seq_s / pool_s:>7.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200, help="number of programs")
    parser.add_argument("--only", choices=["code", "generation", "streaming"], help="run one benchmark")
    args = parser.parse_args()
    if args.only in (None, "code"):
        bench_code_verifier(args.n)
    if args.only in (None, "generation"):
        bench_generation()
    if args.only in (None, "streaming"):
        bench_streaming_rewards()


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


# ---------------------------------------------------------------------------------------------
# Rewards while generating: the slow reward's time hidden behind decoding.


def _slow_reward(response: str, sample: dict) -> float:
    """Sleeps ``sample["delay_s"]`` (a sandbox or HTTP round trip), then scores the distinct characters."""
    time.sleep(sample["delay_s"])
    return len(set(response)) / 40


def _streaming_worker(prompts_n: int, samples: int, max_new_tokens: int, delay_s: float,
                      repeats: int) -> dict[str, float]:
    import torch

    from megatron_cascade.stages.rollout_scoring import RolloutScorer, score_responses
    from megatron_cascade.config import ModelConfig, ParallelConfig
    from megatron_cascade.config.schema import DomainConfig, RewardSpec
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    limit = 2 * max_new_tokens
    model_cfg = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=tok.vocab_size,
                            max_position_embeddings=limit)
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_gpt_model(model_cfg, ParallelConfig())
    gen = torch.Generator().manual_seed(0)
    # Prompt lengths spread so that the budgets (limit - prompt) spread from max_new_tokens down to a
    # quarter of it: samples finish all along the run, as responses ending at EOS do.
    lengths = torch.linspace(limit - max_new_tokens, limit - max_new_tokens // 4, prompts_n).long().tolist()
    prompts = [torch.randint(7, tok.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    rows = [{"delay_s": delay_s}] * prompts_n
    names = ["slow"] * prompts_n
    rewards = {"slow": _slow_reward}
    domains = {"slow": DomainConfig(reward=RewardSpec(name="slow"))}
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=samples, seed=1, ignore_eos=True)

    def after_generation():
        start = time.perf_counter()
        batch = generate(model, prompts, params, tokenizer=tok, max_sequence_length=limit)
        generated = time.perf_counter()
        scores, _, _ = score_responses(rewards, domains, [tok.decode(s.response_ids) for s in batch],
                                       [rows[s.prompt_index] for s in batch], [names[s.prompt_index] for s in batch])
        return scores, generated - start, time.perf_counter() - generated

    def while_generating():
        start = time.perf_counter()
        with RolloutScorer(rewards, domains, tok, rows, names) as scorer:
            batch = generate(model, prompts, params, tokenizer=tok, max_sequence_length=limit,
                             on_finished=scorer.on_finished)
            generated = time.perf_counter()
            scores, _, _ = scorer.collect(batch.samples)
        return scores, generated - start, time.perf_counter() - generated

    generate(model, prompts[:2], SamplingParams(max_new_tokens=4), tokenizer=tok)  # warm-up
    best: dict[str, tuple[float, float]] = {}
    reference = None
    for _ in range(repeats):  # interleaved, so that a busy moment of the machine hits both alike
        for name, run in (("after", after_generation), ("streaming", while_generating)):
            scores, gen_s, wait_s = run()
            reference = scores if reference is None else reference
            assert torch.equal(scores, reference), "streamed scores differ from serial scoring"
            if name not in best or gen_s + wait_s < sum(best[name]):
                best[name] = (gen_s, wait_s)
    out: dict[str, float] = {"samples": prompts_n * samples}
    for name, (gen_s, wait_s) in best.items():
        out[f"{name}_generate_s"], out[f"{name}_wait_s"], out[f"{name}_total_s"] = gen_s, wait_s, gen_s + wait_s
    return out


def bench_streaming_rewards(prompts_n: int = 16, samples: int = 4, max_new_tokens: int = 64,
                            delay_s: float = 0.05, repeats: int = 3) -> dict[str, float]:
    """Wall time of generate + score for ``prompts_n x samples`` responses, with a reward that
    takes ``delay_s`` per response on ``os.cpu_count()`` reward threads: scored after generation
    vs while generating (best of ``repeats`` each). Prints a table; returns the figures."""
    from megatron_cascade.testing import run_distributed

    f = run_distributed(_streaming_worker, 1, prompts_n, samples, max_new_tokens, delay_s, repeats,
                        cpu_mode=not _cuda_available(), timeout_s=1800)[0]
    f["speedup"] = f["after_total_s"] / f["streaming_total_s"]
    print(f"rewards while generating (4 layers, hidden 256, {f['samples']:.0f} responses of <= {max_new_tokens} "
          f"tokens, reward {delay_s * 1000:.0f} ms each, {os.cpu_count()} reward threads)")
    print(f"{'':>22} {'generate':>9} {'wait':>8} {'total':>8}")
    for name, label in (("after", "scored after generate"), ("streaming", "scored while decoding")):
        print(f"{label:>22} {f[name + '_generate_s']:>8.2f}s {f[name + '_wait_s']:>7.2f}s {f[name + '_total_s']:>7.2f}s")
    print(f"{'speed-up':>22} {f['speedup']:>26.2f}x")
    return f


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
