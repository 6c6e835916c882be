"""Batch scoring: run any reward over many responses without ever stopping the run.

Each item's outcome is of one of the kinds of :mod:`megatron_cascade.rewards.outcome`. A reward that
raises, returns a non-finite value or exceeds ``timeout_s`` for a reason outside the response (an
infrastructure failure) scores 0 for that response; it is counted in the returned error count
(``finalize_flags``: flagged per item, so that training can leave the sample out rather than learn
from the 0) and logged (``logging``). A response that broke its own scoring (a
:class:`~megatron_cascade.rewards.outcome.ResponseFault`, a built-in verifier killed at its deadline)
scores 0 as a verdict: it is not an error, and ``finalize_outcomes`` flags it apart.

``score_batch`` scores a whole list at once; ``ScoringPool`` takes responses one by one while
the caller does other work (generation hands it each sample as it finishes) and waits only for
the stragglers. Both apply the same rules: the pool's dispatcher is what ``score_batch`` runs.
CPU-bound verifiers run in killable worker processes (:mod:`megatron_cascade.rewards.isolation`),
so that no response can hold the trainer past its deadline.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from megatron_cascade.rewards.isolation import verifier_pool
from megatron_cascade.rewards.outcome import OutcomeKind, ResponseTimeout, outcome_kind
from megatron_cascade.rewards.registry import BoundReward, runs_in_process

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
            batch and enforces its own timeouts (sandbox wall clock, HTTP deadlines); a call still
            running after ``timeout_s`` per item (summed) is abandoned and every item times out.
        timeout_s: per-response limit in seconds. A reward marked ``run_in_process`` (the
            built-in verifiers, which judge the response alone) is killed with its worker process
            at the limit, a response fault; another timed-out call (a server, a user reward) is an
            infrastructure failure and cannot be interrupted: its thread is abandoned (daemon) and
            replaced.
        max_workers: threads (default ``os.cpu_count()``).

    Scores are clamped to [0, 1].
    """
    if len(responses) != len(samples):
        raise ValueError(f"{len(responses)} responses but {len(samples)} samples")
    if isinstance(reward_fn, BoundReward) and reward_fn.has_batch:
        raw = _call_batch_with_backstop(reward_fn, responses, samples, timeout_s * len(responses))
    else:
        raw = _run_threads(reward_fn, responses, samples, timeout_s,
                           max_workers or os.cpu_count() or 1)
    return _finalize(raw, getattr(reward_fn, "name", repr(reward_fn)))


def _call_batch(reward_fn: BoundReward, responses: Sequence[str],
                samples: Sequence[dict]) -> list[Any]:
    """Per item a raw value; never raises (what the batch call raised or returned wrongly is
    every item's error)."""
    try:
        out = list(reward_fn.batch(responses, samples))
    except BaseException as e:  # noqa: BLE001 - the whole batch failed (SystemExit too): every item is an error
        return [e] * len(responses)
    if len(out) != len(responses):
        return [ValueError(f"batch returned {len(out)} scores for {len(responses)}")] * len(responses)
    return out


def _call_batch_with_backstop(reward_fn: BoundReward, responses: Sequence[str], samples: Sequence[dict],
                              limit_s: float) -> list[Any]:
    """:func:`_call_batch` in a daemon thread, abandoned (every item ``TimeoutError``) after ``limit_s``."""
    out: list[list[Any]] = []
    thread = threading.Thread(target=lambda: out.append(_call_batch(reward_fn, responses, samples)), daemon=True,
                              name="reward-batch")
    thread.start()
    thread.join(min(limit_s, threading.TIMEOUT_MAX))  # a sum of many long limits may pass what join takes
    return out[0] if out else [_TIMED_OUT] * len(responses)


def _run_threads(fn: Callable[[str, dict], float], responses: Sequence[str],
                 samples: Sequence[dict], timeout_s: float, max_workers: int) -> list[Any]:
    """Thread per item, at most ``max_workers`` live ones not yet timed out."""
    pool = ScoringPool(max_workers)
    for response, sample in zip(responses, samples):
        pool.submit(fn, response, sample, timeout_s=timeout_s)
    return pool.results()


