"""The environment protocol of multi-turn rollouts, and the registry of environments.

An *episode* starts from a data row whose prompt the data loader already tokenised. Then, turn after
turn, the model acts (samples until its end-of-turn token, a stop string or the turn's token budget)
and the environment answers with an *observation*: token ids appended to the episode as they are,
never a re-rendering of the conversation, so the tokens trained on are exactly the sampled ones.
The episode ends when the environment says ``done``, or at the turn / token budget of the domain's
``environment`` config. Its score is the domain's reward of the episode's transcript (every token
after the prompt, decoded) plus the turn rewards the environment returned.

Only model-sampled tokens enter the loss; observation tokens are context (loss mask 0, inference
log-prob 0). Today's single-turn rewards are the environment ``single_turn`` (done after the first
turn), the default of every domain, so their configs do not change.

An environment is a class registered with :func:`register_environment` (or a dotted path
``pkg.module:Class``), built once per stage with the tokenizer and the domain's
``environment.kwargs``. ``step`` runs in a worker thread with a deadline (``environment.step_timeout_s``):
it may block on a tool or a test run; one that overruns ends its episode with score 0 while the
others go on. ``start``/``step``/``finish`` of different episodes run concurrently: keep per-episode
data in the state ``start`` returns, not on the environment.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from megatron_cascade.tokenizers.base import Tokenizer


@dataclass
class EnvStep:
    """The environment's answer to one model turn.

    Attributes:
        observation_ids: token ids appended after the model's turn (a tool-response turn and the
            next assistant prefix, e.g. via :func:`megatron_cascade.environments.chat.tool_turn_ids`);
            never trained on. Ignored when ``done``.
        done: the episode is over (no further model turn).
        reward: this turn's reward, added to the episode's score (0 for end-of-episode-only rewards).
        metrics: per-turn counts summed over the step's episodes and logged as ``episode/<key>_mean``
            (per episode), e.g. ``tool_calls``, ``tool_calls_ok``.
    """

    observation_ids: list[int] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class of an environment (see the module docstring for the episode's life).

    Subclasses take the tokenizer and their config kwargs (keyword-only, the ``environment.kwargs``
    of the domain) in ``__init__``, and override :meth:`step` (and :meth:`start`, :meth:`finish`
    when an episode holds resources, e.g. a workspace).

    Attributes:
        name: the registry name (set by :func:`register_environment`).
        stop_strings: strings that also end a model turn (besides the tokenizer's end-of-turn
            ``eos`` and ``rollout.stop_strings``), e.g. ``"</tool_call>"``.
        one_turn: every episode ends after the model's first turn, without a ``step`` call (the
            single-turn rewards: scored the moment the response finishes, while others decode).
        metric_names: the ``EnvStep.metrics`` keys it reports (logged as ``episode/<key>_mean``;
            declared so that every data-parallel rank sums the same keys).
    """

    name: ClassVar[str] = ""
    stop_strings: ClassVar[tuple[str, ...]] = ()
    one_turn: ClassVar[bool] = False
    metric_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def check_row(cls, row: dict, kwargs: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` when the data ``row`` cannot start an episode of this environment
        built with ``kwargs`` (the domain's ``environment.kwargs``). Called for every row when the data
        loads (the run's preflight, each stage's start), so a bad row is a data error before any
        step, not a failed episode. Default: any row."""

    def start(self, row: dict) -> Any:
        """Per-episode state for the data ``row`` (default: the row itself)."""
        return row

    def step(self, state: Any, action_ids: Sequence[int], action_text: str) -> EnvStep:
        """Answer one model turn: ``action_ids`` are the sampled tokens of the turn (its end-of-turn
        token included when sampled), ``action_text`` their decoding. May block (runs in a worker
        thread with a deadline). Raise :class:`~megatron_cascade.rewards.outcome.ResponseFault` when
        the turn itself makes the step impossible (the episode ends scoring 0, a verdict); any other
        exception makes the episode's reward an error (invalid sample)."""
        raise NotImplementedError

    def finish(self, state: Any) -> None:
        """Release what ``start`` acquired; called once per episode, also after a timeout or error
        (then possibly while an abandoned ``step`` still runs)."""


ENVIRONMENTS: dict[str, type[Environment]] = {}
# Built-in environments, imported when first named (importing the registry stays cheap).
_BUILTIN_MODULES = {
    "single_turn": "megatron_cascade.environments.single_turn",
    "tool_calling": "megatron_cascade.environments.tool_env",
    "swe": "megatron_cascade.environments.swe",
}


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: register an :class:`Environment` subclass under ``name``."""

    def deco(cls: type[Environment]) -> type[Environment]:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"environment {name!r} must be a subclass of Environment")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls

    return deco


def _lookup(name: str) -> type[Environment]:
    if name not in ENVIRONMENTS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise KeyError(f"unknown environment {name!r}: not registered and not a 'pkg.module:Class' path; "
                       f"registered: {sorted(set(ENVIRONMENTS) | set(_BUILTIN_MODULES))}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise TypeError(f"environment {name!r} is not a subclass of megatron_cascade.environments.Environment")
    return obj


def row_checker(name: str, kwargs: Mapping[str, Any] | None) -> Callable[[dict], None]:
    """``check_row`` of environment ``name`` bound to ``kwargs`` (KeyError/TypeError: unknown name)."""
    cls, kwargs = _lookup(name), dict(kwargs or {})
    return lambda row: cls.check_row(row, kwargs)


def build_environment(name: str, kwargs: Mapping[str, Any] | None, tokenizer: Tokenizer) -> Environment:
    """Environment ``name`` (registered or ``pkg.module:Class``) built with the tokenizer and ``kwargs``.

    Raises:
        KeyError: unknown name. TypeError: a kwarg the class does not take, or a required one
            missing (the message lists the valid ones).
    """
    cls = _lookup(name)
    kwargs = dict(kwargs or {})
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, tokenizer
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name: p for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    unknown = sorted(set(kwargs) - set(named))
    if unknown and not accepts_any:
        raise TypeError(f"environment {name!r}: unknown kwarg(s) {unknown}; valid kwargs: {sorted(named)}")
    missing = sorted(k for k, p in named.items() if p.default is inspect.Parameter.empty and k not in kwargs)
    if missing:
        raise TypeError(f"environment {name!r}: missing required kwarg(s) {missing}")
    return cls(tokenizer, **kwargs)
