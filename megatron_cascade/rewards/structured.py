"""``structured_output`` reward: the response is JSON that validates against ``sample["schema"]``;
``tool_calling`` reward: an episode's tool calls and final answer against the row's ground truth.

The JSON may be bare or inside a ```json fence (the last fence wins). Validation uses the
``jsonschema`` validator class matching the schema's ``$schema`` (Draft 2020-12 default).
"""

from __future__ import annotations

from typing import Any

import jsonschema

from megatron_cascade.rewards.registry import register_reward, run_in_process
from megatron_cascade.rewards.strict_json import loads_strict

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


def extract_json(response: str) -> Any:
    """Parsed JSON of the response (last fenced block if any); raises ValueError if none (or too deep).

    Standard JSON only (:func:`~megatron_cascade.rewards.strict_json.loads_strict`): ``NaN``,
    ``Infinity``, numbers beyond the float range and duplicate keys are refused.
    """
    blocks = fenced_blocks(response)
    text = blocks[-1] if blocks else response
    return loads_strict(text.strip())


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


def _without_blocks(text: str, open_tag: str, close_tag: str) -> str:
    """``text`` with every ``open_tag ... close_tag`` block removed (an unclosed one to the end)."""
    out, pos = [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        out.append(text[pos:start])
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return "".join(out)
        pos = end + len(close_tag)
    return "".join(out) + text[pos:]


def _final_answer(transcript: str) -> str:
    """The text of the last model turn: after the last tool response, tool-call blocks removed."""
    cut = transcript.rfind("</tool_response>")
    tail = transcript[cut + len("</tool_response>"):] if cut >= 0 else transcript
    return " ".join(_without_blocks(tail, "<tool_call>", "</tool_call>").split())


def _calls_score(transcript: str, expected: list) -> float:
    """Credit of the expected calls over max(expected, made): 1 for a call with the same name and
    equal arguments, 0.5 for the right tool with other arguments (each made call counts once, exact
    matches first); extra and malformed calls only add to the denominator."""
    from megatron_cascade.environments.tool_calls import ToolCall, parse_tool_calls

    made = parse_tool_calls(_without_blocks(transcript, "<tool_response>", "</tool_response>"))
    if not expected:
        return 0.0 if made else 1.0
    for want in expected:
        if not isinstance(want, dict) or not isinstance(want.get("name"), str):
            raise ValueError(f"expected_calls entry {want!r} must be {{'name': str, 'arguments': object}}")
    left = [c for c in made if isinstance(c, ToolCall)]
    credit, unmatched = 0.0, []
    for want in expected:
        hit = next((c for c in left if c.name == want["name"] and c.arguments == want.get("arguments", {})), None)
        if hit is None:
            unmatched.append(want)
        else:
            left.remove(hit)
            credit += 1.0
    for want in unmatched:
        hit = next((c for c in left if c.name == want["name"]), None)
        if hit is not None:
            left.remove(hit)
            credit += 0.5
    return credit / max(len(expected), len(made))


@register_reward("tool_calling")
@run_in_process
def tool_calling_reward(response: str, sample: dict) -> float:
    """Tool use against the row's ground truth: the mean of the parts the row has.

    * ``expected_calls`` (list of ``{"name", "arguments"}``): the calls of the whole episode
      (``<tool_call>`` blocks outside tool responses) matched to them, see ``_calls_score`` (the
      right tool with wrong arguments earns half a call); an empty list expects no call;
    * ``answer``: 1 if the final answer (the text after the last ``</tool_response>``, calls
      removed, whitespace collapsed) equals ``str(answer)``, else 0.

    ``response`` is the episode's transcript after the prompt (model turns and tool responses).
    A row with neither field is the dataset's fault (ValueError: a failed reward, not a 0).
    """
    parts = []
    if "expected_calls" in sample:
        expected = sample["expected_calls"]
        if not isinstance(expected, list):
            raise ValueError("expected_calls must be a list")
        parts.append(_calls_score(response, expected))
    if "answer" in sample:
        parts.append(1.0 if _final_answer(response) == " ".join(str(sample["answer"]).split()) else 0.0)
    if not parts:
        raise ValueError("a tool_calling row needs 'expected_calls' and/or 'answer'")
    return sum(parts) / len(parts)
