"""Reasoning-aware scoring: split a response into its reasoning trace and its final answer.

A reasoning model writes ``<think> ... </think>`` before its answer. Verifiers must see only the
answer: a ``\\boxed{7}`` tried and dropped inside the trace would otherwise count (the math
verifier reads the *last* boxed answer, the code verifier the last fenced program), and a judge
would grade the trace. A response whose reasoning never closed has no answer at all: it scores 0
without calling the verifier and is counted as unfinished (a verdict on the response, not a reward
failure: the sample stays in the loss).

The reasoning is open when the response contains the start marker, or when the prompt itself
ends with it (chat templates that open ``<think>`` for the model, so that the response holds only
the closing marker). A response with neither marker has no reasoning: all of it is the answer.

Markers are matched on the decoded text (``tokenizer.decode(response_ids)``), so they must survive
decoding: added tokens that are not "special" (Qwen3's and Nemotron's ``<think>``), or plain text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

#: The default markers of ``reasoning_parser: think``.
THINK_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class ParsedResponse:
    """A response split by :func:`split_reasoning`.

    Attributes:
        answer: the text the verifier scores ("" when the reasoning is unfinished).
        reasoning: the trace between the markers (without them); "" when there is none.
        finished: False when the reasoning opened and never closed.
    """

    answer: str
    reasoning: str
    finished: bool


def split_reasoning(text: str, start: str = THINK_MARKERS[0], end: str = THINK_MARKERS[1], *,
                    opened_in_prompt: bool = False) -> ParsedResponse:
    """Split ``text`` into reasoning and answer.

    Args:
        text: the decoded response.
        start, end: the markers (non-empty).
        opened_in_prompt: the prompt ends with ``start`` (the trace begins at ``text[0]``).
    Returns:
        The answer is everything after the first ``end`` that follows the opening (leading
        whitespace removed); text before a ``start`` in the response is not part of it.
    """
    begin = 0 if opened_in_prompt else text.find(start)
    if begin < 0:
        close = text.find(end)
        if close < 0:  # no reasoning at all
            return ParsedResponse(text, "", True)
        # A closing marker alone: the template opened the trace where we could not see it.
        return ParsedResponse(text[close + len(end):].lstrip(), text[:close], True)
    body = begin if opened_in_prompt else begin + len(start)
    close = text.find(end, body)
    if close < 0:
        return ParsedResponse("", text[body:], False)
    return ParsedResponse(text[close + len(end):].lstrip(), text[body:close], True)


@dataclass(frozen=True)
class ReasoningParser:
    """The configured parser of one domain (``domains.<d>.reward.reasoning_parser`` and
    ``reasoning_markers``); ``parse`` is what the scorer calls per response."""

    start: str = THINK_MARKERS[0]
    end: str = THINK_MARKERS[1]

    def prompt_opens(self, tokenizer, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends with the start marker (decoded with special tokens kept: a chat
        template may open the trace with an added token). Only the prompt's tail is decoded."""
        tail = tokenizer.decode(list(prompt_ids[-32:]), skip_special_tokens=False)
        return tail.rstrip().endswith(self.start)

    def parse(self, text: str, *, opened_in_prompt: bool = False) -> ParsedResponse:
        """:func:`split_reasoning` with this parser's markers."""
        return split_reasoning(text, self.start, self.end, opened_in_prompt=opened_in_prompt)


def build_reasoning_parser(name: str, markers: Sequence[str]) -> Optional[ReasoningParser]:
    """The parser named by a reward spec: ``none`` -> None (the verifier sees the whole response),
    ``think`` -> a :class:`ReasoningParser` with ``markers`` = [start, end]."""
    if str(name) == "none":
        return None
    if str(name) == "think":
        start, end = markers
        return ReasoningParser(str(start), str(end))
    raise ValueError(f"reasoning_parser={name!r} is not one of ['none', 'think']")
