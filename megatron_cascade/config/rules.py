"""How a config field declares its valid values, and the walk that checks a loaded config against them.

* A fixed set of strings is a :class:`Choice` (a ``str`` enum): OmegaConf refuses any other value
  when the YAML is merged into the schema, and the members still compare, hash, print and serialise
  as the plain strings users write (``cfg.rollout.overlong_policy == "zero"`` keeps working).
* A number's range is declared on the field itself with :func:`ranged` (``top_p: float =
  ranged(1.0, gt=0, le=1)``); a list's or string's condition with :func:`checked`.
* Rules between fields of one dataclass live in its ``validate(prefix)`` method.

:func:`validate_tree` walks a config (nested dataclasses, dicts and lists of them), checks every
declared rule and calls every ``validate``; the first problem raises :class:`ConfigError` naming the
full key (``domains.math.reward.timeout_s=0 must be > 0``). :func:`field_problems` lists every
declared rule a config breaks (the loader reports them all at once).
"""

from __future__ import annotations

import enum
import functools
import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Optional

_RULE = "megatron_cascade.rule"
# The longest any reward, sandbox or environment timeout may be (a day): a larger one is a mistake, and
# one past threading.TIMEOUT_MAX (~292 years; `timeout_s: 1e10`) crashed the step with OverflowError.
MAX_TIMEOUT_S = 86_400.0


class ConfigError(ValueError):
    """A configuration a user wrote cannot work; the message names the key and what to do."""


class Choice(str, enum.Enum):
    """Base of the config's choice enums: member name == value == the string written in YAML.

    OmegaConf converts a YAML string to a member by *name*, so each member's name must equal its
    value. ``str``/``format``/``repr`` give the plain string (as Python 3.11's ``StrEnum`` for
    ``str``/``format``; ``repr`` too, so error messages read ``precision='fp64'`` whatever the type).
    """

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __repr__(self) -> str:
        return str.__repr__(str.__str__(self))

    @classmethod
    def values(cls) -> list[str]:
        """The accepted strings, in declaration order."""
        return [m.value for m in cls]


@dataclass(frozen=True)
class Range:
    """Bounds of a number (``None`` = unbounded); ``None`` values (null where the type allows it) pass."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    why: str = ""

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with ``value`` (``None`` when it is in range)."""
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return self._with_why("must be a finite number")
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if ok else self._with_why(f"must be {self.text()}")

    def text(self) -> str:
        """The range in words: ``>= 1``, ``in (0, 1]``."""
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if lo is not None and hi is not None:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"in {left}{_num(lo)}, {_num(hi)}{right}"
        if lo is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(lo)}"
        return f"{'<=' if self.le is not None else '<'} {_num(hi)}"

    def _with_why(self, text: str) -> str:
        return f"{text} ({self.why})" if self.why else text


@dataclass(frozen=True)
class Condition:
    """Any other condition on one field's value: ``test(value)`` must hold, else ``must`` is the reason."""

    test: Callable[[Any], bool]
    must: str

    def problem(self, value: Any) -> Optional[str]:
        return None if value is None or self.test(value) else self.must


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def ranged(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
           lt: Optional[float] = None, why: str = "") -> Any:
    """A dataclass field with ``default`` whose value must lie in the given bounds (and be finite)."""
    return field(default=default, metadata={_RULE: Range(ge, gt, le, lt, why)})


def checked(test: Callable[[Any], bool], must: str, *, default: Any = None,
            default_factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field whose value must pass ``test``; ``must`` says what it must be."""
    meta = {_RULE: Condition(test, must)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def validate_tree(node: Any, prefix: str = "") -> None:
    """Check every field rule, then every ``validate`` method, in ``node`` and below; ``ConfigError``
    on the first problem (:func:`field_problems` lists them all).

    ``prefix`` is the key of ``node`` followed by a dot (``"rollout."``), or empty for the root.
    """
    problems = field_problems(node, prefix)
    if problems:
        raise ConfigError(problems[0])
    for section, section_prefix in _sections(node, prefix, children_first=True):
        check = getattr(section, "validate", None)
        if callable(check):
            check(section_prefix)


def field_problems(node: Any, prefix: str = "") -> list[str]:
    """``"<key>=<value> <what it must be>"`` for every field of ``node`` and below whose value breaks
    its declared rule (range, condition, choice)."""
    problems = []
    for section, section_prefix in _sections(node, prefix):
        choices = _choice_fields(type(section))
        for f in fields(section):
            value = getattr(section, f.name)
            rule = f.metadata.get(_RULE)
            problem = rule.problem(value) if rule is not None else None
            if f.name in choices and value is not None and value not in choices[f.name].values():
                # OmegaConf refuses these when it loads YAML; a config built in code is checked here.
                problem = f"is not one of {choices[f.name].values()}"
            if problem:
                problems.append(f"{section_prefix}{f.name}={value!r} {problem}")
    return problems


def _sections(node: Any, prefix: str, children_first: bool = False) -> list[tuple[Any, str]]:
    """Every dataclass instance in ``node`` and below (dicts and lists of them too) with its key
    prefix, in field order; a section before its sub-sections, or after them (``children_first``:
    a ``validate`` method may rely on its sub-sections' own rules)."""
    if isinstance(node, dict):
        return [found for key, value in node.items()
                for found in _sections(value, f"{prefix}{key}.", children_first)]
    if isinstance(node, (list, tuple)):
        return [found for index, value in enumerate(node)
                for found in _sections(value, f"{prefix.rstrip('.')}[{index}].", children_first)]
    if not is_dataclass(node) or isinstance(node, type):
        return []
    below = [found for f in fields(node) for found in _sections(getattr(node, f.name), f"{prefix}{f.name}.",
                                                                   children_first)]
    return below + [(node, prefix)] if children_first else [(node, prefix)] + below


@functools.cache
def _choice_fields(cls: type) -> dict[str, type[Choice]]:
    """The fields of dataclass ``cls`` typed ``Choice`` or ``Optional[Choice]``, with their enum."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) else [hint]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], Choice):
            out[name] = args[0]
    return out


def require(ok: bool, message: str) -> None:
    """``ConfigError(message)`` unless ``ok``: the one-line form of a ``validate`` method's rules."""
    if not ok:
        raise ConfigError(message)
