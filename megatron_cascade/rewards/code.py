"""``code`` reward: run the last ```python block of a response against stdin/stdout tests.

``sample["tests"]`` is a list of ``{"input": stdin, "output": expected stdout}``. Outputs
are compared after stripping trailing whitespace on each line and trailing blank lines.
Reward: 1.0 only if every test passes; with ``partial=True`` (kwarg, or ``sample["partial"]``)
the fraction of passed tests. Programs run in :class:`~megatron_cascade.rewards.sandbox.CodeSandbox`;
the batch form runs all (response, test) pairs of a batch on one pool -- each distinct (program,
stdin) once -- and, in all-or-nothing mode, skips the remaining tests of a response once one has failed.
"""

from __future__ import annotations

import threading
from typing import Sequence

from megatron_cascade.rewards.outcome import ResponseFault
from megatron_cascade.rewards.registry import register_reward
from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits, SandboxResult

def extract_program(response: str) -> str | None:
    """Source of the last fenced python block (an opening fence whose info string starts with "py",
    any case, e.g. ```python3), or None. One pass: the regex r"```(?:python3?|py)[^\n]*\n(.*?)```"
    rescanned the text from every unclosed fence (quadratic: 180K characters of "```python" took 4.7 s
    holding the GIL)."""
    last, pos = None, 0
    while True:
        start = response.find("```", pos)
        if start < 0:
            return last
        if response[start + 3:start + 5].lower() != "py":
            pos = start + 1
            continue
        line_end = response.find("\n", start + 5)
        end = response.find("```", line_end + 1) if line_end >= 0 else -1
        if end < 0:
            return last
        last, pos = response[line_end + 1:end], end + 3


