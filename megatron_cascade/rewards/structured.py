"""``structured_output`` reward: the response is JSON that validates against ``sample["schema"]``.

The JSON may be bare or inside a ```json fence (the last fence wins). Validation uses the
``jsonschema`` validator class matching the schema's ``$schema`` (Draft 2020-12 default).
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema

from megatron_cascade.rewards.registry import register_reward, run_in_process

def fenced_blocks(text: str) -> list[str]:
    """Contents of the ```-fenced blocks of ``text``: from the line after an opening fence (its info
    string, e.g. ``json``, ignored) to the next fence. One pass: the regex
    r"```[^\n]*\n(.*?)```" rescanned the text from every unclosed fence (quadratic)."""
    blocks, pos = [], 0
    while True:
        start = text.find("```", pos)
        line_end = text.find("\n", start + 3) if start >= 0 else -1
        end = text.find("```", line_end + 1) if line_end >= 0 else -1
        if end < 0:  # no later fence could open a block with a closing fence either
            return blocks
        blocks.append(text[line_end + 1:end])
        pos = end + 3


def _reject_non_finite(token: str) -> Any:
    raise ValueError(f"{token} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):  # 1e400: Python would read inf, which passes every maximum
        raise ValueError(f"number {token[:40]} is out of the float range")
    return value


def extract_json(response: str) -> Any:
    """Parsed JSON of the response (last fenced block if any); raises ValueError if none (or too deep).

    Standard JSON only: ``NaN``, ``Infinity`` and numbers beyond the float range are refused
    (Python's json accepts them, and NaN compares false with every bound, so ``{"age": NaN}``
    satisfied ``minimum``/``maximum``).
    """
    blocks = fenced_blocks(response)
    text = blocks[-1] if blocks else response
    try:
        return json.loads(text.strip(), parse_constant=_reject_non_finite, parse_float=_finite_float)
    except RecursionError as e:  # "[[[[...": a property of the response, not a failure of the reward
        raise ValueError("JSON nested deeper than Python's recursion limit") from e


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)  # a broken schema is the dataset's fault: raise, count as error
    return cls(schema)


@register_reward("structured_output")
@run_in_process
def structured_output_reward(response: str, sample: dict) -> float:
    """1.0 if the response parses as JSON and validates against ``sample["schema"]``."""
    validator = _validator(sample["schema"])
    try:
        document = extract_json(response)
        return 1.0 if validator.is_valid(document) else 0.0
    except (ValueError, RecursionError):  # not JSON, or too deep to validate: the response's fault
        return 0.0
