"""``multiple_choice`` reward: the chosen option letter equals ``sample["answer"]``.

The choice is, by priority: the last ``\\boxed{X}``; the last "Answer: X" / "answer is X"
(optionally ``(X)``); else a final standalone letter such as ``(C)`` or ``C.`` at the very
end of the response. Letters are compared in upper case (lower-case letters only count inside ``\\boxed``); ``sample["choices"]`` (the
number of options or a list of them) optionally restricts the valid letters (default A-J).
"""

from __future__ import annotations

import re
import string

from megatron_cascade.rewards.registry import register_reward, run_in_process

_PATTERNS = (
    re.compile(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}"),
    # Outside \boxed only capitals count: "the answer is a bit unclear" is not "A".
    # Each \s* follows a different token: r"\s*(?:is|:)?\s*:?\s*" split one run of spaces three ways,
    # cubic in its length ("answer" + 200K spaces never finished).
    re.compile(r"(?i:answer)\s*(?:(?:is|:)\s*)?(?::\s*)?\(?\*{0,2}([A-Z])\b\)?"),
    re.compile(r"(?:^|\s)\(?([A-Z])[\).]?\s*$"),
)


def _valid_letters(sample: dict) -> str:
    choices = sample.get("choices")
    n = choices if isinstance(choices, int) else len(choices) if choices else 10
    return string.ascii_uppercase[:n]


def extract_choice(response: str, valid: str = string.ascii_uppercase[:10]) -> str | None:
    """The chosen letter (upper case), or None when no valid choice is found."""
    for pattern in _PATTERNS:
        letters = [m.upper() for m in pattern.findall(response) if m.upper() in valid]
        if letters:
            return letters[-1]
    return None


@register_reward("multiple_choice")
@run_in_process
def multiple_choice_reward(response: str, sample: dict) -> float:
    """1.0 if the chosen letter equals ``sample["answer"]``, else 0.0."""
    choice = extract_choice(response, _valid_letters(sample))
    return 1.0 if choice is not None and choice == str(sample["answer"]).strip().upper() else 0.0
