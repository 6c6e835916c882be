"""Chat-template arguments (the run's ``chat_template_kwargs``): the one check the config, the factory
and :class:`~megatron_cascade.tokenizers.hf.HFTokenizer` share."""

from __future__ import annotations

from typing import Any, Mapping, Optional

#: Parameters of ``transformers``' own ``apply_chat_template`` (and the ``messages`` it hands the
#: template): a chat-template argument of one of these names would collide with what the wrapper
#: passes or change how it renders, so ``chat_template_kwargs`` may not use them.
RESERVED_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_template_kwargs_problem(tokenizer: str, kwargs: Mapping[str, Any]) -> Optional[str]:
    """Why ``kwargs`` cannot be the chat-template arguments of the tokenizer ``tokenizer`` (a spec:
    ``builtin:*`` or a folder), or None when they can."""
    reserved = sorted(RESERVED_TEMPLATE_ARGUMENTS.intersection(kwargs))
    if reserved:
        return (f"chat_template_kwargs {reserved} are arguments of apply_chat_template itself, not chat-template "
                "variables (tools come from each data row's 'tools')")
    # A builtin tokenizer renders in code, without Jinja: the variables would be silently ignored.
    if kwargs and tokenizer.startswith("builtin:"):
        return (f"chat_template_kwargs={dict(kwargs)!r} needs a Hugging Face tokenizer with a Jinja chat template; "
                f"tokenizer={tokenizer!r} has none: remove chat_template_kwargs or set tokenizer to a Hugging Face "
                "tokenizer folder (a builtin tokenizer has no Jinja chat template)")
    return None
