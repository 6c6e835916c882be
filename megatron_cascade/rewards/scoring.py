"""Batch scoring: run any reward over many responses without ever stopping the run.

A reward that raises, returns a non-finite value or exceeds ``timeout_s`` scores 0 for
that response; it is counted in the returned error count and logged (``logging``).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

from megatron_cascade.rewards.registry import BoundReward

logger = logging.getLogger(__name__)

_MAX_LOGGED_ERRORS = 5  # per call, so a broken reward does not flood the log
_TIMED_OUT = TimeoutError("reward timed out")


def score_batch(reward_fn: Callable[[str, dict], float], responses: Sequence[str],
                samples: Sequence[dict], *, timeout_s: float = 30.0,
                max_workers: int | None = None) -> tuple[list[float], int]:
    """Score ``responses[i]`` against ``samples[i]``; returns ``(scores, n_errors)``.

    Args:
        reward_fn: ``(response, sample) -> float``; a :class:`BoundReward` with a native
            batch implementation (``code``, ``reward_model``) is called once for the whole
            batch and enforces its own timeouts (sandbox wall clock, HTTP timeouts).
        timeout_s: per-response limit in seconds for thread-pooled rewards. A timed-out
            call cannot be interrupted: its thread is abandoned (daemon) and replaced.
        max_workers: threads (default ``os.cpu_count()``).

    Scores are clamped to [0, 1].
    """
    if len(responses) != len(samples):
        raise ValueError(f"{len(responses)} responses but {len(samples)} samples")
    if isinstance(reward_fn, BoundReward) and reward_fn.has_batch:
        raw = _call_batch(reward_fn, responses, samples)
    else:
        raw = _run_threads(reward_fn, responses, samples, timeout_s,
                           max_workers or os.cpu_count() or 1)
    return _finalize(raw, getattr(reward_fn, "name", repr(reward_fn)))


def _call_batch(reward_fn: BoundReward, responses: Sequence[str],
                samples: Sequence[dict]) -> list[Any]:
    try:
        out = reward_fn.batch(responses, samples)
    except Exception as e:  # the whole batch failed: every item is an error
        return [e] * len(responses)
    if len(out) != len(responses):
        return [ValueError(f"batch returned {len(out)} scores for {len(responses)}")] * len(responses)
    return list(out)


def _run_threads(fn: Callable[[str, dict], float], responses: Sequence[str],
                 samples: Sequence[dict], timeout_s: float, max_workers: int) -> list[Any]:
    """Thread per item, at most ``max_workers`` live ones not yet timed out."""
    n = len(responses)
    results: list[Any] = [None] * n
    done_q: queue.Queue = queue.Queue()
    active: dict[int, float] = {}  # index -> start time (monotonic s)
    next_i, finished = 0, 0

    def work(i: int) -> None:
        try:
            done_q.put((i, fn(responses[i], samples[i])))
        except BaseException as e:  # noqa: BLE001 - reported as this item's error
            done_q.put((i, e))

    while finished < n:
        while len(active) < max_workers and next_i < n:
            active[next_i] = time.monotonic()
            threading.Thread(target=work, args=(next_i,), daemon=True,
                             name=f"reward-{next_i}").start()
            next_i += 1
        wait_s = max(0.0, min(active.values()) + timeout_s - time.monotonic())
        try:
            i, value = done_q.get(timeout=wait_s)
            if i in active:  # results of abandoned (timed-out) items are dropped
                del active[i]
                results[i], finished = value, finished + 1
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, t0 in active.items() if now - t0 >= timeout_s]:
                del active[i]
                results[i], finished = _TIMED_OUT, finished + 1
    return results


def _finalize(raw: list[Any], name: str) -> tuple[list[float], int]:
    scores: list[float] = []
    errors = 0
    for i, value in enumerate(raw):
        score, err = _to_score(value)
        if err is not None:
            errors += 1
            if errors <= _MAX_LOGGED_ERRORS:
                logger.warning("reward %s failed on item %d: %s: %s", name, i,
                               type(err).__name__, str(err)[:500])
        scores.append(score)
    if errors > _MAX_LOGGED_ERRORS:
        logger.warning("reward %s: %d/%d items failed (first %d logged)", name, errors,
                       len(raw), _MAX_LOGGED_ERRORS)
    return scores, errors


def _to_score(value: Any) -> tuple[float, BaseException | None]:
    if isinstance(value, BaseException):
        return 0.0, value
    try:
        score = float(value)
    except (TypeError, ValueError) as e:
        return 0.0, e
    if not math.isfinite(score):
        return 0.0, ValueError(f"non-finite score {score}")
    return min(1.0, max(0.0, score)), None
