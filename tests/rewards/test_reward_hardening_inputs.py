"""Issue 13 item 2: no response makes a verifier slow, and no response passes by exploiting a parser.

Linear time: every IFEval instruction, the JSON / code-fence extraction, the multiple-choice and
judge-score patterns get 200K-character adversarial inputs (runs of newlines, spaces, unclosed
brackets and fences) and must finish far below the 1 s a reward is typically allowed. Before, the
quadratic (or cubic) regexes did not finish within pytest's timeout.
"""

from __future__ import annotations

import time

import pytest

from megatron_cascade.rewards import get_reward
from megatron_cascade.rewards.ifeval import INSTRUCTIONS, check_instruction
from megatron_cascade.rewards.multiple_choice import extract_choice
from megatron_cascade.rewards.reward_model import parse_judge_score
from megatron_cascade.rewards.structured import extract_json, fenced_blocks

N = 200_000
LIMIT_S = 0.5  # well under a 1 s reward timeout; linear scans of 200K characters take milliseconds
ADVERSARIAL = {
    "newlines": "\n" * N + "x",
    "blank lines": " \n" * (N // 2) + "x",
    "spaces": "a" + " " * N + "b",
    "unclosed brackets": "[" * N,
    "title openers": "<<" * (N // 2),
    "fences": "```" * (N // 3),
    "fence lines": "```json\n" * (N // 8),
    "stars": "*" * N,
    "star lines": "*\n" * (N // 2),
    "answer then spaces": "answer" + " " * N + "1",
    "score then spaces": "score" + " " * N + "x",
}
KWARGS = {
    "length_constraints:number_words": {"num_words": 5, "relation": "at least"},
    "length_constraints:number_sentences": {"num_sentences": 2, "relation": "less than"},
    "length_constraints:number_paragraphs": {"num_paragraphs": 2},
    "length_constraints:nth_paragraph_first_word": {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "a"},
    "detectable_format:number_bullet_lists": {"num_bullets": 2},
    "detectable_format:number_highlighted_sections": {"num_highlights": 2},
    "detectable_format:multiple_sections": {"section_spliter": "Section", "num_sections": 2},
    "change_case:capital_word_frequency": {"capital_frequency": 2, "capital_relation": "at least"},
    "keywords:existence": {"keywords": ["answer"]},
    "keywords:frequency": {"keyword": "score", "frequency": 2, "relation": "at least"},
    "keywords:forbidden_words": {"forbidden_words": ["answer"]},
    "keywords:letter_frequency": {"letter": "a", "let_frequency": 2, "let_relation": "at least"},
    "startend:end_checker": {"end_phrase": "Any other questions?"},
    "detectable_content:postscript": {"postscript_marker": "P.S."},
    "detectable_content:number_placeholders": {"num_placeholders": 2},
    "combination:repeat_prompt": {"prompt_to_repeat": "Write a poem."},
    "language:response_language": {"language": "en"},
}


def _slow(checks: dict[str, callable], text: str) -> dict[str, float]:
    slow = {}
    for name, check in checks.items():
        start = time.perf_counter()
        check(text)
        seconds = time.perf_counter() - start
        if seconds > LIMIT_S:
            slow[name] = round(seconds, 2)
    return slow


def _ifeval_checks() -> dict[str, callable]:
    return {iid: (lambda text, iid=iid: check_instruction(iid, text, KWARGS.get(iid, {}))) for iid in INSTRUCTIONS}


def _parsers() -> dict[str, callable]:
    def quietly(fn):
        def run(text):
            try:
                fn(text)
            except ValueError:
                pass
        return run

    return {"fenced_blocks": fenced_blocks, "extract_json": quietly(extract_json), "extract_choice": extract_choice,
            "parse_judge_score": quietly(parse_judge_score),
            "structured_output": lambda text: get_reward("structured_output")(text, {"schema": {"type": "object"}})}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_every_ifeval_instruction_is_linear(kind):
    """Before, at 20K characters (10x shorter): placeholders 1.87 s, title 1.44 s, postscript 0.99 s,
    bullet lists 0.78 s, json_format 0.68 s on their worst input, so ~100x that at 200K (pytest's
    timeout). After, at 200K: at most 0.21 s (number_paragraphs on 200K stars: 66K parts)."""
    assert _slow(_ifeval_checks(), ADVERSARIAL[kind]) == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_json_fence_choice_and_judge_parsers_are_linear(kind):
    """Before, at 20K characters: "answer" / "score" + spaces did not finish in 30 s (cubic), the
    fence regex took 0.27 s on backticks (quadratic)."""
    assert _slow(_parsers(), ADVERSARIAL[kind]) == {}


def test_fenced_blocks_match_the_regex_they_replace():
    text = 'a\n```json\n{"x": 1}\n```\nb ```py\nprint()\n``` ```\nlast\n``` tail ```'
    assert fenced_blocks(text) == ['{"x": 1}\n', "print()\n", "last\n"]
    assert fenced_blocks("```json\nno close") == [] and fenced_blocks("``` no newline ```") == []


# -- parsers that let a wrong answer pass ---------------------------------------------------------

BOUNDED = {"type": "object", "properties": {"age": {"type": "number", "minimum": 0, "maximum": 150}},
           "required": ["age"]}


@pytest.mark.parametrize("document", ['{"age": NaN}', '{"age": Infinity}', '{"age": -Infinity}', '{"age": 1e400}',
                                      '```json\n{"age": NaN}\n```'])
def test_non_finite_numbers_do_not_pass_numeric_bounds(document):
    """Before: {"age": NaN} scored 1.0, bare or fenced (NaN compares false with both bounds); Infinity,
    -Infinity and 1e400 (read as inf) each failed one bound only by luck of the schema."""
    assert get_reward("structured_output")(document, {"schema": BOUNDED}) == 0.0
    assert get_reward("structured_output")('{"age": 36.5}', {"schema": BOUNDED}) == 1.0


def test_json_nested_past_the_recursion_limit_scores_zero_not_error():
    """Before: RecursionError, counted as a reward error (the step's error budget), not a wrong answer."""
    deep = "[" * 100_000 + "]" * 100_000
    assert get_reward("structured_output")(deep, {"schema": {"type": "array"}}) == 0.0
    nested = "[" * 990 + "]" * 990  # parses, but validating it recurses deeper than the limit
    assert get_reward("structured_output")(nested, {"schema": {"type": "array", "items": {"$ref": "#"}}}) == 0.0
    assert check_instruction("detectable_format:json_format", deep, {}) is False


@pytest.mark.parametrize("iid", ["change_case:english_lowercase", "change_case:english_capital"])
@pytest.mark.parametrize("text", ["", "   ", "123 456!", "\u4f60\u597d"])
def test_letterless_text_follows_neither_case_instruction(iid, text):
    """Before: "" (and any text without cased letters) satisfied lowercase *and* capital."""
    assert check_instruction(iid, text, {}) is False


def test_case_instructions_still_follow_cased_text():
    assert check_instruction("change_case:english_lowercase", "all lower, 123!", {}) is True
    assert check_instruction("change_case:english_capital", "ALL CAPS, 123!", {}) is True
    assert check_instruction("change_case:english_capital", "ALL CAPS, but", {}) is False
