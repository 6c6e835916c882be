"""Each IFEval instruction with a following and a violating response."""

from __future__ import annotations

import pytest

from megatron_cascade.rewards import build_reward, get_reward, score_batch
from megatron_cascade.rewards.ifeval import INSTRUCTIONS, UNSUPPORTED, UnknownInstructionError

LT, AL = "less than", "at least"
CASES = [
    ("length_constraints:number_words", {"relation": LT, "num_words": 5}, "one two three", "one two three four five"),
    ("length_constraints:number_words", {"relation": AL, "num_words": 3}, "one two three", "one two"),
    ("length_constraints:number_sentences", {"relation": AL, "num_sentences": 2}, "Hi there. Bye now!", "Just one."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First.\n***\nSecond.", "First.\n\nSecond."),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
     "Intro.\n\nThen more.", "Intro.\n\nAnd more."),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", "* one\n* two\n- three"),
    ("detectable_format:title", {}, "<<My Title>>\nText", "My Title\nText"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* only"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nfoo\nSection 2\nbar", "Section 1\nfoo"),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("change_case:english_lowercase", {}, "all lower case", "Not lower"),
    ("change_case:english_capital", {}, "ALL CAPS", "Not Caps"),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": AL},
     "THIS is VERY good", "THIS is good"),
    ("keywords:existence", {"keywords": ["apple", "pear"]}, "An Apple and a pear", "An apple"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AL}, "cat and cat", "one cat"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "a badge is fine", "this is bad"),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": LT}, "zoo", "zizz"),
    ("punctuation:no_comma", {}, "no comma here", "a, b"),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. Any other questions?  ",
     "Any other questions? Done."),
    ("startend:quotation", {}, '"quoted text"', 'quoted "text"'),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Body.\nP.S. bye", "Body only."),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Body.\nP.P.S bye", "Body.\nP.S. bye"),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] at [address]", "[name] only"),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "Write a poem. Roses...", "Roses..."),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
]


def test_at_least_twenty_supported():
    assert len(INSTRUCTIONS) >= 20
    assert {c[0] for c in CASES} == set(INSTRUCTIONS)  # every checker is tested


@pytest.mark.parametrize("iid,kwargs,good,bad", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_instruction(iid, kwargs, good, bad):
    reward = get_reward("instruction_following")
    sample = {"instructions": [{"id": iid, "kwargs": kwargs}]}
    assert reward(good, sample) == 1.0
    assert reward(bad, sample) == 0.0


def test_fraction_and_all_or_nothing():
    sample = {"instructions": [{"id": "punctuation:no_comma", "kwargs": {}},
                               {"id": "change_case:english_capital", "kwargs": None}]}
    assert get_reward("instruction_following")("lower, case", sample) == 0.0
    assert get_reward("instruction_following")("lower case", sample) == 0.5
    assert build_reward("instruction_following", {"all_or_nothing": True})("lower case", sample) == 0.0


def test_null_kwargs_are_ignored():
    sample = {"instructions": [{"id": "punctuation:no_comma", "kwargs": {"num_words": None}}]}
    assert get_reward("instruction_following")("ok", sample) == 1.0


def test_unknown_instruction_is_a_clear_error():
    sample = {"instructions": [{"id": "made_up:thing", "kwargs": {}}]}
    with pytest.raises(UnknownInstructionError) as info:
        get_reward("instruction_following")("x", sample)
    assert "made_up:thing" in str(info.value) and "punctuation:no_comma" in str(info.value)
    scores, errors = score_batch(get_reward("instruction_following"), ["x"], [sample])
    assert scores == [0.0] and errors == 1


def test_language_unsupported_or_working():
    sample = {"instructions": [{"id": "language:response_language", "kwargs": {"language": "en"}}]}
    if "language:response_language" in UNSUPPORTED:
        with pytest.raises(UnknownInstructionError, match="langdetect"):
            get_reward("instruction_following")("Hello there, friend.", sample)
    else:
        assert get_reward("instruction_following")("Hello there, my good friend.", sample) == 1.0


@pytest.mark.parametrize("instructions", [None, [], "detectable_format:title"])
def test_a_row_without_instructions_is_an_error_not_a_free_one(instructions):
    """Before, ``instructions: null`` or ``[]`` scored 1.0 for any response."""
    from megatron_cascade.rewards.ifeval import instruction_following_reward

    with pytest.raises(ValueError, match="row has no instructions"):
        instruction_following_reward("anything", {"instructions": instructions})
