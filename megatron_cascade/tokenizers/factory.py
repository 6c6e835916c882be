"""``build_tokenizer(spec)``: the one place a tokenizer spec from the config becomes a tokenizer."""

from __future__ import annotations

from megatron_cascade.tokenizers.base import Tokenizer
from megatron_cascade.tokenizers.char import CharTokenizer

_BUILTINS = {"builtin:char": CharTokenizer}


def build_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from ``spec``: ``"builtin:char"`` or a local Hugging Face tokenizer directory."""
    if spec.startswith("builtin:"):
        if spec not in _BUILTINS:
            raise ValueError(f"unknown builtin tokenizer {spec!r}; available: {sorted(_BUILTINS)}")
        return _BUILTINS[spec]()
    from megatron_cascade.tokenizers.hf import HFTokenizer

    return HFTokenizer(spec)
