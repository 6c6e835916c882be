"""Issue 13 item 2: a verifier can neither freeze the trainer nor outlive its deadline.

``\\boxed{9^{9^{9^{9}}}}`` makes SymPy compute a tower of powers in C big-integer code that holds
the GIL: in a scoring thread nothing else in the trainer ran and the timeout never fired. The
built-in verifiers now run in killable worker processes. The attacks run in a child interpreter
(the "trainer"), so that a regression fails by timeout instead of freezing pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from megatron_cascade.rewards import BoundReward, get_reward, score_batch
from megatron_cascade.rewards.isolation import VerifierProcessPool
from megatron_cascade.rewards.registry import run_in_process
from megatron_cascade.rewards.scoring import ScoringPool

TOWER = "so the answer is \\boxed{9^{9^{9^{9}}}}"


def _trainer(script: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (the repository on its path); kill it at ``timeout_s``."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_sympy_tower_is_killed_and_the_trainer_keeps_running():
    """Before: the child was still frozen after 60 s (subprocess.TimeoutExpired), 0 main-thread ticks."""
    script = f"""
        import json, threading, time
        from megatron_cascade.rewards import get_reward
        from megatron_cascade.rewards.scoring import ScoringPool, finalize_scores
        pool = ScoringPool(max_workers=2)
        pool.submit(get_reward("math"), {TOWER!r}, {{"answer": "2"}}, timeout_s=2.0)
        pool.submit(get_reward("math"), "\\\\boxed{{2}}", {{"answer": "2"}}, timeout_s=2.0)
        start, ticks = time.monotonic(), 0
        while time.monotonic() - start < 1.0:  # the trainer's own work (generation) meanwhile
            time.sleep(0.01)
            ticks += 1
        scores, errors = finalize_scores(pool.results(), "math")
        print(json.dumps({{"scores": scores, "errors": errors, "ticks": ticks,
                          "seconds": time.monotonic() - start}}))
    """
    out = json.loads(_trainer(script, timeout_s=60).stdout.strip().splitlines()[-1])
    assert out["scores"] == [0.0, 1.0] and out["errors"] == 0  # the tower's timeout is its own: a verdict
    assert out["ticks"] > 20  # ~100 when nothing holds the GIL
    assert out["seconds"] < 15


def _computing_children() -> list[int]:
    """Child processes of this test process that are burning CPU now."""
    busy = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and child.cpu_percent(0.3) > 50:
                busy.append(child.pid)
        except psutil.Error:
            continue
    return busy


def test_score_batch_timeout_kills_the_worker():
    start = time.monotonic()
    scores, errors = score_batch(get_reward("math"), [TOWER, "\\boxed{3}"], [{"answer": "3"}] * 2, timeout_s=1.0)
    assert (scores, errors) == ([0.0, 1.0], 0)  # the response's own timeout: 0 as a verdict, not invalid
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 10
    while _computing_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _computing_children()  # the worker computing the tower was killed, not abandoned
    assert score_batch(get_reward("math"), ["\\boxed{3}"], [{"answer": "3"}], timeout_s=5.0) == ([1.0], 0)


@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_trainer():
    """The trainer is SIGKILLed while a worker computes the tower: the worker dies too."""
    script = f"""
        import os, sys, time, psutil
        from megatron_cascade.rewards import get_reward
        from megatron_cascade.rewards.scoring import ScoringPool
        pool = ScoringPool(max_workers=1)
        pool.submit(get_reward("math"), {TOWER!r}, {{"answer": "2"}}, timeout_s=600.0)
        time.sleep(2.0)
        print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
        time.sleep(600)
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
                            cwd=root)
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert workers
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in workers):
        time.sleep(0.1)
    alive = [pid for pid in workers if psutil.pid_exists(pid)]
    for pid in alive:  # do not leave a tower computing if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive


@run_in_process
def _crashing(response: str, sample: dict) -> float:
    if response == "exit":
        os._exit(3)  # the worker dies without answering
    if response == "raise":
        raise SystemExit("a reward that exits")
    return len(response) / 10


def test_a_dying_worker_costs_only_its_item():
    scores, errors = score_batch(_crashing, ["ab", "exit", "raise", "abc"], [{}] * 4, timeout_s=5.0, max_workers=2)
    assert scores == [0.2, 0.0, 0.0, 0.3] and errors == 2


