"""JSON as RFC 8259 means it, for judging what a model wrote.

Python's ``json`` accepts ``NaN``/``Infinity`` (NaN compares false with every bound, so ``{"age": NaN}``
passed ``minimum``/``maximum``), reads ``1e400`` as infinity, and keeps the *last* of duplicate keys
(``{"answer": "wrong", "answer": "right"}`` shows a grader one value and a human reader another). Here
each of those, and nesting deeper than the recursion limit, is a ``ValueError``: text that is not
clean JSON is not JSON to a verifier.
"""

from __future__ import annotations

import json
import math
from typing import Any


def loads_strict(text: str) -> Any:
    """``json.loads(text)``, refusing duplicate keys, NaN / Infinity, numbers beyond the float range
    and nesting deeper than Python's recursion limit (``ValueError`` naming the problem)."""
    try:
        return json.loads(text, parse_constant=_reject_non_finite, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except RecursionError as e:  # "[[[[...": a property of the text, not a failure of the verifier
        raise ValueError("JSON nested deeper than Python's recursion limit") from e


def _reject_non_finite(token: str) -> Any:
    raise ValueError(f"{token} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):  # 1e400: Python would read inf, which passes every maximum
        raise ValueError(f"number {token[:40]} is out of the float range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:40]!r} in a JSON object")
        out[key] = value
    return out
