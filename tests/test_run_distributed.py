"""The multi-process harness (``megatron_cascade.testing.run_distributed``): workers forked from a fork
server that has torch and Megatron imported still see what a spawned worker would -- the caller's
environment, folder and ``sys.path`` at the call -- and a worker's error comes back with its rank and
traceback, with nothing left running."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from megatron_cascade.testing import WorkerError, run_distributed


def _what_the_worker_sees(tag: str) -> tuple:
    import torch.distributed as dist

    return (dist.get_rank(), os.environ.get("MC_HARNESS_CALLER"), os.environ.get("MC_HARNESS_ARG"), os.getcwd(),
            tag in sys.path, os.getpid())


def _raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    dist.barrier()  # rank 0 blocks here until it is killed


def test_workers_see_the_callers_environment_folder_and_path_at_the_call(tmp_path, monkeypatch):
    run_distributed(_what_the_worker_sees, 1, "warm-up")  # the fork server starts (if no test did)
    monkeypatch.setenv("MC_HARNESS_CALLER", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    seen = run_distributed(_what_the_worker_sees, 2, str(tmp_path / "extra"), env={"MC_HARNESS_ARG": "given"})
    assert [s[:5] for s in seen] == [(r, "set-after-the-server-started", "given", str(tmp_path), True) for r in (0, 1)]
    assert not any(psutil.pid_exists(s[5]) and psutil.Process(s[5]).status() != psutil.STATUS_ZOMBIE for s in seen)


def test_a_worker_error_names_its_rank_and_kills_the_others():
    with pytest.raises(WorkerError, match="rank 1: raised:(.|\n)*ValueError: rank one fails"):
        run_distributed(_raises, 2, timeout_s=120)
