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
