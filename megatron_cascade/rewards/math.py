"""``math`` reward: symbolic equivalence of the final answer with ``sample["answer"]``.

The final answer is the last ``\\boxed{...}`` of the response; without one, math-verify's
own extraction (last LaTeX / plain expression) is used, then the tail of the last line.
Equivalence is decided by ``math_verify.verify`` (SymPy), so ``1/2``, ``0.5`` and
``\\frac{1}{2}`` all match.

Timeouts: math-verify implements its own (5 s) with ``signal.alarm``, which only works in
the main thread (elsewhere it raises ValueError): we pass them only in the main thread and
disable them (``None``) elsewhere. Batch scoring runs this reward in the main thread of a
killable worker process (:mod:`megatron_cascade.rewards.isolation`), so both hold there: the
5 s alarms end most runaway SymPy evaluations (``\boxed{2^{2^{32}}}``: 0 after ~5 s, < 300 MB),
and the item's ``timeout_s`` kills the process when they cannot fire.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from math_verify import parse, verify

from megatron_cascade.rewards.registry import register_reward, run_in_process

# math-verify logs a warning each time timeouts are disabled; that is our intent here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_TAIL_SPLIT = re.compile(r"(?:answer is|answer:|=|:)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_latex(expr: str) -> list[Any]:
    return parse(f"${expr}$", parsing_timeout=_timeout())


def parse_gold(answer: Any) -> list[Any]:
    """Parse the reference answer (plain, LaTeX, or already ``$``-delimited)."""
    text = str(answer).strip()
    if "$" in text or "\\boxed" in text:
        return parse(text, parsing_timeout=_timeout())
    return _parse_latex(text)


def parse_prediction(response: str) -> list[Any]:
    """Extract and parse the final answer of ``response``; [] when there is none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return _parse_latex(boxed)
    parsed = parse(response, parsing_timeout=_timeout())
    if parsed:
        return parsed
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    if not lines:
        return []
    parts = _TAIL_SPLIT.split(lines[-1])
    # "... answer is x+1" -> "x+1"; without a marker, the last word ("Thus x+1" -> "x+1").
    tail = parts[-1] if len(parts) > 1 else lines[-1].split()[-1]
    tail = tail.strip().rstrip(".")
    return _parse_latex(tail) if tail else []


def is_equivalent(response: str, answer: Any) -> bool:
    """Whether the final answer of ``response`` is mathematically equal to ``answer``."""
    gold, pred = parse_gold(answer), parse_prediction(response)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


@register_reward("math")
@run_in_process
def math_reward(response: str, sample: dict) -> float:
    """1.0 if the final answer equals ``sample["answer"]`` symbolically, else 0.0."""
    return 1.0 if is_equivalent(response, sample["answer"]) else 0.0
