"""``reward_model`` reward: HTTP client for an external reward model or LLM judge.

Two server protocols (``mode``):

``score``
    ``POST {url}/score`` with ``{"prompt": str, "response": str}`` -> ``{"score": float}``;
    batched form: ``{"prompts": [...], "responses": [...]}`` -> ``{"scores": [...]}``
    (``batch_size`` items per request). Scores are mapped from ``score_range`` to [0, 1].
``chat``
    OpenAI-compatible ``POST {url}/v1/chat/completions``: the judge prompt
    (``judge_template`` with ``{prompt}``, ``{response}``, ``{reference}``) is sent as one
    user message; the last "score: N" (else the last number) of the reply, divided by
    ``max_score``, is the reward. Requests of a batch run on ``batch_size`` threads.

Transport: stdlib ``urllib`` (no extra dependency). ``timeout_s`` is the socket timeout
per attempt (connect / each read, seconds). Connection errors, timeouts, HTTP 429 and 5xx
are retried ``max_retries`` times with exponential backoff (``backoff_s * 2**attempt``);
other HTTP errors and malformed replies raise at once. An API key, if needed, is read
from the environment variable named by ``api_key_env`` (never put keys in YAML).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from megatron_cascade.rewards.registry import register_reward

logger = logging.getLogger(__name__)

DEFAULT_JUDGE_TEMPLATE = (
    "You are a strict grader. Rate the response to the prompt on a scale of 0 to 10.\n\n"
    "Prompt:\n{prompt}\n\nReference answer (may be empty):\n{reference}\n\n"
    "Response:\n{response}\n\nReply with your reasoning, then a final line 'Score: N'."
)
# Each \s* follows a different token (r"\s*[:=]?\s*\**\s*" split one run of spaces three ways: cubic).
_SCORE_LINE = re.compile(r"score\s*(?:[:=]\s*)?(?:\*+\s*)?(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RetryableError(RuntimeError):
    """A transient failure (timeout, connection error, HTTP 429/5xx)."""


@dataclass(frozen=True)
class RewardModelClient:
    """Client for a reward/judge server; see the module docstring for the protocols."""

    url: str
    mode: Literal["score", "chat"] = "score"
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    batch_size: int = 16
    model: str = "judge"
    judge_template: str = DEFAULT_JUDGE_TEMPLATE
    max_score: float = 10.0
    score_range: tuple[float, float] = (0.0, 1.0)
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("score", "chat"):
            raise ValueError(f"mode must be 'score' or 'chat', got {self.mode!r}")
        if self.batch_size < 1 or self.max_retries < 0 or self.timeout_s <= 0:
            raise ValueError("need batch_size >= 1, max_retries >= 0, timeout_s > 0")

    # -- public -----------------------------------------------------------------------
    def score(self, prompt: str, response: str, reference: str = "") -> float:
        """Reward in [0, 1] for one response; raises after the retries are exhausted."""
        result = self.score_many([prompt], [response], [reference])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def score_many(self, prompts: Sequence[str], responses: Sequence[str],
                   references: Sequence[str] | None = None) -> list[float | BaseException]:
        """Rewards for many responses; a failed item is returned as its exception."""
        refs = list(references) if references is not None else [""] * len(prompts)
        if self.mode == "score":
            return self._score_mode(list(prompts), list(responses))
        with ThreadPoolExecutor(max_workers=self.batch_size) as pool:
            return list(pool.map(self._chat_one_safe, prompts, responses, refs))

    # -- score mode -------------------------------------------------------------------
    def _score_mode(self, prompts: list[str], responses: list[str]) -> list[float | BaseException]:
        out: list[float | BaseException] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk_p = prompts[start:start + self.batch_size]
            chunk_r = responses[start:start + self.batch_size]
            try:
                out.extend(self._post_score_chunk(chunk_p, chunk_r))
            except Exception as e:  # the whole chunk failed
                out.extend([e] * len(chunk_p))
        return out

    def _post_score_chunk(self, prompts: list[str], responses: list[str]) -> list[float]:
        if len(prompts) == 1:
            reply = self._post("/score", {"prompt": prompts[0], "response": responses[0]})
            return [self._normalize(_field(reply, "score"))]
        reply = self._post("/score", {"prompts": prompts, "responses": responses})
        scores = _field(reply, "scores")
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise ValueError(f"expected {len(prompts)} scores, got {scores!r:.200}")
        return [self._normalize(s) for s in scores]

    def _normalize(self, raw: Any) -> float:
        lo, hi = self.score_range
        value = float(raw)
        return min(1.0, max(0.0, (value - lo) / (hi - lo)))

    # -- chat mode --------------------------------------------------------------------
    def _chat_one_safe(self, prompt: str, response: str, reference: str) -> float | BaseException:
        try:
            return self._chat_one(prompt, response, reference)
        except Exception as e:
            return e

    def _chat_one(self, prompt: str, response: str, reference: str) -> float:
        content = self.judge_template.format(prompt=prompt, response=response, reference=reference)
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "temperature": 0.0}
        reply = self._post("/v1/chat/completions", body)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"malformed chat completion: {str(reply)[:200]}") from e
        return min(1.0, max(0.0, parse_judge_score(text) / self.max_score))

    # -- transport --------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> Any:
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post_once(path, body)
            except RetryableError as e:
                last = e
                logger.info("reward model %s%s attempt %d failed: %s", self.url, path,
                            attempt + 1, e)
        raise RuntimeError(f"reward model {self.url}{path} failed after "
                           f"{self.max_retries + 1} attempts: {last}") from last

    def _post_once(self, path: str, body: dict) -> Any:
        request = urllib.request.Request(self.url.rstrip("/") + path,
                                         data=json.dumps(body).encode(), method="POST",
                                         headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 429 or e.code >= 500:
                raise RetryableError(f"HTTP {e.code}") from e
            raise
        except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as e:
            raise RetryableError(str(e)) from e
        try:
            return json.loads(payload)
        except ValueError as e:
            raise ValueError(f"reply is not JSON: {payload[:200]!r}") from e

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers


def _field(reply: Any, name: str) -> Any:
    if not isinstance(reply, dict) or name not in reply:
        raise ValueError(f"reply lacks {name!r}: {str(reply)[:200]}")
    return reply[name]


def parse_judge_score(text: str) -> float:
    """The last "Score: N" in a judge reply, else its last number; ValueError if none."""
    matches = _SCORE_LINE.findall(text) or _NUMBER.findall(text)
    if not matches:
        raise ValueError(f"no score in judge reply: {text[:200]!r}")
    return float(matches[-1])


def _client(kwargs: dict[str, Any]) -> RewardModelClient:
    if "score_range" in kwargs:
        kwargs = {**kwargs, "score_range": tuple(kwargs["score_range"])}  # YAML gives a list
    return RewardModelClient(**{k: v for k, v in kwargs.items() if v is not None})


@register_reward("reward_model")
def reward_model_reward(response: str, sample: dict, *, url: str, mode: str = "score",
                        timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                        batch_size: int = 16, model: str = "judge",
                        judge_template: str | None = None, max_score: float = 10.0,
                        score_range: Sequence[float] = (0.0, 1.0),
                        api_key_env: str | None = None) -> float:
    """Score via an external server; kwargs are :class:`RewardModelClient` fields.

    Uses ``sample["prompt"]`` and, for the judge template, ``sample.get("answer")``.
    """
    result = reward_model_batch([response], [sample], **_local_kwargs(locals()))[0]
    if isinstance(result, BaseException):
        raise result
    return result


def reward_model_batch(responses: Sequence[str], samples: Sequence[dict], **kwargs: Any
                       ) -> list[float | BaseException]:
    """Batch form of :func:`reward_model_reward` (one request per ``batch_size`` in score mode)."""
    client = _client(kwargs)
    prompts = [str(s.get("prompt", "")) for s in samples]
    refs = [str(s.get("answer", "") or "") for s in samples]
    return client.score_many(prompts, list(responses), refs)


def _local_kwargs(local_vars: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in local_vars.items() if k not in ("response", "sample")}


reward_model_reward.batch_fn = reward_model_batch  # type: ignore[attr-defined]
