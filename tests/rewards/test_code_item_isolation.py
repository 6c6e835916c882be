"""One bad item of a code-reward batch scores only itself 0 — a bad row counted as an error, a program
that breaks the compile check as the response's fault (a verdict) —; the others keep their scores
(issue 13: one 6 KB ``x=1+1+...`` program or one row without ``tests`` zeroed the batch)."""

from __future__ import annotations

from megatron_cascade.rewards import build_reward, score_batch

GOOD = "```python\nprint(input()[::-1])\n```"
GOOD_ROW = {"tests": [{"input": "abc", "output": "cba"}]}


def _score(responses: list[str], rows: list[dict]) -> tuple[list[float], int]:
    return score_batch(build_reward("code", {"timeout_s": 5}), responses, rows)


def test_compile_check_recursion_error_hits_only_its_item():
    bomb = "```python\nx = 1" + " + 1" * 3000 + "\nprint(x)\n```"  # ~12 KB: RecursionError in compile()
    scores, errors = _score([GOOD, bomb, GOOD], [GOOD_ROW, GOOD_ROW, GOOD_ROW])
    assert scores == [1.0, 0.0, 1.0]
    assert errors == 0  # the program broke its own scoring: a verdict (tests/rewards/test_reward_outcomes.py)


def test_row_without_tests_hits_only_its_item():
    rows = [GOOD_ROW, {"prompt": "no tests here"}, {"tests": "not a list"}, {"tests": []}]
    scores, errors = _score([GOOD] * 4, rows)
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert errors == 3


def test_malformed_test_case_hits_only_its_item():
    scores, errors = _score([GOOD, GOOD], [{"tests": [{"input": "abc"}]}, GOOD_ROW])
    assert scores == [0.0, 1.0]
    assert errors == 1


def test_preflight_names_a_bad_kwarg():
    import pytest

    from megatron_cascade.rewards.code import code_reward

    with pytest.raises(ValueError, match="memory_mb"):
        code_reward.preflight(memory_mb=40, max_processes=4)  # 10 MiB a process: Python cannot start
    with pytest.raises(ValueError, match="timeout_s"):
        code_reward.preflight(timeout_s=0)


def test_bad_kwargs_are_refused_when_the_reward_is_built():
    import pytest

    for kwargs, name in (({"memory_mb": 40}, "memory_mb"), ({"timeout_s": -1}, "timeout_s"),
                         ({"allow_unsafe_sandbox": "yes"}, "allow_unsafe_sandbox"), ({"uid_base": -5}, "uid_base"),
                         ({"max_workers": 0}, "max_workers")):
        with pytest.raises(ValueError, match=name):
            build_reward("code", kwargs)


def test_a_program_runs_once_per_batch_however_many_responses_hold_it():
    """Identical (program, stdin) pairs share one run: 24 copies of a program that prints a coin flip
    all get the same verdict (run 24 times, they would agree with probability 2**-23); a different
    prompt's copy is judged against its own expected output."""
    coin = "```python\nimport random\nprint(random.randint(0, 1))\n```"
    row = {"tests": [{"input": "", "output": "1"}]}
    scores, errors = _score([coin] * 24, [row] * 24)
    assert errors == 0 and len(set(scores)) == 1
    other = {"tests": [{"input": "", "output": "0"}]}
    scores, _ = _score([coin] * 6, [row, other] * 3)
    assert scores[0::2] == [scores[0]] * 3 and scores[1::2] == [1.0 - scores[0]] * 3
    dup_tests = {"tests": [{"input": "abc", "output": "cba"}, {"input": "abc", "output": "cba"}]}
    assert _score([GOOD, "```python\nprint(input())\n```"], [dup_tests] * 2)[0] == [1.0, 0.0]
