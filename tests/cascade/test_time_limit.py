"""The trainer stops (checkpoint + exit 75) before a step it cannot finish by the Slurm job's end:
``PreemptionWatch`` learns step durations from its per-step ``requested()`` calls (fake clock here)
and reads the end time from ``SLURM_JOB_END_TIME`` or one ``squeue`` query."""

from __future__ import annotations

import signal
from datetime import datetime

import pytest

from megatron_cascade.cascade.runtime import PreemptionWatch, slurm_job_end_time


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def run_steps(watch: PreemptionWatch, clock: FakeClock, durations: list[float]) -> int | None:
    """Steps of the given durations; returns the number done when the watch said stop (else None)."""
    for done, seconds in enumerate(durations, start=1):
        clock.now += seconds
        if watch.requested():
            return done
    return None


def test_stops_before_a_step_that_would_pass_the_end_time():
    clock = FakeClock()
    # 1000 s left; 100 s steps then one slow 300 s step; margin 120 s.
    watch = PreemptionWatch(end_time=clock.now + 1000, margin_s=120, clock=clock)
    watch.start_stage()
    # After step 3 (t=500, longest recent 300): 500 + 300 + 120 = 920 <= 1000 -> go on.
    # After step 4 (t=600, longest recent 300): 600 + 300 + 120 = 1020 > 1000 -> stop.
    assert run_steps(watch, clock, [100, 100, 300, 100, 100, 100]) == 4
    assert watch.next_step_estimate() == 300


def test_estimate_forgets_old_steps_and_resets_per_stage():
    clock = FakeClock()
    watch = PreemptionWatch(end_time=clock.now + 10_000, margin_s=0, clock=clock, window=3)
    watch.start_stage()
    assert run_steps(watch, clock, [500, 10, 10, 10]) is None
    assert watch.next_step_estimate() == 10  # the 500 s step left the 3-step window
    watch.start_stage()
    assert watch.next_step_estimate() is None


def test_no_end_time_never_stops_for_time_and_signal_still_does():
    clock = FakeClock()
    watch = PreemptionWatch(end_time=None, margin_s=600, clock=clock)
    assert run_steps(watch, clock, [1e6, 1e6]) is None
    signal.raise_signal(signal.SIGUSR1)
    assert watch.requested()


def test_inside_the_margin_stops_even_before_any_step_time_is_known():
    clock = FakeClock()
    watch = PreemptionWatch(end_time=clock.now + 100, margin_s=600, clock=clock)
    assert watch.out_of_time(clock.now)


def test_end_time_from_slurm_environment():
    assert slurm_job_end_time({}) is None  # not a Slurm job
    assert slurm_job_end_time({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1800000000"}) == 1_800_000_000.0
    asked = []

    def squeue(job_id: str) -> str:
        asked.append(job_id)
        return "2026-12-03T05:11:29"

    end = slurm_job_end_time({"SLURM_JOB_ID": "42"}, query=squeue)
    assert asked == ["42"] and end == datetime(2026, 12, 3, 5, 11, 29).timestamp()
    for unlimited in ("N/A", "NONE", "UNLIMITED", ""):
        assert slurm_job_end_time({"SLURM_JOB_ID": "42"}, query=lambda _, u=unlimited: u) is None

    def broken(job_id: str) -> str:
        raise FileNotFoundError("squeue")

    assert slurm_job_end_time({"SLURM_JOB_ID": "42"}, query=broken) is None
