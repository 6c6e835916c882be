"""``structured_output`` reward: the response is JSON that validates against ``sample["schema"]``.

The JSON may be bare or inside a ```json fence (the last fence wins). Validation uses the
``jsonschema`` validator class matching the schema's ``$schema`` (Draft 2020-12 default).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from megatron_cascade.rewards.registry import register_reward, run_in_process

_FENCE = re.compile(r"```(?:json)?[^\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_json(response: str) -> Any:
    """Parsed JSON of the response (last fenced block if any); raises ValueError if none."""
    blocks = _FENCE.findall(response)
    text = blocks[-1] if blocks else response
    return json.loads(text.strip())


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
    except ValueError:
        return 0.0
    return 1.0 if validator.is_valid(document) else 0.0
