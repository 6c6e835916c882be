"""``instruction_following`` reward: IFEval-style verifiable instruction checkers.

``sample["instructions"]`` is a list of ``{"id": ..., "kwargs": {...}}`` with the
instruction ids and kwarg names of Google's IFEval (``instructions_registry.py``). This is
an independent implementation of the same semantics (word counting by ``\\w+`` tokens
instead of NLTK). Kwargs whose value is None are ignored (IFEval datasets store every
instruction's kwargs in one flattened, null-padded dict).

``language:response_language`` needs the optional ``langdetect`` package; without it the
id is reported as unsupported. An unknown id raises :class:`UnknownInstructionError`
naming the id and listing the supported ones.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from megatron_cascade.rewards.registry import register_reward, run_in_process
from megatron_cascade.rewards.strict_json import loads_strict

Checker = Callable[..., bool]
INSTRUCTIONS: dict[str, Checker] = {}
_RELATIONS = ("less than", "at least")


class UnknownInstructionError(KeyError):
    """An instruction id without a checker."""


def _instruction(instruction_id: str) -> Callable[[Checker], Checker]:
    def deco(fn: Checker) -> Checker:
        INSTRUCTIONS[instruction_id] = fn
        return fn

    return deco


def _compare(value: int, relation: str, threshold: int) -> bool:
    if relation == "less than":
        return value < threshold
    if relation == "at least":
        return value >= threshold
    raise ValueError(f"relation must be one of {_RELATIONS}, got {relation!r}")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n+", text.strip())
    return [p for p in parts if re.search(r"\w", p)]


@_instruction("length_constraints:number_words")
def number_words(text: str, *, num_words: int, relation: str) -> bool:
    return _compare(len(_words(text)), relation, int(num_words))


@_instruction("length_constraints:number_sentences")
def number_sentences(text: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(len(_sentences(text)), relation, int(num_sentences))


def _star_paragraphs(text: str) -> list[str] | None:
    """Paragraphs separated by ``***``; None when one in the middle is empty."""
    parts = [p.strip() for p in re.split(r"\s?\*\*\*\s?", text)]
    inner = parts[1:-1]
    if any(not p for p in inner):
        return None
    return [p for p in parts if p]


@_instruction("length_constraints:number_paragraphs")
def number_paragraphs(text: str, *, num_paragraphs: int) -> bool:
    paragraphs = _star_paragraphs(text)
    return paragraphs is not None and len(paragraphs) == int(num_paragraphs)


@_instruction("length_constraints:nth_paragraph_first_word")
def nth_paragraph_first_word(text: str, *, num_paragraphs: int, nth_paragraph: int,
                             first_word: str) -> bool:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(paragraphs) != int(num_paragraphs) or not 1 <= int(nth_paragraph) <= len(paragraphs):
        return False
    words = paragraphs[int(nth_paragraph) - 1].split()
    first = re.sub(r"[^\w]", "", words[0]).lower() if words else ""
    return first == first_word.strip().lower()


@_instruction("detectable_format:json_format")
def json_format(text: str) -> bool:
    # String operations, as Google's IFEval: the regex r"\s*```$" was quadratic in whitespace runs.
    body = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    body = body.removesuffix("```").strip()
    try:
        loads_strict(body)  # duplicate keys, NaN and "[[[[..." deeper than the recursion limit: not JSON
    except ValueError:
        return False
    return True


@_instruction("detectable_format:number_bullet_lists")
def number_bullet_lists(text: str, *, num_bullets: int) -> bool:
    # Lines whose first non-blank character is "*" (not "**") or "-": IFEval's r"^\s*\*[^\*].*$" and
    # r"^\s*-.*$", line by line. Those regexes let \s* run across newlines, which made them quadratic.
    bodies = [line.lstrip() for line in text.split("\n")]
    count = sum(body.startswith("-") for body in bodies)
    i = 0
    while i < len(bodies):
        if bodies[i] == "*" and i + 1 < len(bodies):  # IFEval's [^\*] takes the newline, .* the next line
            count, i = count + 1, i + 2
            continue
        count += len(bodies[i]) > 1 and bodies[i][0] == "*" and bodies[i][1] != "*"
        i += 1
    return count == int(num_bullets)


@_instruction("detectable_format:title")
def title(text: str) -> bool:
    # IFEval's r"<<[^\n]+>>" spans a line's first "<<" to its last ">>"; found without the regex,
    # which rescanned the line from every "<<" ("<<<<...": quadratic).
    for line in text.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if 0 <= start and end > start + 2 and line[start + 2:end].lstrip("<").rstrip(">").strip():
            return True
    return False


@_instruction("detectable_format:number_highlighted_sections")
def number_highlighted_sections(text: str, *, num_highlights: int) -> bool:
    singles = re.findall(r"\*[^\n\*]*\*", text)
    doubles = re.findall(r"\*\*[^\n\*]*\*\*", text)
    count = sum(1 for h in singles if h.strip("*").strip())
    count += sum(1 for h in doubles if h.removeprefix("**").removesuffix("**").strip())
    return count >= int(num_highlights)


@_instruction("detectable_format:multiple_sections")
def multiple_sections(text: str, *, section_spliter: str, num_sections: int) -> bool:
    # "spliter" is IFEval's spelling of the kwarg.
    pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(pattern, text)) - 1 >= int(num_sections)


@_instruction("detectable_format:constrained_response")
def constrained_response(text: str) -> bool:
    options = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
    return any(option in text.strip() for option in options)


@_instruction("change_case:english_lowercase")
def english_lowercase(text: str) -> bool:
    # str.islower needs at least one cased letter: "" or "123" follow neither case instruction
    # (Google's IFEval); text == text.lower() accepted them for both.
    return text.islower()


@_instruction("change_case:english_capital")
def english_capital(text: str) -> bool:
    return text.isupper()


@_instruction("change_case:capital_word_frequency")
def capital_word_frequency(text: str, *, capital_frequency: int, capital_relation: str) -> bool:
    capitals = [w for w in re.findall(r"\b\w+\b", text) if w.isupper()]
    return _compare(len(capitals), capital_relation, int(capital_frequency))


@_instruction("keywords:existence")
def keyword_existence(text: str, *, keywords: list[str]) -> bool:
    return all(re.search(re.escape(k), text, flags=re.IGNORECASE) for k in keywords)


@_instruction("keywords:frequency")
def keyword_frequency(text: str, *, keyword: str, frequency: int, relation: str) -> bool:
    count = len(re.findall(re.escape(keyword), text, flags=re.IGNORECASE))
    return _compare(count, relation, int(frequency))


@_instruction("keywords:forbidden_words")
def forbidden_words(text: str, *, forbidden_words: list[str]) -> bool:
    return not any(re.search(r"\b" + re.escape(w) + r"\b", text, flags=re.IGNORECASE)
                   for w in forbidden_words)


@_instruction("keywords:letter_frequency")
def letter_frequency(text: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    return _compare(text.lower().count(letter.lower()), let_relation, int(let_frequency))


@_instruction("punctuation:no_comma")
def no_comma(text: str) -> bool:
    return "," not in text


@_instruction("startend:end_checker")
def end_checker(text: str, *, end_phrase: str) -> bool:
    return text.strip().lower().endswith(end_phrase.strip().lower())


@_instruction("startend:quotation")
def quotation(text: str) -> bool:
    body = text.strip()
    return len(body) > 1 and body[0] == '"' and body[-1] == '"'


@_instruction("detectable_content:postscript")
def postscript(text: str, *, postscript_marker: str) -> bool:
    marker = postscript_marker.strip()
    # IFEval's patterns began with r"\s*", which changes nothing in a search but rescanned every
    # whitespace run from each of its characters (quadratic); dropped.
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\..*$"
    else:
        pattern = re.escape(marker.lower()) + r".*$"
    return re.search(pattern, text.lower(), flags=re.MULTILINE) is not None


def _count_bracketed(text: str) -> int:
    """Matches of IFEval's r"\[.*?\]" (a "[" up to the next "]" on its line, non-overlapping),
    counted in one pass: the regex rescanned a line from each unclosed "[" (quadratic)."""
    count = 0
    for line in text.split("\n"):
        start = line.find("[")
        while start >= 0:
            end = line.find("]", start + 1)
            if end < 0:
                break  # no "]" after this "[", so none after a later one either
            count += 1
            start = line.find("[", end + 1)
    return count


@_instruction("detectable_content:number_placeholders")
def number_placeholders(text: str, *, num_placeholders: int) -> bool:
    return _count_bracketed(text) >= int(num_placeholders)


@_instruction("combination:repeat_prompt")
def repeat_prompt(text: str, *, prompt_to_repeat: str) -> bool:
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


@_instruction("combination:two_responses")
def two_responses(text: str) -> bool:
    parts = [p.strip() for p in text.split("******")]
    valid = [p for p in parts if p]
    if len(valid) != 2 or any(not p for p in parts[1:-1]):
        return False
    return valid[0] != valid[1]


try:  # optional language identification
    import langdetect  # type: ignore[import-not-found]
except ImportError:
    langdetect = None
    UNSUPPORTED = {"language:response_language": "needs the optional 'langdetect' package"}
else:
    UNSUPPORTED = {}

    @_instruction("language:response_language")
    def response_language(text: str, *, language: str) -> bool:
        try:
            return langdetect.detect(text) == language
        except langdetect.LangDetectException:
            return True  # IFEval counts undetectable text as following


def check_instruction(instruction_id: str, response: str, kwargs: dict[str, Any] | None) -> bool:
    """Whether ``response`` follows one instruction.

    Raises:
        UnknownInstructionError: ``instruction_id`` has no checker (message lists the
            supported ids, and why the id is unsupported when known).
        TypeError: a kwarg name is wrong or a required one is missing.
    """
    checker = INSTRUCTIONS.get(instruction_id)
    if checker is None:
        reason = UNSUPPORTED.get(instruction_id, "unknown instruction id")
        raise UnknownInstructionError(
            f"instruction {instruction_id!r} is not supported ({reason}); "
            f"supported: {sorted(INSTRUCTIONS)}")
    clean = {k: v for k, v in (kwargs or {}).items() if v is not None}
    return bool(checker(response, **clean))


@register_reward("instruction_following")
@run_in_process
def instruction_following_reward(response: str, sample: dict, *, all_or_nothing: bool = False) -> float:
    """Fraction of ``sample["instructions"]`` followed (1.0/0.0 with ``all_or_nothing``)."""
    instructions = sample.get("instructions")
    if not isinstance(instructions, list) or not instructions:
        # A row without instructions would score 1.0 for any response (and inflate eval): a bad row,
        # counted as a reward error for its samples only.
        raise ValueError(f"row has no instructions (a non-empty list), got {instructions!r}")
    followed = [check_instruction(i["id"], response, i.get("kwargs")) for i in instructions]
    if all_or_nothing:
        return float(all(followed))
    return sum(followed) / len(followed)
