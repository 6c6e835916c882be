"""What killable verifier processes cost: the built-in verifiers scored in threads (the old path)
vs in :mod:`megatron_cascade.rewards.isolation` worker processes, same responses, same run.

Prints, per reward, the wall time of ``score_batch`` over ``n`` responses both ways (processes:
warm pool, then the first call of a fresh pool, which starts the workers), and the cost of
replacing a killed worker. Run: ``python benchmarks/verifier_processes.py [n]``.
"""

from __future__ import annotations

import sys
import time

from megatron_cascade.rewards import get_reward
from megatron_cascade.rewards.isolation import VerifierProcessPool
from megatron_cascade.rewards.registry import BoundReward
from megatron_cascade.rewards.scoring import ScoringPool, finalize_scores
import megatron_cascade.rewards.isolation as isolation

CASES = {
    "math": ("The answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}),
    "instruction_following": ("* one\n* two\nall lower case, no comma here.",
                              {"instructions": [{"id": "change_case:english_lowercase", "kwargs": {}},
                                                {"id": "detectable_format:number_bullet_lists",
                                                 "kwargs": {"num_bullets": 2}}]}),
    "structured_output": ('```json\n{"name": "Ada", "age": 36}\n```',
                          {"schema": {"type": "object", "properties": {"age": {"type": "integer"}}}}),
    "multiple_choice": ("so the answer is (C).", {"answer": "C", "choices": 4}),
}


def _score(reward, n: int, workers: int) -> float:
    response, sample = CASES[reward.name]
    start = time.perf_counter()
    pool = ScoringPool(workers)
    for _ in range(n):
        pool.submit(reward, response, sample, timeout_s=30.0)
    scores, errors = finalize_scores(pool.results(), reward.name)
    assert errors == 0 and scores == [1.0] * n, (reward.name, errors)
    return time.perf_counter() - start


def main(n: int = 400, workers: int = 2) -> None:
    print(f"{n} responses per reward, ScoringPool({workers}), best of 3")
    print(f"{'reward':>22} {'threads':>9} {'processes':>10} {'fresh pool':>11}")
    for name in CASES:
        fn = get_reward(name).fn
        threaded = BoundReward(name, lambda r, s, fn=fn: fn(r, s))  # same function, not marked run_in_process
        in_process = get_reward(name)
        _score(threaded, 10, workers)  # imports, caches
        isolation._POOL = VerifierProcessPool(workers)
        fresh = _score(in_process, n, workers)
        t_thread = min(_score(threaded, n, workers) for _ in range(3))
        t_proc = min(_score(in_process, n, workers) for _ in range(3))
        isolation._POOL.close()
        print(f"{name:>22} {t_thread:>8.3f}s {t_proc:>9.3f}s {fresh:>10.3f}s")
    pool = VerifierProcessPool(1)
    pool.call(get_reward("math"), *CASES["math"], timeout_s=30.0)
    start = time.perf_counter()
    timed_out = pool.call(get_reward("math"), "\\boxed{9^{9^{9^{9}}}}", {"answer": "1"}, timeout_s=0.5)
    killed = time.perf_counter() - start
    start = time.perf_counter()
    pool.call(get_reward("math"), *CASES["math"], timeout_s=30.0)
    respawn = time.perf_counter() - start
    pool.close()
    print(f"power tower: {type(timed_out).__name__} after {killed:.2f}s (timeout 0.5 s); next call on a "
          f"replacement worker (start + import SymPy) {respawn:.2f}s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
