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

Transport (:mod:`megatron_cascade.rewards.http_transport`, stdlib only): ``timeout_s`` is the
total deadline of one attempt in seconds, from connecting to the reply's last byte (a server
trickling bytes is cut off at it); a reply larger than ``max_reply_bytes`` is refused without
being read whole; redirects are never followed, so the API key never goes to another host.
Connection errors, deadlines, HTTP 429 and 5xx are retried ``max_retries`` times with
exponential backoff (``backoff_s * 2**attempt``), so one call takes at most about
``(max_retries + 1) * timeout_s`` plus the backoff; other HTTP errors, redirects, oversized and
malformed replies raise at once. In score mode a request of several items rejected by the server
(HTTP 4xx) is retried item by item, so that one bad response fails alone. A request of one response
refused for its length (HTTP 413, or a context-length 400) is that response's fault: it scores 0 as a
verdict (:class:`~megatron_cascade.rewards.outcome.ResponseFault`), never an invalid sample a policy
could escape into by padding. An API key, if needed,
is read from the environment variable named by ``api_key_env`` (never put keys in YAML).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import urllib.error
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from megatron_cascade.config.rules import MAX_TIMEOUT_S
from megatron_cascade.rewards.http_transport import RequestTooLongError, RetryableError, post_json
from megatron_cascade.rewards.outcome import ResponseFault
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
    max_reply_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        """Raises ValueError naming the field (a reward kwarg of the same name) and the value."""
        checks = [
            ("url", urllib.parse.urlsplit(str(self.url)).scheme in ("http", "https")
             and bool(urllib.parse.urlsplit(str(self.url)).netloc), "an http:// or https:// URL"),
            ("mode", self.mode in ("score", "chat"), "'score' or 'chat'"),
            ("timeout_s", _finite(self.timeout_s) and 0 < self.timeout_s <= MAX_TIMEOUT_S,
             f"in (0, {MAX_TIMEOUT_S:g}] seconds"),
            ("max_retries", isinstance(self.max_retries, int) and self.max_retries >= 0, "an integer >= 0"),
            ("backoff_s", _finite(self.backoff_s) and self.backoff_s >= 0, ">= 0 seconds"),
            ("batch_size", isinstance(self.batch_size, int) and self.batch_size >= 1, "an integer >= 1"),
            ("max_score", _finite(self.max_score) and self.max_score > 0, "> 0"),
            ("score_range", len(self.score_range) == 2 and all(map(_finite, self.score_range))
             and self.score_range[0] < self.score_range[1], "[low, high] with low < high"),
            ("max_reply_bytes", isinstance(self.max_reply_bytes, int) and self.max_reply_bytes >= 1,
             "an integer >= 1 (bytes)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"reward_model: {name} must be {expected}, got {getattr(self, name)!r}")

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
            out.extend(self._score_chunk(chunk_p, chunk_r))
        return out

    def _score_chunk(self, prompts: list[str], responses: list[str]) -> list[float | BaseException]:
        try:
            return self._post_score_chunk(prompts, responses)
        except (urllib.error.HTTPError, RequestTooLongError) as e:
            if len(prompts) == 1:
                return [too_long_fault(e) if isinstance(e, RequestTooLongError) else e]
            # The server refused this request (4xx): most likely one item of it (too long, bad
            # text). Item by item, so that it fails alone and the others keep their scores.
            logger.info("reward model %s refused a batch of %d (%s); scoring its items one by one",
                        self.url, len(prompts), e)
            return [v for p, r in zip(prompts, responses) for v in self._score_chunk([p], [r])]
        except Exception as e:  # noqa: BLE001 - server down, deadline, bad reply: the whole chunk failed
            return [e] * len(prompts)

    def _post_score_chunk(self, prompts: list[str], responses: list[str]) -> list[float | BaseException]:
        if len(prompts) == 1:
            reply = self._post("/score", {"prompt": prompts[0], "response": responses[0]})
            return [self._normalize(_field(reply, "score"))]
        reply = self._post("/score", {"prompts": prompts, "responses": responses})
        scores = _field(reply, "scores")
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise ValueError(f"expected {len(prompts)} scores, got {scores!r:.200}")
        return [self._normalize_or_error(s) for s in scores]

    def _normalize_or_error(self, raw: Any) -> float | BaseException:
        try:
            return self._normalize(raw)
        except (TypeError, ValueError) as e:  # one malformed score fails its item only
            return e

    def _normalize(self, raw: Any) -> float:
        lo, hi = self.score_range
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError(f"non-finite score {raw!r} from the reward model")
        return min(1.0, max(0.0, (value - lo) / (hi - lo)))

    # -- chat mode --------------------------------------------------------------------
    def _chat_one_safe(self, prompt: str, response: str, reference: str) -> float | BaseException:
        try:
            return self._chat_one(prompt, response, reference)
        except RequestTooLongError as e:
            return too_long_fault(e)
        except Exception as e:
            return e

    def _chat_one(self, prompt: str, response: str, reference: str) -> float:
        content = self.judge_template.format(prompt=prompt, response=response, reference=reference)
        return min(1.0, max(0.0, parse_judge_score(self.chat(content)) / self.max_score))

    def chat(self, content: str) -> str:
        """The judge's reply text to one user message ``content`` (``POST {url}/v1/chat/completions``,
        temperature 0), with this client's deadline, size cap and retries.

        Raises:
            RuntimeError: retries exhausted; ValueError: a reply that is not a chat completion with
            string content; see :func:`~megatron_cascade.rewards.http_transport.post_json` for the rest.
        """
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "temperature": 0.0}
        reply = self._post("/v1/chat/completions", body)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"malformed chat completion: {str(reply)[:200]}") from e
        if not isinstance(text, str):
            raise ValueError(f"malformed chat completion: content is {type(text).__name__}, not a string")
        return text

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
        return post_json(self.url.rstrip("/") + path, body, headers=self._headers(), timeout_s=self.timeout_s,
                         max_reply_bytes=self.max_reply_bytes)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers


def too_long_fault(error: RequestTooLongError) -> ResponseFault:
    """A request holding one response refused for its length: the response's fault (scored 0)."""
    fault = ResponseFault(f"the response made the request too long for the reward server ({error})")
    fault.__cause__ = error
    return fault


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
                        api_key_env: str | None = None, max_reply_bytes: int = 16 * 2**20) -> float:
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


def _validate_kwargs(kwargs: dict[str, Any]) -> None:
    """Build-time check of the reward's kwargs (:func:`megatron_cascade.rewards.registry.build_reward`)."""
    _client(dict(kwargs))


reward_model_reward.validate_kwargs = _validate_kwargs  # type: ignore[attr-defined]