def test_a_bad_row_costs_only_its_item():
    responses = ["\\boxed{2}", "\\boxed{2}", "\\boxed{3}", "Answer: B"]
    rows = [{"answer": "2"}, {"question": "no answer key"}, {"answer": "3"}, {"answer": "2"}]
    scores, errors = score_batch(get_reward("math"), responses, rows, timeout_s=5.0)
    assert scores == [1.0, 0.0, 1.0, 0.0] and errors == 1


def test_library_exceptions_that_do_not_pickle_are_still_one_items_error():
    """jsonschema's SchemaError needs constructor arguments pickle does not record."""
    broken = {"type": 5}
    scores, errors = score_batch(get_reward("structured_output"), ['{"a": 1}', '{"a": 1}'],
                                 [{"schema": broken}, {"schema": {"type": "object"}}], timeout_s=5.0)
    assert scores == [0.0, 1.0] and errors == 1


def _not_marked(response: str, sample: dict) -> float:
    return 1.0


def test_pool_runs_lambdas_of_bound_rewards_by_name_and_reports_what_cannot_run():
    pool = VerifierProcessPool(max_processes=1)
    try:
        assert pool.call(_not_marked, "x", {}, 5.0) == 1.0
        assert pool.call(BoundReward("multiple_choice", lambda r, s: 0.0), "Answer: B", {"answer": "B"}, 5.0) == 1.0
        error = pool.call(lambda r, s: 1.0, "x", {}, 5.0)
        assert isinstance(error, TypeError) and "module level" in str(error)
        assert pool.live == 1
    finally:
        pool.close()
    assert pool.live == 0


def test_an_idle_worker_killed_from_outside_is_replaced_unnoticed():
    pool = VerifierProcessPool(max_processes=1)
    try:
        assert pool.call(_not_marked, "x", {}, 5.0) == 1.0
        (worker,) = pool._idle
        worker.proc.kill()  # the OOM killer, an operator
        worker.proc.wait(timeout=10)
        assert pool.call(_not_marked, "x", {}, 5.0) == 1.0
    finally:
        pool.close()


@pytest.mark.parametrize("max_processes", [0, -1])
def test_pool_size_is_validated(max_processes):
    with pytest.raises(ValueError, match="max_processes"):
        VerifierProcessPool(max_processes)


HANG = threading.Event()


def _hanging_batch(responses, samples):
    if "hang" in responses:
        HANG.wait(30)
    if "none" in responses:
        return None
    return [1.0] * len(responses)


def _batched(response: str, sample: dict) -> float:
    return 1.0


_batched.batch_fn = _hanging_batch


@pytest.mark.timeout(60)
def test_a_hanging_batch_reward_is_abandoned_at_the_summed_deadline():
    """Before: score_batch and ScoringPool.results() waited for the batch call forever (here: the
    30 s the test's reward hangs)."""
    reward = BoundReward("batched", _batched)
    try:
        start = time.monotonic()
        assert score_batch(reward, ["a", "hang"], [{}] * 2, timeout_s=0.5) == ([0.0, 0.0], 2)
        assert time.monotonic() - start < 5
        pool = ScoringPool(max_workers=1)
        for response in ("a", "hang", "b"):
            pool.submit(reward, response, {}, timeout_s=0.5)
        raw = pool.results()  # "a" (and "b") may be grouped with "hang" or not, depending on timing
        assert isinstance(raw[1], TimeoutError) and all(v == 1.0 or isinstance(v, TimeoutError) for v in raw)
        assert time.monotonic() - start < 10
        assert score_batch(reward, ["a", "none"], [{}] * 2, timeout_s=30) == ([0.0, 0.0], 2)  # at once
        assert time.monotonic() - start < 15
    finally:
        HANG.set()


@run_in_process
def _allocating(response: str, sample: dict) -> float:
    block = bytearray(int(response) << 20)  # what a response can make a verifier allocate
    return float(len(block) > 0)


def test_a_verifier_that_would_take_the_nodes_memory_gets_memory_error():
    """Issue 29: verifier workers had no memory limit (8 of them, each unbounded). Now a worker's heap
    is capped; past it the call raises MemoryError, a response fault (score 0), and the worker lives on."""
    from megatron_cascade.rewards.outcome import OutcomeKind, outcome_kind

    pool = VerifierProcessPool(max_processes=1, memory_mb=256)
    try:
        assert pool.call(_allocating, "16", {}, timeout_s=30) == 1.0
        bomb = pool.call(_allocating, "2048", {}, timeout_s=30)
        assert isinstance(bomb, MemoryError) and outcome_kind(bomb) is OutcomeKind.RESPONSE_FAULT, bomb
        assert pool.call(_allocating, "16", {}, timeout_s=30) == 1.0 and pool.live == 1
    finally:
        pool.close()
