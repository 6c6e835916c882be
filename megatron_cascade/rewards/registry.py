"""Reward registry: names (or dotted import paths) -> plain reward functions.

A reward function has the signature ``fn(response: str, sample: dict, **kwargs) -> float``
and returns a score in [0, 1]. Keyword-only parameters are its configuration, set from
YAML specs such as ``{name: code, kwargs: {timeout_s: 5, partial: false}}`` via
:func:`build_reward`. A function may carry a ``batch_fn`` attribute with the signature
``batch_fn(responses, samples, **kwargs) -> list[float | BaseException]``; batch scoring
(:func:`megatron_cascade.rewards.scoring.score_batch`) then uses it, e.g. to run many
programs on one sandbox pool or to send one HTTP request per batch.

A *group reward* carries ``group_fn(responses, sample, **kwargs) -> list[float | BaseException]``:
the rollout scorer calls it once per prompt with all G responses of that prompt (a pairwise judge
compares them with each other), see :func:`is_group_reward` / :func:`score_group`; called with one
response (``fn(response, sample)``) it scores a group of one.

In an episode's ``sample`` (the data row), the runner sets ``sample[EPISODE_RECORD]``:
``{"model_turns": [text of each model turn, as its environment read it]}``. A reward that must
tell the model's writing from the environment's (which calls were made) reads it, never the
transcript: a model can write text that looks like a tool response. A data row may not hold the
key (refused when the data loads).

A reward marked with :func:`run_in_process` (every built-in verifier) is scored in a worker
process that is killed at its deadline (:mod:`megatron_cascade.rewards.isolation`): CPU-bound
parsing such as SymPy's can hold the GIL for minutes, and a thread cannot be stopped.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

EPISODE_RECORD = "episode"  # the runner's record of an episode in the reward's ``sample``

RewardFn = Callable[..., float]
BatchFn = Callable[..., "list[float | BaseException]"]

REWARDS: dict[str, RewardFn] = {}
# Modules that register the built-in rewards; imported lazily so that importing the
# registry stays cheap and a broken optional dependency only breaks its own reward.
_BUILTIN_MODULES = {
    "math": "megatron_cascade.rewards.math",
    "code": "megatron_cascade.rewards.code",
    "instruction_following": "megatron_cascade.rewards.ifeval",
    "structured_output": "megatron_cascade.rewards.structured",
    "tool_calling": "megatron_cascade.rewards.structured",
    "multiple_choice": "megatron_cascade.rewards.multiple_choice",
    "reward_model": "megatron_cascade.rewards.reward_model",
    "pairwise_judge": "megatron_cascade.rewards.pairwise_judge",
    "environment": "megatron_cascade.rewards.environment",
}


class Reward(Protocol):
    """What :func:`get_reward` / :func:`build_reward` return."""

    def __call__(self, response: str, sample: dict) -> float: ...


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name`` in :data:`REWARDS` (re-registering replaces)."""

    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def run_in_process(fn: RewardFn) -> RewardFn:
    """Decorator: score ``fn`` in a killable worker process instead of a thread (batch scoring,
    :class:`megatron_cascade.rewards.scoring.ScoringPool`). For CPU-bound pure-Python rewards; ``fn``
    must be importable by name (module level) and its arguments and result picklable."""
    fn.run_in_process = True  # type: ignore[attr-defined]
    return fn


def runs_in_process(reward: Callable[..., Any]) -> bool:
    """Whether ``reward`` (a function or a :class:`BoundReward`) is marked :func:`run_in_process`."""
    return bool(getattr(getattr(reward, "fn", reward), "run_in_process", False))


