"""``code`` reward: run the last ```python block of a response against stdin/stdout tests.

``sample["tests"]`` is a list of ``{"input": stdin, "output": expected stdout}``. Outputs
are compared after stripping trailing whitespace on each line and trailing blank lines.
Reward: 1.0 only if every test passes; with ``partial=True`` (kwarg, or ``sample["partial"]``)
the fraction of passed tests. Programs run in :class:`~megatron_cascade.rewards.sandbox.CodeSandbox`;
the batch form runs all (response, test) pairs of a batch on one pool and, in
all-or-nothing mode, skips the remaining tests of a response once one has failed.
"""

from __future__ import annotations

import re
import threading
from typing import Sequence

from megatron_cascade.rewards.registry import register_reward
from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits, SandboxResult

_PY_BLOCK = re.compile(r"```(?:python3?|py)[^\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str | None:
    """Source of the last fenced python block, or None when there is none."""
    blocks = _PY_BLOCK.findall(response)
    return blocks[-1] if blocks else None


def normalize_output(text: str) -> str:
    """Trailing whitespace per line and trailing blank lines are not significant."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def _compiles(source: str) -> bool:
    # A syntax error fails every test: no need to spawn a process per test to learn that.
    try:
        compile(source, "main.py", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def _jobs(responses: Sequence[str], samples: Sequence[dict]) -> tuple[list[tuple[int, Program, str]], list[int]]:
    """Flatten to (response index, program, expected output); also tests per response."""
    jobs, n_tests = [], []
    for i, (response, sample) in enumerate(zip(responses, samples)):
        tests = sample["tests"]
        n_tests.append(len(tests))
        source = extract_program(response)
        if source is None or not _compiles(source):
            continue
        for test in tests:
            jobs.append((i, Program(source, str(test["input"])), str(test["output"])))
    return jobs, n_tests


def code_reward_batch(responses: Sequence[str], samples: Sequence[dict], *,
                      timeout_s: float = 5.0, memory_mb: int = 1024, partial: bool = False,
                      max_workers: int | None = None) -> list[float | BaseException]:
    """Batch form of :func:`code_reward` (same kwargs); runs everything on one pool."""
    jobs, n_tests = _jobs(responses, samples)
    partial_of = [bool(s.get("partial", partial)) for s in samples]
    failed: set[int] = set()
    lock = threading.Lock()

    def should_run(j: int) -> bool:
        i = jobs[j][0]
        with lock:
            return partial_of[i] or i not in failed

    passed = [0] * len(responses)

    def on_result(j: int, result: SandboxResult) -> None:
        i, _, expected = jobs[j]
        ok = result.ok and normalize_output(result.stdout) == normalize_output(expected)
        with lock:
            if ok:
                passed[i] += 1
            elif not result.skipped:
                failed.add(i)

    sandbox = CodeSandbox(max_workers=max_workers)
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb)
    sandbox.run_many([p for _, p, _ in jobs], limits, should_run=should_run, on_result=on_result)
    return [_score(passed[i], n_tests[i], partial_of[i]) for i in range(len(responses))]


def _score(passed: int, total: int, partial: bool) -> float:
    if total == 0:
        return 0.0
    return passed / total if partial else float(passed == total)


@register_reward("code")
def code_reward(response: str, sample: dict, *, timeout_s: float = 5.0, memory_mb: int = 1024,
                partial: bool = False, max_workers: int | None = None) -> float:
    """Score one response: run its last python block on ``sample["tests"]``.

    Args:
        timeout_s: wall-clock limit per test run in seconds.
        memory_mb: address-space limit per run in MiB.
        partial: fraction of passed tests instead of all-or-nothing.
        max_workers: parallel test runs (default ``os.cpu_count()``).
    """
    return code_reward_batch([response], [sample], timeout_s=timeout_s, memory_mb=memory_mb,
                             partial=partial, max_workers=max_workers)[0]  # type: ignore[return-value]


code_reward.batch_fn = code_reward_batch  # type: ignore[attr-defined]
