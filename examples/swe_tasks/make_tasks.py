"""Generate the SWE RL task set: 20 tiny Python repositories, each with a bug, a failing visible test,
hidden tests and the oracle fix. Writes ``tasks.jsonl`` next to this file (rows of the ``swe``
environment, megatron_cascade/environments/swe.py)::

    python examples/swe_tasks/make_tasks.py            # write tasks.jsonl
    python examples/swe_tasks/make_tasks.py --check    # and check in the sandbox: the buggy repo fails
                                                       # its hidden tests, the oracle fix passes them

Each repository: ``<pkg>/__init__.py``, ``<pkg>/core.py`` (the bug), ``tests/test_core.py`` (a visible
test that fails), ``README.md``; the hidden tests ``tests/test_hidden.py`` are copied in only when the
episode is scored. ``oracle_edits`` (the fix as ``edit`` tool calls) is for tests and baselines; the
model never sees the row, only its ``prompt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

# name, issue, buggy core.py, (old, new) fix, visible test body, hidden test bodies
TASKS = [
    ("calc", "add(a, b) returns the difference instead of the sum.",
     "def add(a, b):\n    return a - b\n", ("a - b", "a + b"),
     "self.assertEqual(add(2, 3), 5)",
     ["self.assertEqual(add(2, 3), 5)", "self.assertEqual(add(-1, 1), 0)", "self.assertEqual(add(0, 0), 0)"]),
    ("parity", "is_even(n) answers True for odd numbers.",
     "def is_even(n):\n    return n % 2 == 1\n", ("n % 2 == 1", "n % 2 == 0"),
     "self.assertTrue(is_even(4))",
     ["self.assertTrue(is_even(4))", "self.assertFalse(is_even(7))", "self.assertTrue(is_even(0))"]),
    ("maxlist", "maximum(xs) returns 0 for a list of negative numbers.",
     "def maximum(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best\n",
     ("best = 0", "best = xs[0]"),
     "self.assertEqual(maximum([-5, -2, -9]), -2)",
     ["self.assertEqual(maximum([-5, -2, -9]), -2)", "self.assertEqual(maximum([1, 7, 3]), 7)",
      "self.assertEqual(maximum([4]), 4)"]),
    ("strrev", "reverse(s) returns the string unchanged.",
     "def reverse(s):\n    return s[::1]\n", ("s[::1]", "s[::-1]"),
     "self.assertEqual(reverse('abc'), 'cba')",
     ["self.assertEqual(reverse('abc'), 'cba')", "self.assertEqual(reverse(''), '')",
      "self.assertEqual(reverse('x'), 'x')"]),
    ("fact", "factorial(n) is off by one: factorial(3) gives 2.",
     "def factorial(n):\n    out = 1\n    for k in range(1, n):\n        out *= k\n    return out\n",
     ("range(1, n)", "range(1, n + 1)"),
     "self.assertEqual(factorial(3), 6)",
     ["self.assertEqual(factorial(3), 6)", "self.assertEqual(factorial(0), 1)", "self.assertEqual(factorial(5), 120)"]),
    ("fizz", "fizzbuzz(15) says 'Fizz' instead of 'FizzBuzz'.",
     "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
     "    if n % 15 == 0:\n        return 'FizzBuzz'\n    return str(n)\n",
     ("    if n % 3 == 0:\n        return 'Fizz'\n",
      "    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"),
     "self.assertEqual(fizzbuzz(15), 'FizzBuzz')",
     ["self.assertEqual(fizzbuzz(15), 'FizzBuzz')", "self.assertEqual(fizzbuzz(9), 'Fizz')",
      "self.assertEqual(fizzbuzz(10), 'Buzz')", "self.assertEqual(fizzbuzz(7), '7')"]),
    ("vowels", "count_vowels misses the letter u.",
     "def count_vowels(s):\n    return sum(c in 'aeio' for c in s.lower())\n", ("'aeio'", "'aeiou'"),
     "self.assertEqual(count_vowels('pursue'), 3)",
     ["self.assertEqual(count_vowels('pursue'), 3)", "self.assertEqual(count_vowels('AEIOU'), 5)",
      "self.assertEqual(count_vowels('xyz'), 0)"]),
    ("temps", "to_fahrenheit(0) gives 23 instead of 32.",
     "def to_fahrenheit(c):\n    return c * 9 / 5 + 23\n", ("+ 23", "+ 32"),
     "self.assertEqual(to_fahrenheit(0), 32)",
     ["self.assertEqual(to_fahrenheit(0), 32)", "self.assertEqual(to_fahrenheit(100), 212)"]),
    ("stats", "mean(xs) divides by one less than the number of values.",
     "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n", ("(len(xs) - 1)", "len(xs)"),
     "self.assertEqual(mean([1, 2, 3]), 2)",
     ["self.assertEqual(mean([1, 2, 3]), 2)", "self.assertEqual(mean([5]), 5)"]),
    ("bounds", "clamp(x, lo, hi) returns lo for values above hi.",
     "def clamp(x, lo, hi):\n    return max(lo, min(lo, x)) if x > hi else max(lo, min(hi, x))\n",
     ("max(lo, min(lo, x)) if x > hi else max(lo, min(hi, x))", "max(lo, min(hi, x))"),
     "self.assertEqual(clamp(15, 0, 10), 10)",
     ["self.assertEqual(clamp(15, 0, 10), 10)", "self.assertEqual(clamp(-3, 0, 10), 0)",
      "self.assertEqual(clamp(4, 0, 10), 4)"]),
    ("palin", "is_palindrome('Racecar') is False: case should not matter.",
     "def is_palindrome(s):\n    return s == s[::-1]\n",
     ("return s == s[::-1]", "s = s.lower()\n    return s == s[::-1]"),
     "self.assertTrue(is_palindrome('Racecar'))",
     ["self.assertTrue(is_palindrome('Racecar'))", "self.assertFalse(is_palindrome('abc'))",
      "self.assertTrue(is_palindrome('aA'))"]),
    ("fib", "fib(n) is shifted: fib(1) should be 1 and fib(2) should be 1.",
     "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     ("a, b = 1, 1", "a, b = 0, 1"),
     "self.assertEqual(fib(1), 1)",
     ["self.assertEqual(fib(1), 1)", "self.assertEqual(fib(2), 1)", "self.assertEqual(fib(10), 55)",
      "self.assertEqual(fib(0), 0)"]),
    ("words", "word_count counts empty strings between repeated spaces.",
     "def word_count(text):\n    return len([w for w in text.split(' ')])\n", ("text.split(' ')", "text.split()"),
     "self.assertEqual(word_count('a  b'), 2)",
     ["self.assertEqual(word_count('a  b'), 2)", "self.assertEqual(word_count(''), 0)",
      "self.assertEqual(word_count(' x y z '), 3)"]),
    ("bsearch", "index_of(xs, x) misses values in the upper half of the list.",
     "def index_of(xs, x):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
     "        if xs[mid] == x:\n            return mid\n        if xs[mid] < x:\n            hi = mid - 1\n"
     "        else:\n            lo = mid + 1\n    return -1\n",
     ("        if xs[mid] < x:\n            hi = mid - 1\n        else:\n            lo = mid + 1\n",
      "        if xs[mid] < x:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"),
     "self.assertEqual(index_of([1, 3, 5, 7, 9], 9), 4)",
     ["self.assertEqual(index_of([1, 3, 5, 7, 9], 9), 4)", "self.assertEqual(index_of([1, 3, 5, 7, 9], 1), 0)",
      "self.assertEqual(index_of([1, 3, 5], 4), -1)"]),
    ("flat", "flatten only removes one level of nesting.",
     "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n            out.extend(x)\n"
     "        else:\n            out.append(x)\n    return out\n",
     ("out.extend(x)", "out.extend(flatten(x))"),
     "self.assertEqual(flatten([1, [2, [3]]]), [1, 2, 3])",
     ["self.assertEqual(flatten([1, [2, [3]]]), [1, 2, 3])", "self.assertEqual(flatten([]), [])",
      "self.assertEqual(flatten([[[]]]), [])"]),
    ("dedupe", "unique(xs) loses the order of first appearance.",
     "def unique(xs):\n    return sorted(set(xs))\n",
     ("return sorted(set(xs))", "return list(dict.fromkeys(xs))"),
     "self.assertEqual(unique([3, 1, 3, 2]), [3, 1, 2])",
     ["self.assertEqual(unique([3, 1, 3, 2]), [3, 1, 2])", "self.assertEqual(unique([]), [])"]),
    ("title", "title_case only capitalises the first word.",
     "def title_case(text):\n    return text.capitalize()\n",
     ("return text.capitalize()", "return ' '.join(w.capitalize() for w in text.split(' '))"),
     "self.assertEqual(title_case('hello big world'), 'Hello Big World')",
     ["self.assertEqual(title_case('hello big world'), 'Hello Big World')", "self.assertEqual(title_case('a'), 'A')"]),
    ("divisor", "gcd(a, b) returns 0 instead of the divisor.",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return b\n", ("    return b\n", "    return a\n"),
     "self.assertEqual(gcd(12, 18), 6)",
     ["self.assertEqual(gcd(12, 18), 6)", "self.assertEqual(gcd(7, 5), 1)", "self.assertEqual(gcd(0, 4), 4)"]),
    ("leap", "is_leap(2000) is False: years divisible by 400 are leap years.",
     "def is_leap(y):\n    return y % 4 == 0 and y % 100 != 0\n",
     ("y % 4 == 0 and y % 100 != 0", "y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)"),
     "self.assertTrue(is_leap(2000))",
     ["self.assertTrue(is_leap(2000))", "self.assertFalse(is_leap(1900))", "self.assertTrue(is_leap(2024))",
      "self.assertFalse(is_leap(2023))"]),
    ("stack", "Stack.pop returns the oldest item instead of the newest.",
     "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
     "    def push(self, x):\n        self.items.append(x)\n\n"
     "    def pop(self):\n        return self.items.pop(0)\n", ("self.items.pop(0)", "self.items.pop()"),
     "s = Stack()\n        s.push(1)\n        s.push(2)\n        self.assertEqual(s.pop(), 2)",
     ["s = Stack()\n        s.push(1)\n        s.push(2)\n        self.assertEqual(s.pop(), 2)",
      "s = Stack()\n        s.push('a')\n        self.assertEqual(s.pop(), 'a')"]),
]


def _exported(core: str) -> list[str]:
    return re.findall(r"^(?:def|class) (\w+)", core, re.M)


def _test_file(pkg: str, names: list[str], bodies: list[str], cls: str) -> str:
    methods = "\n\n".join(f"    def test_{i}(self):\n        {body}" for i, body in enumerate(bodies))
    header = f"import unittest\n\nfrom {pkg}.core import {', '.join(names)}\n\n\n"
    return f"{header}class {cls}(unittest.TestCase):\n{methods}\n"


def make_row(task: tuple) -> dict:
    """One JSONL row of the ``swe`` environment."""
    from megatron_cascade.environments.swe import TOOLS_PROMPT

    pkg, issue, core, (old, new), visible, hidden = task
    names = _exported(core)
    repo = {
        "README.md": f"# {pkg}\n\nA tiny library. Run the tests with `python -m unittest -v`.\n",
        f"{pkg}/__init__.py": "",
        f"{pkg}/core.py": core,
        "tests/__init__.py": "",
        "tests/test_core.py": _test_file(pkg, names, [visible], "TestCore"),
    }
    prompt = (f"Issue in the repository '{pkg}': {issue}\n"
              "Find the bug in the code, fix it, and check with the tests.\n\n" + TOOLS_PROMPT)
    return {"prompt": prompt, "repo": repo,
            "hidden_tests": {"tests/test_hidden.py": _test_file(pkg, names, hidden, "TestHidden")},
            "hidden_test_count": len(hidden),
            "oracle_edits": [{"path": f"{pkg}/core.py", "old": old, "new": new}]}


def check(rows: list[dict]) -> list[str]:
    """Problems of ``rows`` run in the code sandbox (empty: every buggy repo fails and every fix passes)."""
    from megatron_cascade.environments.swe_tools import SandboxRunner, Workspace
    from megatron_cascade.rewards.sandbox import CodeSandbox

    runner = SandboxRunner(CodeSandbox())

    def problem(job: tuple[dict, bool]) -> str | None:
        row, fixed = job
        ws = Workspace.from_repo(row["repo"])
        for edit in row["oracle_edits"] if fixed else []:
            ws.edit(**edit)
        out = runner.run_tests(ws, row["hidden_tests"], ["tests.test_hidden"], 30.0)
        return None if out is not None and out.passed(row["hidden_test_count"]) == fixed else \
            f"{row['prompt'][:40]!r} fixed={fixed}: {out}"

    with ThreadPoolExecutor(max_workers=8) as pool:  # sandbox runs wait on their processes
        found = pool.map(problem, [(row, fixed) for row in rows for fixed in (False, True)])
    return [p for p in found if p is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks.jsonl"))
    parser.add_argument("--check", action="store_true", help="run every task's hidden tests, buggy and fixed")
    args = parser.parse_args()
    rows = [make_row(t) for t in TASKS]
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    print(f"wrote {len(rows)} tasks to {args.out}")
    if args.check:
        problems = check(rows)
        print("\n".join(problems) if problems else "every buggy repo fails its hidden tests; every oracle fix passes")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
