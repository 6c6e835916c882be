"""When a response is finished: stop tokens, stop strings, length budgets."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_cascade.rollout.batch import FinishReason
from megatron_cascade.rollout.params import SamplingParams
from megatron_cascade.tokenizers.base import Tokenizer

# A UTF-8 character spans at most 4 byte-fallback tokens: a stop string of L characters lies within
# the last 4 * L + 1 tokens of the response when its final token was just sampled.
_TOKENS_PER_CHAR = 4


class StopCriteria:
    """Decides after each sampled token whether a response is finished, and why."""

    def __init__(self, params: SamplingParams, tokenizer: Optional[Tokenizer]) -> None:
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and tokenizer is not None:
            self.stop_ids.add(tokenizer.eos_id)
        self.stop_strings = params.stop_strings
        if self.stop_strings and tokenizer is None:
            raise ValueError("SamplingParams.stop_strings needs a tokenizer (to decode responses)")
        self.tokenizer = tokenizer
        # Decoding only a tail of the response keeps the check O(1) per token instead of O(length).
        self.window = _TOKENS_PER_CHAR * max((len(s) for s in self.stop_strings), default=0) + 1

    def check(self, response_ids: Sequence[int], budget: int) -> Optional[FinishReason]:
        """"stop", "length" or None (not finished) for a response whose last token was just added.

        ``budget`` is the most tokens this response may have (``max_new_tokens`` or what the
        model's maximum sequence length leaves after the prompt).
        """
        if response_ids[-1] in self.stop_ids or self._ends_with_stop_string(response_ids):
            return "stop"
        if len(response_ids) >= budget:
            return "length"
        return None

    def _ends_with_stop_string(self, response_ids: Sequence[int]) -> bool:
        if not self.stop_strings:
            return False
        tail = self.tokenizer.decode(list(response_ids[-self.window:]))
        # A match anywhere in the tail is new: an older one would have finished the response earlier.
        return any(s in tail for s in self.stop_strings)
