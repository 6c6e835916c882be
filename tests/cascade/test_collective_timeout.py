"""``distributed.timeout_minutes`` reaches the process group and Megatron's groups: with two gloo
processes and a rank that stalls, the waiting rank's collectives fail after the configured seconds
instead of torch's 30-minute default (real processes, real gloo, real Megatron groups).

No bound here depends on machine speed: the stalled rank is released by a file as soon as the waiting
rank is done (so the test takes seconds), and the upper bound is far below the stall's own limit."""

from __future__ import annotations

import os
import time
from pathlib import Path

from megatron_cascade.config import load_config
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.distributed import find_free_port

TIMEOUT_MIN = 0.03  # 1.8 s
STALL_LIMIT_S = 120.0  # rank 1 stalls until rank 0 is done, or this long
# A wait below this is the configured timeout, not the stall ending nor torch's 30 min (a loaded
# machine adds seconds to the 1.8 s, not a minute).
WAIT_UPPER_BOUND_S = STALL_LIMIT_S / 2
CI_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml"


def _stalled_collectives(port: int, released: str) -> dict[str, float]:
    """Re-join a fresh group through ``init_distributed`` (the harness made one with torch's default
    timeout); rank 1 stalls, rank 0 times the failure of an all-reduce on Megatron's data-parallel
    group and then on the default group, then creates the file ``released``, which ends rank 1's
    stall. Returns {group: seconds waited} (rank 0)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cascade.cascade.runtime import init_distributed
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import initialize_model_parallel

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(TIMEOUT_MIN)
    initialize_model_parallel(ParallelConfig(), seed=0, timeout_minutes=TIMEOUT_MIN)
    dist.barrier()
    if dist.get_rank() == 1:
        deadline = time.monotonic() + STALL_LIMIT_S
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.05)  # a slow rank: never joins rank 0's collectives
        return {}
    waited = {}
    for name, group in [("megatron_dp_group", parallel_state.get_data_parallel_group()), ("default_group", None)]:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            waited[name] = -1.0  # completed: impossible while rank 1 sleeps
        except RuntimeError:
            waited[name] = time.monotonic() - start
    Path(released).touch()
    return waited


def test_stalled_rank_times_out_after_configured_minutes(tmp_path):
    # Without the timeout rank 0 would wait 30 min (torch's gloo default); the harness limit catches that.
    waited, _ = run_distributed(_stalled_collectives, 2, find_free_port(), str(tmp_path / "released"),
                                timeout_s=STALL_LIMIT_S + 60)
    assert set(waited) == {"megatron_dp_group", "default_group"}
    for name, seconds in waited.items():
        assert 0.5 * TIMEOUT_MIN * 60 < seconds < WAIT_UPPER_BOUND_S, (name, seconds)


def test_config_key_default_and_override():
    assert load_config(str(CI_CONFIG)).distributed.timeout_minutes == 120.0
    assert load_config(str(CI_CONFIG), ["distributed.timeout_minutes=7.5"]).distributed.timeout_minutes == 7.5


STRAGGLER_S = 3.0  # a replica still generating, longer than the collective timeout (1.8 s)


def _straggling_replica(port: int, meet: bool, wait_minutes: float, done: str) -> dict:
    """Rank 1 generates STRAGGLER_S longer than rank 0; then (``meet``: after meeting) both all-reduce
    on the default group, as the rollout stage's first cross-replica collective does. Rank 0 (the
    store's host) stays until rank 1 has created ``done``."""
    import torch
    import torch.distributed as dist

    from megatron_cascade.cascade.runtime import init_distributed
    from megatron_cascade.rollout.meeting import GenerationStragglerError, meet_after_generation

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(TIMEOUT_MIN)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(STRAGGLER_S)
    out = {"waited": 0.0, "straggler_error": None, "collective": None}
    try:
        if meet:
            out["waited"] = meet_after_generation(wait_minutes)
        dist.all_reduce(torch.ones(1))
        out["collective"] = "ok"
    except GenerationStragglerError as exc:
        out["straggler_error"] = str(exc)
    except RuntimeError:
        out["collective"] = "timed out"
    if dist.get_rank() == 1:
        Path(done).touch()
    else:
        deadline = time.monotonic() + STALL_LIMIT_S
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


def test_replicas_wait_for_a_slow_generation_outside_collectives(tmp_path):
    """Issue 25: a replica that finished generating waited for the slowest inside the next collective,
    whose timeout (sized for training) killed the job; they now meet at the store first."""
    def run(meet: bool, wait_minutes: float, name: str) -> list[dict]:
        return run_distributed(_straggling_replica, 2, find_free_port(), meet, wait_minutes, str(tmp_path / name),
                               timeout_s=STALL_LIMIT_S + 60)

    before = run(False, 1.0, "before")
    assert before[0]["collective"] == "timed out"  # what a long generation did to the job
    after = run(True, 1.0, "after")
    assert [r["collective"] for r in after] == ["ok", "ok"]
    assert after[0]["waited"] > STRAGGLER_S / 2 > after[1]["waited"]
    bounded = run(True, 0.01, "bounded")
    assert "rank(s) [1] still in generation after distributed.generation_wait_minutes=0.01" in \
        (bounded[0]["straggler_error"] or ""), bounded
