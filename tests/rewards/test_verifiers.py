"""Known-answer tables for math, code, structured output and multiple choice."""

from __future__ import annotations

import pytest

from megatron_cascade.rewards import build_reward, get_reward

MATH_CASES = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so the result is 0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "0.5", 1.0),
    ("Therefore 3.0", "3", 1.0),
    ("\\boxed{3}", "3.0", 1.0),
    ("\\boxed{x+1}", "1+x", 1.0),
    ("Thus x+1", "1+x", 1.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("First 7, finally \\boxed{10}", "10", 1.0),
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{x-1}", "x+1", 0.0),
    ("I do not know", "3", 0.0),
    ("", "3", 0.0),
]


@pytest.mark.parametrize("response,answer,expected", MATH_CASES)
def test_math(response, answer, expected):
    assert get_reward("math")(response, {"answer": answer}) == expected


def test_math_in_worker_thread():
    """math-verify's signal-based timeouts must not break scoring outside the main thread."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(get_reward("math")("\\boxed{0.5}", {"answer": "1/2"})))
    t.start()
    t.join()
    assert out == [1.0]


ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]


def _py(src: str) -> str:
    return f"Here you go:\n```python\n{src}\n```\n"


CODE_CASES = [
    ("pass", _py("a, b = map(int, input().split())\nprint(a + b)"), False, 1.0),
    ("trailing ws ok", _py("a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()"), False, 1.0),
    ("fail", _py("print(0)"), False, 0.0),
    ("half strict", _py("input()\nprint(3)"), False, 0.0),
    ("half partial", _py("input()\nprint(3)"), True, 0.5),
    ("syntax error", _py("def f(:\n  pass"), False, 0.0),
    ("runtime error", _py("raise SystemExit(1)"), True, 0.0),
    ("timeout", _py("while True:\n    pass"), True, 0.0),
    ("no code block", "a + b, obviously", False, 0.0),
    ("last block wins", _py("print(0)") + _py("a, b = map(int, input().split())\nprint(a + b)"), False, 1.0),
]


@pytest.mark.parametrize("name,response,partial,expected", CODE_CASES, ids=[c[0] for c in CODE_CASES])
def test_code(name, response, partial, expected, no_leftovers):
    reward = build_reward("code", {"timeout_s": 1.5, "partial": partial})
    assert reward(response, {"tests": ADD_TESTS}) == expected


def test_code_partial_from_sample():
    reward = get_reward("code")
    assert reward(_py("input()\nprint(3)"), {"tests": ADD_TESTS, "partial": True}) == 0.5


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURED_CASES = [
    ('{"name": "Ada", "age": 36}', 1.0),
    ('Sure!\n```json\n{"name": "Ada", "age": 36}\n```', 1.0),
    ('{"name": "Ada", "age": -1}', 0.0),
    ('{"name": "Ada"}', 0.0),
    ('{"name": "Ada", "age": 36, "x": 1}', 0.0),
    ("name: Ada, age: 36", 0.0),
    ('```json\n{"name": "Ada", \n```', 0.0),
]


@pytest.mark.parametrize("response,expected", STRUCTURED_CASES)
def test_structured_output(response, expected):
    assert get_reward("structured_output")(response, {"schema": SCHEMA}) == expected


MC_CASES = [
    ("Answer: C", "C", 1.0),
    ("Thinking... \\boxed{B}", "B", 1.0),
    ("I would pick (D)", "D", 1.0),
    ("The answer is (A).", "A", 1.0),
    ("\\boxed{a}", "A", 1.0),
    ("A is wrong, B is wrong, so the answer is C", "C", 1.0),
    ("Answer: **B**", "B", 1.0),
    ("Answer: C", "B", 0.0),
    ("The answer is a bit unclear", "A", 0.0),
    ("no idea", "A", 0.0),
    ("Answer: E", "E", 0.0),  # only 4 choices: E is not a valid option
]


@pytest.mark.parametrize("response,answer,expected", MC_CASES)
def test_multiple_choice(response, answer, expected):
    sample = {"answer": answer, "choices": ["w", "x", "y", "z"]}
    assert get_reward("multiple_choice")(response, sample) == expected