@dataclass(frozen=True)
class BoundReward:
    """A reward function with its configuration kwargs bound."""

    name: str
    fn: RewardFn
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, response: str, sample: dict) -> float:
        return float(self.fn(response, sample, **self.kwargs))

    @property
    def has_batch(self) -> bool:
        """Whether the underlying reward has a native batch implementation."""
        return getattr(self.fn, "batch_fn", None) is not None

    @property
    def has_group(self) -> bool:
        """Whether the underlying reward scores a prompt's responses together (``group_fn``)."""
        return getattr(self.fn, "group_fn", None) is not None

    def group(self, responses: Sequence[str], sample: dict) -> list[float | BaseException]:
        """Score all responses of one prompt together; per-item exceptions are returned, not raised."""
        group_fn = getattr(self.fn, "group_fn", None)
        if group_fn is None:
            raise TypeError(f"reward {self.name!r} is not a group reward")
        return group_fn(list(responses), sample, **self.kwargs)

    def batch(self, responses: Sequence[str], samples: Sequence[dict]) -> list[float | BaseException]:
        """Score many responses; per-item exceptions are returned, not raised."""
        batch_fn = getattr(self.fn, "batch_fn", None)
        if batch_fn is None:
            raise TypeError(f"reward {self.name!r} has no batch implementation")
        return batch_fn(responses, samples, **self.kwargs)


def is_group_reward(reward: Callable[..., Any]) -> bool:
    """Whether ``reward`` (a function or a :class:`BoundReward`) scores a prompt's group at once."""
    return getattr(getattr(reward, "fn", reward), "group_fn", None) is not None


def score_group(reward: Callable[..., Any], responses: Sequence[str], sample: dict) -> list[float | BaseException]:
    """Call group reward ``reward`` on the responses of one prompt (its ``sample`` row)."""
    if isinstance(reward, BoundReward):
        return reward.group(responses, sample)
    return reward.group_fn(list(responses), sample)


def _import_dotted(path: str) -> RewardFn:
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise KeyError(f"unknown reward {path!r}: not registered and not a dotted path; "
                       f"registered: {sorted(set(REWARDS) | set(_BUILTIN_MODULES))}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward {path!r} is not callable")
    return obj


def _lookup(name: str) -> RewardFn:
    if name not in REWARDS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in REWARDS:
        return REWARDS[name]
    return _import_dotted(name)


def get_reward(name: str) -> BoundReward:
    """Reward ``name`` with default configuration, as ``(response, sample) -> float``.

    ``name`` is a registered name (built-ins: ``math``, ``code``, ``instruction_following``,
    ``structured_output``, ``multiple_choice``, ``reward_model``) or an import path
    ``"pkg.mod:func"`` / ``"pkg.mod.func"``.
    """
    return build_reward(name, {})


def _config_params(fn: RewardFn) -> tuple[set[str], set[str], bool]:
    """Configurable parameter names of ``fn``, the required ones, and whether it takes ``**kw``."""
    params = list(inspect.signature(fn).parameters.values())[2:]  # skip response, sample
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p for p in params
             if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required = {p.name for p in named if p.default is inspect.Parameter.empty}
    return {p.name for p in named}, required, accepts_any


def build_reward(spec_name: str, kwargs: Mapping[str, Any] | None = None) -> BoundReward:
    """Build reward ``spec_name`` configured with ``kwargs``.

    A reward function may carry ``validate_kwargs(kwargs)`` that raises TypeError/ValueError for
    bad values (``reward_model`` does); it runs here.

    Raises:
        TypeError: a kwarg is not a parameter of the reward, or a required one is missing
            (the message names it and lists the valid ones).
        ValueError: ``validate_kwargs`` refused a value (the message names the kwarg).
        KeyError: the name is neither registered nor importable as a dotted path.
    """
    fn = _lookup(spec_name)
    kwargs = dict(kwargs or {})
    allowed, required, accepts_any = _config_params(fn)
    unknown = sorted(set(kwargs) - allowed)
    if unknown and not accepts_any:
        raise TypeError(f"reward {spec_name!r}: unknown kwarg(s) {unknown}; "
                        f"valid kwargs: {sorted(allowed)}")
    missing = sorted(required - set(kwargs))
    if missing:
        raise TypeError(f"reward {spec_name!r}: missing required kwarg(s) {missing}")
    validate = getattr(fn, "validate_kwargs", None)
    if validate is not None:  # values checked now, not at the first step's scoring
        try:
            validate(kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"reward {spec_name!r}: bad kwargs: {e}") from e
    return BoundReward(spec_name, fn, kwargs)