class ScoringPool:
    """Scores responses in worker threads as they are submitted; ``results()`` waits for the rest.

    Per item the rules of :func:`score_batch`: a reward marked
    :func:`~megatron_cascade.rewards.registry.run_in_process` (the built-in verifiers) runs in a
    worker process of :func:`~megatron_cascade.rewards.isolation.verifier_pool`, killed when the
    call is still running ``timeout_s`` after the worker started it; another plain reward runs in
    its own thread and a call still running ``timeout_s`` after it started scores ``TimeoutError``
    (its thread is abandoned, daemon, and its slot reused: C code holding the GIL cannot be
    stopped); a :class:`BoundReward` with a native batch implementation gets every item of it
    waiting for a worker in one ``batch`` call (items queue up while the workers are busy) and
    enforces its own timeouts, with the sum of the items' ``timeout_s`` as a backstop (a call
    still running then is abandoned, its items time out). At most ``max_workers`` calls (default
    ``os.cpu_count()``) are live at once. Threads suit rewards that wait on sandboxed subprocesses
    or HTTP; an unmarked pure-Python reward shares the GIL with the caller.

    One dispatcher thread owns the queue and the deadlines; ``submit`` only posts to it. Not
    reusable after ``results()``.
    """

    def __init__(self, max_workers: Optional[int] = None) -> None:
        self.max_workers = max_workers or os.cpu_count() or 1
        self._events: queue.Queue = queue.Queue()
        self._submitted = 0
        self._closed = False
        self._raw: list[Any] = []
        self._failure: Optional[BaseException] = None
        self._dispatcher = threading.Thread(target=self._dispatch, daemon=True, name="reward-dispatch")
        self._dispatcher.start()

    def submit(self, reward_fn: Callable[[str, dict], float], response: str, sample: dict, *,
               timeout_s: float = 30.0) -> int:
        """Queue ``reward_fn(response, sample)``; returns the item's index in ``results()``."""
        if self._closed:
            raise RuntimeError("ScoringPool.submit after results() or close()")
        index = self._submitted
        self._submitted += 1
        self._events.put(("item", (index, reward_fn, response, sample, timeout_s)))
        return index

    def close(self) -> None:
        """No more items: the dispatcher ends once the submitted ones are done (idempotent)."""
        if not self._closed:
            self._closed = True
            self._events.put(("close", None))

    def results(self) -> list[Any]:
        """Wait for every submitted item; per item (submission order) its raw value: the reward's
        return value or the exception it raised / ``TimeoutError``. Closes the pool."""
        self.close()
        self._dispatcher.join()
        if self._failure is not None:
            raise RuntimeError("reward dispatcher failed") from self._failure
        return self._raw

    # -- dispatcher thread ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        pending: deque = deque()  # items waiting for a worker
        active: dict[int, tuple[list[int], Optional[float]]] = {}  # job -> (item indices, deadline)
        on_timeout: dict[int, BaseException] = {}  # job -> what its items score when its deadline passes
        results: dict[int, Any] = {}
        closed, jobs = False, 0
        try:
            while True:
                while len(active) < self.max_workers and pending:
                    items = _next_job(pending)
                    # A batch reward enforces its own limits; the sum of its items' limits (never tighter
                    # than scoring them one after another) is only a backstop against one that hangs.
                    # A process-run reward's deadline starts when its worker has it loaded (the "started"
                    # event), as the worker's own kill.
                    if len(items) > 1 or _is_batch(items[0][1]):
                        deadline = time.monotonic() + sum(item[4] for item in items)
                    elif runs_in_process(items[0][1]):
                        deadline = None
                    else:
                        deadline = time.monotonic() + items[0][4]
                    active[jobs] = ([item[0] for item in items], deadline)
                    # A verifier judging the response alone ran out of time on it: the response's own timeout.
                    on_timeout[jobs] = (ResponseTimeout.after(items[0][4]) if deadline is None else _TIMED_OUT)
                    threading.Thread(target=self._work, args=(jobs, items), daemon=True,
                                     name=f"reward-{items[0][0]}").start()
                    jobs += 1
                if closed and not pending and not active:
                    break
                deadlines = [d for _, d in active.values() if d is not None]
                wait_s = min(max(0.0, min(deadlines) - time.monotonic()), threading.TIMEOUT_MAX) if deadlines else None
                try:
                    kind, payload = self._events.get(timeout=wait_s)
                except queue.Empty:
                    kind, payload = "tick", None
                if kind == "item":
                    pending.append(payload)
                elif kind == "close":
                    closed = True
                elif kind == "started" and payload[0] in active:
                    indices, _ = active[payload[0]]
                    active[payload[0]] = (indices, payload[1])
                elif kind == "done" and payload[0] in active:  # abandoned (timed-out) jobs are dropped
                    indices, _ = active.pop(payload[0])
                    results.update(zip(indices, payload[1]))
                now = time.monotonic()
                for job in [j for j, (_, d) in active.items() if d is not None and d <= now]:
                    results.update((index, on_timeout[job]) for index in active.pop(job)[0])
        except BaseException as e:  # noqa: BLE001 - surfaced by results()
            self._failure = e
        self._raw = [results.get(i, _TIMED_OUT) for i in range(self._submitted)]

    def _work(self, job: int, items: list[tuple]) -> None:
        fn = items[0][1]
        try:
            if _is_batch(fn):
                values = _call_batch(fn, [item[2] for item in items], [item[3] for item in items])
            elif runs_in_process(fn):
                _, _, response, sample, timeout_s = items[0]
                values = [verifier_pool().call(
                    fn, response, sample, timeout_s,
                    on_start=lambda t: self._events.put(("started", (job, t + timeout_s))))]
            else:
                values = [fn(items[0][2], items[0][3])]
        except BaseException as e:  # noqa: BLE001 - reported as the items' error, never a lost job
            values = [e] * len(items)
        self._events.put(("done", (job, values)))


