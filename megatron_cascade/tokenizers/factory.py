"""``build_tokenizer(spec)``: the one place a tokenizer spec from the config becomes a tokenizer."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_cascade.tokenizers.base import Tokenizer
from megatron_cascade.tokenizers.char import CharTokenizer
from megatron_cascade.config.template_args import chat_template_kwargs_problem

_BUILTINS = {"builtin:char": CharTokenizer}


def build_tokenizer(spec: str, chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> Tokenizer:
    """A tokenizer from ``spec``: ``"builtin:char"`` or a local Hugging Face tokenizer directory.

    ``chat_template_kwargs``: extra variables of a Hugging Face chat template (``enable_thinking``);
    a builtin tokenizer has no Jinja template, so it refuses them rather than ignoring them.
    """
    if spec.startswith("builtin:"):
        if spec not in _BUILTINS:
            raise ValueError(f"unknown builtin tokenizer {spec!r}; available: {sorted(_BUILTINS)}")
        problem = chat_template_kwargs_problem(spec, chat_template_kwargs or {})
        if problem:
            raise ValueError(problem)
        return _BUILTINS[spec]()
    from megatron_cascade.tokenizers.hf import HFTokenizer

    return HFTokenizer(spec, chat_template_kwargs)
