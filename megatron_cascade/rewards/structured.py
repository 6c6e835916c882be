"""``structured_output`` reward: the response is JSON that validates against ``sample["schema"]``;
``tool_calling`` reward: an episode's tool calls and final answer against the row's ground truth.

The JSON may be bare or inside a ```json fence (the last fence wins). Validation uses the
``jsonschema`` validator class matching the schema's ``$schema`` (Draft 2020-12 default).
"""

from __future__ import annotations

from typing import Any

import jsonschema

from megatron_cascade.rewards.registry import EPISODE_RECORD, register_reward, run_in_process
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


def _episode_record(sample: dict) -> tuple[list[str], str]:
    """The model's turns and its last turn's answer, from the runner's record of the episode
    (``sample[EPISODE_RECORD]``, see ``environments.episode.episode_record``)."""
    record = sample.get(EPISODE_RECORD)
    turns = record.get("model_turns") if isinstance(record, dict) else None
    last = record.get("last_turn_answer") if isinstance(record, dict) else None
    if not (isinstance(turns, list) and all(isinstance(t, str) for t in turns) and isinstance(last, str)):
        raise ValueError(f"the tool_calling reward scores episodes: sample[{EPISODE_RECORD!r}] must hold the "
                         f"runner's record {{'model_turns': [str, ...], 'last_turn_answer': str}}")
    return turns, last


def _calls_score(turns: list[str], expected: list) -> float:
    """Credit of the expected calls over max(expected, made): 1 for a call with the same name and
    equal arguments, 0.5 for the right tool with other arguments (each made call counts once, exact
    matches first); extra and malformed calls only add to the denominator. ``made``: the calls of
    every model turn, parsed as the environment parsed them (text the model wrote to look like a
    tool response hides none)."""
    from megatron_cascade.rewards.tool_calls import ToolCall, parse_tool_calls

    made = [call for turn in turns for call in parse_tool_calls(turn)]
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

    * ``expected_calls`` (list of ``{"name", "arguments"}``): the calls of the whole episode's model
      turns matched to them, see ``_calls_score`` (the right tool with wrong arguments earns half a
      call); an empty list expects no call;
    * ``answer``: 1 if the final answer (the last model turn — after its reasoning where the domain
      has a reasoning parser —, calls removed, whitespace collapsed) equals ``str(answer)``, else 0.

    Read from the runner's record of the episode (``sample[EPISODE_RECORD]["model_turns"]``), never
    from ``response`` (the transcript, in which a model can write a fake ``<tool_response>`` that
    hides its calls or moves its final answer). A row with neither field, or a sample without the
    record, is the setup's fault (ValueError: a failed reward, not a 0).
    """
    turns, last_answer = _episode_record(sample)
    parts = []
    if "expected_calls" in sample:
        expected = sample["expected_calls"]
        if not isinstance(expected, list):
            raise ValueError("expected_calls must be a list")
        parts.append(_calls_score(turns, expected))
    if "answer" in sample:
        final = " ".join(_without_blocks(last_answer, "<tool_call>", "</tool_call>").split())
        parts.append(1.0 if final == " ".join(str(sample["answer"]).split()) else 0.0)
    if not parts:
        raise ValueError("a tool_calling row needs 'expected_calls' and/or 'answer'")
    return sum(parts) / len(parts)