def _is_batch(fn: Any) -> bool:
    return isinstance(fn, BoundReward) and fn.has_batch


def _next_job(pending: deque) -> list[tuple]:
    """The oldest waiting item, with every other waiting item of the same batch reward."""
    first = pending.popleft()
    if not _is_batch(first[1]):
        return [first]
    same = [item for item in pending if item[1] is first[1]]
    for item in same:
        pending.remove(item)
    return [first, *same]


def finalize_scores(raw: list[Any], name: str) -> tuple[list[float], int]:
    """Raw reward values (or exceptions) -> scores clamped to [0, 1] (errors and non-finite
    values score 0) and the error count; the first errors are logged under reward ``name``."""
    return _finalize(raw, name)


def finalize_flags(raw: list[Any], name: str) -> tuple[list[float], list[bool]]:
    """As :func:`finalize_scores`, but per item whether it errored (an infrastructure failure: raised,
    timed out, returned a non-number or a non-finite value) instead of the count."""
    scores, errored, _ = finalize_outcomes(raw, name)
    return scores, errored


def finalize_outcomes(raw: list[Any], name: str) -> tuple[list[float], list[bool], list[bool]]:
    """Per item its score in [0, 1], whether it errored (an infrastructure failure: an invalid
    sample) and whether the response broke its own scoring (a verdict: 0, not an error). The first
    errors and response faults are logged under reward ``name``."""
    scores: list[float] = []
    errored: list[bool] = []
    faulted: list[bool] = []
    for i, value in enumerate(raw):
        score, err = _to_score(value)
        fault = err is not None and outcome_kind(err) is OutcomeKind.RESPONSE_FAULT
        if err is not None and sum(errored) + sum(faulted) < _MAX_LOGGED_ERRORS:
            what = "the response broke its scoring (scored 0, a verdict)" if fault else "failed"
            logger.warning("reward %s: item %d: %s: %s: %s", name, i, what, type(err).__name__,
                           _safe_text(err)[:500])
        errored.append(err is not None and not fault)
        faulted.append(fault)
        scores.append(score)
    if sum(errored) + sum(faulted) > _MAX_LOGGED_ERRORS:
        logger.warning("reward %s: %d/%d items failed, %d broke their own scoring (first %d logged)", name,
                       sum(errored), len(raw), sum(faulted), _MAX_LOGGED_ERRORS)
    return scores, errored, faulted


def _finalize(raw: list[Any], name: str) -> tuple[list[float], int]:
    scores, errored = finalize_flags(raw, name)
    return scores, sum(errored)


def _to_score(value: Any) -> tuple[float, BaseException | None]:
    if isinstance(value, BaseException):
        return 0.0, value
    try:
        score = float(value)
    except Exception as e:  # noqa: BLE001 - whatever a returned object's __float__ raises
        return 0.0, e
    if not math.isfinite(score):
        return 0.0, ValueError(f"non-finite score {score}")
    return min(1.0, max(0.0, score)), None


def _safe_text(err: BaseException) -> str:
    """``str(err)``, or a placeholder when the exception's ``__str__`` itself raises: logging one
    item's failure must not fail the step."""
    try:
        return str(err)
    except Exception:  # noqa: BLE001
        return "<exception text unavailable>"
