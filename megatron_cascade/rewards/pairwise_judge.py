"""``pairwise_judge`` reward: a generative pairwise reward model judges the responses of a prompt
against each other (or against the row's reference answer); a response's reward is its win rate.

This is a *group reward* (``group_fn``, :mod:`megatron_cascade.rewards.registry`): the rollout
scorer calls it once per prompt with all G responses. ``compare``:

``peers``
    round robin inside the group: every unordered pair (``opponents: 0``), or each response against
    the next ``opponents`` ones cyclically (G * opponents pairs instead of G * (G - 1) / 2). A group
    of one is judged against the reference answer when the row has one.
``reference``
    each response against the row's reference answer (``answer``, else ``reference``).

With ``swap: true`` (default) every pair is judged in both orders, so that the judge's position
bias cancels. A verdict is a win (1), a tie (0.5) or a loss (0) for the response shown first; a
response's reward is the mean of its verdicts. A judgment the server refused for its length (HTTP 413
or a context-length 400) is lost by the longer of its two responses and won by the other (a forfeit:
padding a losing answer past the judge's context must not turn a loss into an invalid sample); a
response that lost every judgment that way is a response fault (scored 0, a verdict). A judgment
whose call failed otherwise (server down, deadline, oversized or malformed reply, no verdict in the
text, a reference answer too long) is left out; a response left with no verdict at all is an invalid
sample (its exception is returned: scored 0, flagged, never a crash).

Transport: the hardened client of ``reward_model`` (:class:`RewardModelClient`, OpenAI-compatible
``POST {url}/v1/chat/completions``): ``timeout_s`` is the total deadline of one attempt,
``max_reply_bytes`` caps the reply, ``max_retries`` with exponential backoff, no redirects, the API
key from the environment variable ``api_key_env``. Judgments run on ``concurrency`` threads.

The conversation shown to the judge is the row's ``messages`` rendered in full (``[role]`` headers),
or its ``prompt``.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from megatron_cascade.rewards.http_transport import RequestTooLongError
from megatron_cascade.rewards.registry import register_reward
from megatron_cascade.rewards.reward_model import RewardModelClient, too_long_fault

DEFAULT_PAIRWISE_TEMPLATE = (
    "You compare two assistant responses to the same conversation.\n\n"
    "Conversation:\n{prompt}\n\n[Response A]\n{response_a}\n[End of response A]\n\n"
    "[Response B]\n{response_b}\n[End of response B]\n\n"
    "Which response is more helpful, correct and harmless? Reason briefly, then end with a final line "
    "'Winner: A', 'Winner: B' or 'Winner: tie'."
)
# One \s* per distinct token (as reward_model's _SCORE_LINE: no ambiguous runs of spaces).
_VERDICT = re.compile(r"winner\s*(?:[:=]\s*)?(?:\*+\s*)?(?:\[+\s*)?(a|b|tie)\b", re.IGNORECASE)
_VERDICT_VALUE = {"a": 1.0, "b": 0.0, "tie": 0.5}
_COMPARE = ("peers", "reference")


def parse_verdict(text: str) -> float:
    """The last ``Winner: A|B|tie`` of a judge reply as the first response's result: 1, 0 or 0.5.

    Raises:
        ValueError: the reply holds no verdict.
    """
    matches = _VERDICT.findall(text)
    if not matches:
        raise ValueError(f"no verdict ('Winner: A|B|tie') in judge reply: {text[:200]!r}")
    return _VERDICT_VALUE[matches[-1].lower()]


def render_conversation(sample: dict) -> str:
    """The conversation the judge reads: every message of ``sample["messages"]`` under a ``[role]``
    header, else ``sample["prompt"]``."""
    messages = sample.get("messages")
    if isinstance(messages, list) and messages:
        return "\n\n".join(f"[{m.get('role', '?')}]\n{m.get('content', '')}" for m in messages if isinstance(m, dict))
    return str(sample.get("prompt", ""))


def reference_answer(sample: dict) -> str | None:
    """The row's reference answer (``answer``, else ``reference``), or None."""
    for key in ("answer", "reference"):
        value = sample.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def pairs_for(n: int, compare: str, opponents: int, has_reference: bool) -> list[tuple[int, int]]:
    """Comparisons of a group of ``n``: (i, j) with j a response index or -1 for the reference."""
    if compare == "reference" or (n == 1 and has_reference):
        return [(i, -1) for i in range(n)]
    if opponents <= 0 or opponents >= n - 1:
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    pairs = {tuple(sorted((i, (i + d) % n))) for i in range(n) for d in range(1, opponents + 1)}
    return sorted(pairs)


def _judge(client: RewardModelClient, template: str, conversation: str, first: str, second: str) -> float:
    content = template.format(prompt=conversation, response_a=first, response_b=second)
    return parse_verdict(client.chat(content))


