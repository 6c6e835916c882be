"""Observation tokens in the tokenizer's own chat format.

A tool-response turn is rendered by the tokenizer's chat template — a ``tool`` message where the
template has that role (Qwen3, Nemotron: ``<tool_response>`` turns), else, as Qwen3 itself does, a
``user`` turn holding ``<tool_response>\\n...\\n</tool_response>`` blocks (the builtin char
template has no tool role) — and cut from a rendering of the whole conversation after the
assistant's end-of-turn token, followed by the next assistant prefix. Only those new tokens are
appended to the episode: the sampled tokens before them are never re-rendered.
"""

from __future__ import annotations

from typing import Sequence

from megatron_cascade.tokenizers.base import Tokenizer

# A stand-in conversation whose rendering ends with a finished assistant turn; the observation is
# the rendering's continuation after that turn's end-of-turn token.
_BEFORE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def tool_response_block(content: str) -> str:
    """One tool result in the Qwen3/Nemotron tool-response format."""
    return f"<tool_response>\n{content}\n</tool_response>"


def tool_turn_ids(tokenizer: Tokenizer, results: Sequence[str], turn_ended: bool) -> list[int]:
    """Token ids of a tool-response turn carrying ``results`` (one per call, in call order), then the
    assistant prefix of the next model turn.

    Args:
        turn_ended: the model's turn ended with its end-of-turn token (``eos_id``); when it ended on a
            stop string instead, that token is prepended, closing the turn as the template would.
    """
    base = tokenizer.apply_chat_template(_BEFORE, add_generation_prompt=False)
    try:
        full = tokenizer.apply_chat_template(_BEFORE + [{"role": "tool", "content": r} for r in results],
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the template has no tool role (char: ValueError; jinja: TemplateError)
        content = "\n".join(tool_response_block(r) for r in results)
        full = tokenizer.apply_chat_template(_BEFORE + [{"role": "user", "content": content}],
                                             add_generation_prompt=True)
    eos = tokenizer.eos_id
    if eos not in base:
        raise ValueError(f"tokenizer {tokenizer.name!r}: its chat template does not end an assistant turn with "
                         f"the eos token {eos}; cannot tell where an observation starts")
    cut = len(base) - base[::-1].index(eos)
    if full[:cut] != base[:cut]:
        raise ValueError(f"tokenizer {tokenizer.name!r}: its chat template renders earlier turns differently "
                         "once a tool turn follows; observations cannot be appended token by token")
    return ([] if turn_ended else [eos]) + list(full[cut:])