def normalize_output(text: str) -> str:
    """Trailing whitespace per line and trailing blank lines are not significant."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def _compiles(source: str) -> bool:
    """Whether ``source`` compiles. A syntax error fails every test: no need to spawn a process per
    test to learn that.

    Raises:
        ResponseFault: ``compile`` itself gave up on the program (RecursionError on a 6 KB
            ``x=1+1+...``, MemoryError): the response broke its scoring, it scores 0 as a verdict
            (an invalid sample instead would let a wrong program escape its negative advantage).
    """
    try:
        compile(source, "main.py", "exec")
        return True
    except (SyntaxError, ValueError):
        return False
    except (RecursionError, MemoryError) as e:
        raise ResponseFault(f"the program is too deep or too large for Python's compiler ({type(e).__name__})") from None


def _tests_of(sample: dict) -> list[tuple[str, str]]:
    """``sample["tests"]`` as (stdin, expected stdout) pairs; ValueError naming what is wrong."""
    tests = sample.get("tests") if isinstance(sample, dict) else None
    if not isinstance(tests, list) or not tests:
        got = "an empty list" if isinstance(tests, list) else type(tests).__name__
        raise ValueError(f"code reward: the row has no 'tests' list to check against (got {got})")
    pairs = []
    for k, test in enumerate(tests):
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            raise ValueError(f"code reward: tests[{k}] is not an object with 'input' and 'output'")
        pairs.append((str(test["input"]), str(test["output"])))
    return pairs


def _jobs(responses: Sequence[str], samples: Sequence[dict]
          ) -> tuple[list[Program], list[list[tuple[int, str]]], list[int], dict[int, Exception]]:
    """The distinct programs of a batch to run, each with the (response index, expected output)
    pairs it is judged for; also tests per response and the items that cannot be scored at all
    with their exception: a malformed row (an error) or a program ``compile`` chokes on (a
    :class:`ResponseFault`); the rest of the batch runs.

    A (source, stdin) pair runs once per batch however many responses hold it: the samples of one
    prompt often write the same program (after RL, most of them), and its run is a sample of the
    same distribution for each -- a nondeterministic program's copies share one draw, which leaves
    each response's expected reward unchanged.
    """
    programs: list[Program] = []
    judged_for: list[list[tuple[int, str]]] = []
    index: dict[tuple[str, str], int] = {}
    n_tests, errors = [], {}
    for i, (response, sample) in enumerate(zip(responses, samples)):
        try:
            tests = _tests_of(sample)
            source = extract_program(response)
            runnable = source is not None and _compiles(source)
        except Exception as e:  # noqa: BLE001 - this item's error, not the batch's
            errors[i] = e
            n_tests.append(0)
            continue
        n_tests.append(len(tests))
        if not runnable:
            continue
        for stdin, expected in tests:
            j = index.setdefault((source, stdin), len(programs))
            if j == len(programs):
                programs.append(Program(source, stdin))
                judged_for.append([])
            judged_for[j].append((i, expected))
    return programs, judged_for, n_tests, errors


def code_reward_batch(responses: Sequence[str], samples: Sequence[dict], *,
                      timeout_s: float = 5.0, memory_mb: int = 1024, partial: bool = False,
                      max_workers: int | None = None, max_processes: int = 4, allow_unsafe_sandbox: bool = False,
                      uid_base: int = 61000) -> list[float | BaseException]:
    """Batch form of :func:`code_reward` (same kwargs); runs everything on one pool, each distinct
    (program, stdin) once. A malformed row (an error) or a program that breaks the compile check (a
    :class:`ResponseFault`) is returned as that item's exception.

    Raises:
        SandboxUnavailableError: isolation cannot be had here and ``allow_unsafe_sandbox`` is off.
    """
    sandbox = CodeSandbox(max_workers=max_workers, allow_unsafe=allow_unsafe_sandbox, uid_base=uid_base)
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes)
    programs, judged_for, n_tests, errors = _jobs(responses, samples)
    partial_of = [bool(s.get("partial", partial)) if isinstance(s, dict) else partial for s in samples]
    failed: set[int] = set()
    lock = threading.Lock()

    def should_run(j: int) -> bool:  # all-or-nothing responses that already failed need no more runs
        with lock:
            return any(partial_of[i] or i not in failed for i, _ in judged_for[j])

    passed = [0] * len(responses)

    def on_result(j: int, result: SandboxResult) -> None:
        got = normalize_output(result.stdout) if result.ok else None
        with lock:
            for i, expected in judged_for[j]:
                if got is not None and got == normalize_output(expected):
                    passed[i] += 1
                elif not result.skipped:
                    failed.add(i)

    sandbox.run_many(programs, limits, should_run=should_run, on_result=on_result)
    return [errors[i] if i in errors else _score(passed[i], n_tests[i], partial_of[i])
            for i in range(len(responses))]


def _score(passed: int, total: int, partial: bool) -> float:
    if total == 0:
        return 0.0
    return passed / total if partial else float(passed == total)


@register_reward("code")
def code_reward(response: str, sample: dict, *, timeout_s: float = 5.0, memory_mb: int = 1024,
                partial: bool = False, max_workers: int | None = None, max_processes: int = 4,
                allow_unsafe_sandbox: bool = False, uid_base: int = 61000) -> float:
    """Score one response: run its last python block on ``sample["tests"]``.

    Args:
        timeout_s: wall-clock limit per test run in seconds.
        memory_mb: memory of each test run's whole process tree in MiB: each of its processes may
            map ``memory_mb / max_processes`` (``SandboxLimits``).
        max_processes: processes and threads of one test run.
        partial: fraction of passed tests instead of all-or-nothing.
        max_workers: parallel test runs (default ``os.cpu_count()``).
        allow_unsafe_sandbox: where the isolated sandbox cannot be had (no root / CAP_SYS_ADMIN),
            run programs with rlimits only, warned once, instead of refusing. Trusted data only.
        uid_base: first uid of the sandbox's per-rank uid ranges (none may be a real user's).

    Raises:
        SandboxUnavailableError: isolation cannot be had and ``allow_unsafe_sandbox`` is off.
        ValueError: the row has no valid ``tests``.
    """
    value = code_reward_batch([response], [sample], timeout_s=timeout_s, memory_mb=memory_mb, partial=partial,
                              max_workers=max_workers, max_processes=max_processes,
                              allow_unsafe_sandbox=allow_unsafe_sandbox,
                              uid_base=uid_base)[0]
    if isinstance(value, BaseException):
        raise value
    return value


def code_reward_preflight(*, timeout_s: float = 5.0, memory_mb: int = 1024, partial: bool = False,
                          max_workers: int | None = None, max_processes: int = 4, allow_unsafe_sandbox: bool = False,
                          uid_base: int = 61000) -> None:
    """Check the code reward's kwargs and the sandbox before a run starts (same kwargs).

    Raises:
        ValueError: a limit is out of range (the message names the kwarg).
        SandboxUnavailableError: isolation cannot be had and ``allow_unsafe_sandbox`` is off.
    """
    SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes)
    CodeSandbox(max_workers=max_workers, allow_unsafe=allow_unsafe_sandbox, uid_base=uid_base).resolve_backend()


def _validate_kwargs(kwargs: dict) -> None:
    """Values of the code reward's kwargs, checked when the reward is built (``build_reward``);
    the message names the kwarg. The sandbox itself is checked by :func:`code_reward_preflight`."""
    SandboxLimits(timeout_s=kwargs.get("timeout_s", 5.0), memory_mb=kwargs.get("memory_mb", 1024),
                  max_processes=kwargs.get("max_processes", 4))
    for name in ("partial", "allow_unsafe_sandbox"):
        if not isinstance(kwargs.get(name, False), bool):
            raise ValueError(f"{name} must be true or false, got {kwargs[name]!r}")
    workers = kwargs.get("max_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"max_workers must be a positive integer or null, got {workers!r}")
    uid_base = kwargs.get("uid_base", 61000)
    if isinstance(uid_base, bool) or not isinstance(uid_base, int) or uid_base < 0:
        raise ValueError(f"uid_base must be a non-negative integer, got {uid_base!r}")


code_reward.batch_fn = code_reward_batch  # type: ignore[attr-defined]
code_reward.validate_kwargs = _validate_kwargs  # type: ignore[attr-defined]
code_reward.preflight = code_reward_preflight  # type: ignore[attr-defined]
