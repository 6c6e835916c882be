"""A Hugging Face tokenizer loaded from a local directory (offline), behind the project interface."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from megatron_cascade.tokenizers.base import Message, vocabulary_fingerprint


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded with ``local_files_only=True`` (never downloads).

    ``vocab_size`` is ``len(tokenizer)``: the base vocabulary plus added tokens, i.e. every id the
    tokenizer can produce. ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has no eos token; set eos_token in its tokenizer_config.json")
        self.name = os.path.abspath(path)

    @property
    def hf_tokenizer(self):
        """The underlying ``transformers`` tokenizer."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def bos_id(self) -> Optional[int]:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no BOS: chat templates add their own)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered by the tokenizer's own ``chat_template``."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"tokenizer {self.name!r} has no chat_template (tokenizer_config.json)")
        # Render to text, then encode: the return type of tokenize=True differs across transformers
        # versions (list vs BatchEncoding); the text path is the same in all of them.
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text)

    def fingerprint(self) -> str:
        return vocabulary_fingerprint(self._tok.get_vocab())
