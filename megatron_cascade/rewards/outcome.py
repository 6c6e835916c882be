"""What a reward call's failure means, decided in one place.

A reward call ends in one of three kinds of outcome:

* a **verdict**: the score (a number, clamped to [0, 1]);
* a **response fault**: the response broke its own scoring — a program that makes ``compile`` recurse
  too deep, an answer too long for the judge's context, a verifier killed at its deadline by what the
  response asked of it, an environment that cannot render what the response made it echo. This is a
  verdict too: the reward's lowest value (0), counted apart. Were it an invalid sample (advantage 0
  instead of a negative one), a policy would learn to break its scoring whenever it expects to lose;
* an **infrastructure failure**: the reward could not judge for a reason outside the response (a
  server down or slow, a worker that died, a malformed data row, a reward bug) — an invalid sample,
  left out of training, counted against ``rewards.max_error_frac``.

A reward signals a response fault by raising (or returning) :class:`ResponseFault`; ``RecursionError``
and ``MemoryError`` raised while judging a response count as one (the response is what varies; rows are
checked at load). Everything else that is raised is an infrastructure failure.
"""

from __future__ import annotations

import enum


class ResponseFault(Exception):
    """The response broke its own scoring: scored as the reward's lowest value (a verdict, not an
    invalid sample)."""


class ResponseTimeout(ResponseFault, TimeoutError):
    """A verifier judging only the response ran past its deadline (the response's own timeout)."""

    @classmethod
    def after(cls, timeout_s: float) -> "ResponseTimeout":
        return cls(f"reward timed out after {timeout_s:g} s judging the response (verifier process killed)")


# Raised by Python while judging a response that is too deep or too big: the response's doing.
_RESPONSE_CAUSED = (ResponseFault, RecursionError, MemoryError)


class OutcomeKind(str, enum.Enum):
    """The kind of a reward call's outcome (see the module docstring)."""

    VERDICT = "verdict"
    RESPONSE_FAULT = "response_fault"
    INFRA_ERROR = "infra_error"


def outcome_kind(value: object) -> OutcomeKind:
    """The kind of a raw reward value: a number (or anything not an exception) is a verdict — its
    conversion to a score may still fail, which is the reward's error —, a response-caused exception a
    response fault, any other exception an infrastructure failure."""
    if isinstance(value, _RESPONSE_CAUSED):
        return OutcomeKind.RESPONSE_FAULT
    if isinstance(value, BaseException):
        return OutcomeKind.INFRA_ERROR
    return OutcomeKind.VERDICT
