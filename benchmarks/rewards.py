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


if __name__ == "__main__":
    main()