def judge_group(responses: Sequence[str], sample: dict, *, client: RewardModelClient, template: str,
                compare: str = "peers", opponents: int = 0, swap: bool = True,
                concurrency: int = 16) -> list[float | BaseException]:
    """Win rate in [0, 1] per response (see the module docstring); a response without a single
    successful judgment gets the exception of its first failed one."""
    reference = reference_answer(sample)
    if compare == "reference" and reference is None:
        return [ValueError("pairwise_judge compare=reference: the row has no 'answer' or 'reference'")] * len(responses)
    if compare == "peers" and len(responses) < 2 and reference is None:
        return [ValueError("pairwise_judge compare=peers: a group of one and no reference answer in the row")] \
            * len(responses)
    conversation = render_conversation(sample)
    text = lambda k: reference if k < 0 else responses[k]  # noqa: E731
    jobs = [(i, j) for i, j in pairs_for(len(responses), compare, opponents, reference is not None)]
    jobs += [(j, i) for i, j in jobs] if swap else []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(jobs)))) as pool:
        outcomes = list(pool.map(lambda job: _safe(_judge, client, template, conversation, text(job[0]), text(job[1])),
                                 jobs))
    verdicts: list[list[float]] = [[] for _ in responses]
    failures: list[list[BaseException]] = [[] for _ in responses]
    forfeits: list[list[BaseException]] = [[] for _ in responses]  # judgments lost by being too long
    for (a, b), outcome in zip(jobs, outcomes):
        if isinstance(outcome, RequestTooLongError):
            longer = a if len(text(a)) >= len(text(b)) else b
            if longer >= 0:  # a response made the judgment too long: it loses, the other wins
                forfeits[longer].append(too_long_fault(outcome))
                outcome = 0.0 if longer == a else 1.0
        failed = isinstance(outcome, BaseException)
        for k, value in ((a, outcome), (b, outcome if failed else 1.0 - outcome)):
            if k >= 0:  # the reference (-1) has no reward
                (failures if failed else verdicts)[k].append(value)
    return [forfeits[k][0] if v and len(forfeits[k]) == len(v) else sum(v) / len(v) if v else failures[k][0]
            for k, v in enumerate(verdicts)]


def _safe(fn, *args: Any) -> float | BaseException:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed judgment is that comparison's error, never the group's crash
        return e


def _client(kwargs: dict[str, Any]) -> RewardModelClient:
    names = ("url", "timeout_s", "max_retries", "backoff_s", "model", "api_key_env", "max_reply_bytes")
    return RewardModelClient(mode="chat", **{k: kwargs[k] for k in names if kwargs.get(k) is not None})


def _validate_kwargs(kwargs: dict[str, Any]) -> None:
    """Build-time check (:func:`megatron_cascade.rewards.registry.build_reward`): ValueError naming the kwarg."""
    _client(kwargs)
    compare, opponents = kwargs.get("compare", "peers"), kwargs.get("opponents", 0)
    if compare not in _COMPARE:
        raise ValueError(f"compare must be one of {list(_COMPARE)}, got {compare!r}")
    if not isinstance(opponents, int) or isinstance(opponents, bool) or opponents < 0:
        raise ValueError(f"opponents must be an integer >= 0 (0 = every peer), got {opponents!r}")
    if not isinstance(kwargs.get("swap", True), bool):
        raise ValueError(f"swap must be true or false, got {kwargs['swap']!r}")
    concurrency = kwargs.get("concurrency", 16)
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    template = kwargs.get("judge_template") or DEFAULT_PAIRWISE_TEMPLATE
    try:
        template.format(prompt="", response_a="", response_b="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"judge_template may only use {{prompt}}, {{response_a}}, {{response_b}}: {e!r}") from None
    if "{response_a}" not in template or "{response_b}" not in template:
        raise ValueError("judge_template must show both {response_a} and {response_b}")


def pairwise_judge_group(responses: Sequence[str], sample: dict, **kwargs: Any) -> list[float | BaseException]:
    """Group form of :func:`pairwise_judge_reward` (the scorer's call per prompt)."""
    return judge_group(list(responses), sample, client=_client(kwargs),
                       template=kwargs.get("judge_template") or DEFAULT_PAIRWISE_TEMPLATE,
                       compare=kwargs.get("compare", "peers"), opponents=kwargs.get("opponents", 0),
                       swap=kwargs.get("swap", True), concurrency=kwargs.get("concurrency", 16))


@register_reward("pairwise_judge")
def pairwise_judge_reward(response: str, sample: dict, *, url: str, compare: str = "peers", opponents: int = 0,
                          swap: bool = True, concurrency: int = 16, timeout_s: float = 60.0, max_retries: int = 3,
                          backoff_s: float = 0.5, model: str = "judge", judge_template: str | None = None,
                          api_key_env: str | None = None, max_reply_bytes: int = 2**20) -> float:
    """One response alone: a group of one (judged against the row's reference answer)."""
    kwargs = {k: v for k, v in locals().items() if k not in ("response", "sample")}
    result = pairwise_judge_group([response], sample, **kwargs)[0]
    if isinstance(result, BaseException):
        raise result
    return result


pairwise_judge_reward.group_fn = pairwise_judge_group  # type: ignore[attr-defined]
pairwise_judge_reward.validate_kwargs = _validate_kwargs  # type: ignore[attr-defined]
