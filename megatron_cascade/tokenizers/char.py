"""A character-level tokenizer for the tiny CPU models (tests, the demo); no files needed.

Vocabulary (103 ids, so a model pads it to 128): 6 special tokens, then newline, tab and the 95
printable ASCII characters. The chat template is::

    <bos> <|system|> text <eos> <|user|> text <eos> <|assistant|> text <eos> ... [<|assistant|>]

i.e. every turn ends with ``<eos>``, so a sampled ``<eos>`` ends the assistant's answer.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from megatron_cascade.tokenizers.base import Message, vocabulary_fingerprint

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>")
CHARACTERS = "\n\t" + "".join(chr(c) for c in range(32, 127))
ROLES = ("system", "user", "assistant")


class CharTokenizer:
    """Character-level tokenizer over printable ASCII plus newline and tab (spec ``builtin:char``)."""

    name = "builtin:char"

    def __init__(self) -> None:
        self._tokens: list[str] = list(SPECIAL_TOKENS) + list(CHARACTERS)
        self._ids = {tok: i for i, tok in enumerate(self._tokens)}
        self._num_special = len(SPECIAL_TOKENS)
        self._char_set = frozenset(CHARACTERS)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return self._ids["<pad>"]

    @property
    def bos_id(self) -> Optional[int]:
        return self._ids["<bos>"]

    @property
    def eos_id(self) -> int:
        return self._ids["<eos>"]

    def role_id(self, role: str) -> int:
        """Id of the single special token that opens a turn of ``role``."""
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {list(ROLES)}")
        return self._ids[f"<|{role}|>"]

    def encode(self, text: str) -> list[int]:
        """One id per character. Special-token strings in ``text`` are plain characters here.

        Raises ``ValueError`` for a character outside the vocabulary (non-ASCII, control characters).
        """
        # Only the character range is looked up: "<eos>" typed as text is five characters.
        return [self._ids[ch] if ch in self._char_set else self._unknown(ch) for ch in text]

    @staticmethod
    def _unknown(ch: str) -> int:
        raise ValueError(f"character {ch!r} (U+{ord(ch):04X}) is not in the builtin:char vocabulary "
                         "(printable ASCII, newline and tab)")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary (model padding) raise ``ValueError``."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._tokens):
                raise ValueError(f"token id {i} is outside the builtin:char vocabulary [0, {len(self._tokens)})")
            if i < self._num_special and skip_special_tokens:
                continue
            out.append(self._tokens[i])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
        """``<bos>`` then ``<|role|> content <eos>`` per message, then ``<|assistant|>`` if asked.

        ``tools`` are not rendered: this template has no place for schemas; prompts for the tiny
        models name their tools in the prompt text, and stay as the models were trained on them.
        """
        ids = [self.bos_id]
        for message in messages:
            ids.append(self.role_id(message["role"]))
            ids.extend(self.encode(message["content"]))
            ids.append(self.eos_id)
        if add_generation_prompt:
            ids.append(self.role_id("assistant"))
        return ids

    def fingerprint(self) -> str:
        return vocabulary_fingerprint(self._ids)
