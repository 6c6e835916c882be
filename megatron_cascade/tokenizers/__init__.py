"""Tokenizers: a built-in character tokenizer for tiny models and local Hugging Face tokenizers."""

from megatron_cascade.tokenizers.base import Message, Tokenizer, vocabulary_fingerprint
from megatron_cascade.tokenizers.char import CharTokenizer
from megatron_cascade.tokenizers.factory import build_tokenizer
from megatron_cascade.tokenizers.hf import HFTokenizer

__all__ = ["Tokenizer", "Message", "vocabulary_fingerprint", "CharTokenizer", "HFTokenizer", "build_tokenizer"]
