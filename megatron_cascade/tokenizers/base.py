"""The tokenizer interface the rollout and the trainer rely on, and the vocabulary fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

#: A chat message: ``{"role": "system" | "user" | "assistant", "content": str}``.
Message = Mapping[str, str]


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer of the project offers (built-in and Hugging Face alike).

    Token ids are ints in ``[0, vocab_size)``; the model's embedding may be padded beyond that.
    """

    name: str

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (before the model pads it)."""

    @property
    def eos_id(self) -> int:
        """End-of-sequence (and, in the chat templates, end-of-turn) token id."""

    @property
    def pad_id(self) -> int:
        """Padding token id (never attended to; may equal ``eos_id``)."""

    @property
    def bos_id(self) -> Optional[int]:
        """Beginning-of-sequence token id, or None if the vocabulary has none."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens=False``."""

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
        """Token ids of a conversation, ending with the assistant prefix if ``add_generation_prompt``;
        ``tools``: the JSON schemas of the tools the model may call (a data row's ``tools``)."""

    def fingerprint(self) -> str:
        """Hex digest identifying the vocabulary (see :func:`vocabulary_fingerprint`)."""


def vocabulary_fingerprint(vocab: Mapping[str, int]) -> str:
    """SHA-256 of a ``{token string: id}`` mapping, independent of the mapping's order.

    Two tokenizers with the same fingerprint map every token string to the same id, so the
    log-probs of a teacher and a student are comparable token by token (MOPD checks this).
    """
    canonical = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
