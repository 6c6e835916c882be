"""A Hugging Face tokenizer loaded from a local directory (offline), behind the project interface."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

from megatron_cascade.tokenizers.base import Message, vocabulary_fingerprint
from megatron_cascade.config.template_args import chat_template_kwargs_problem


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded with ``local_files_only=True`` (never downloads).

    ``vocab_size`` is ``len(tokenizer)``: the base vocabulary plus added tokens, i.e. every id the
    tokenizer can produce. ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token.

    ``chat_template_kwargs`` (the run's ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``)
    are extra variables of the Jinja chat template, passed to every rendering: prompts and tool turns
    must be rendered alike, so they belong to the tokenizer, not to each call.
    """

    def __init__(self, path: str, chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        from transformers import AutoTokenizer

        problem = chat_template_kwargs_problem(path, chat_template_kwargs or {})
        if problem:
            raise ValueError(problem)
        self.chat_template_kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
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

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
        """Token ids of the conversation rendered by the tokenizer's own ``chat_template``, with the
        tool schemas ``tools`` (the template places them, e.g. in its system turn) and the tokenizer's
        ``chat_template_kwargs``."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"tokenizer {self.name!r} has no chat_template (tokenizer_config.json)")
        # Render to text, then encode: the return type of tokenize=True differs across transformers
        # versions (list vs BatchEncoding); the text path is the same in all of them.
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=add_generation_prompt, tokenize=False, **self.chat_template_kwargs,
        )
        return self.encode(text)

    def fingerprint(self) -> str:
        # The vocabulary only: chat_template_kwargs change how prompts are rendered, not what an id means,
        # so a teacher and a student rendering with different kwargs still compare log-probs token by token.
        return vocabulary_fingerprint(self._tok.get_vocab())
