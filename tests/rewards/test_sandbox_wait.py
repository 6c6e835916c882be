"""``_wait_exited``: returns when the child exits (a pidfd, or polling where there is none), times out on
a live one, and never reaps (the zombie keeps the pid, our process-group id, from being reused)."""

from __future__ import annotations

import os
import subprocess

import pytest

from megatron_cascade.rewards import sandbox_processes


@pytest.fixture(params=["pidfd", "polling"])
def wait_exited(request, monkeypatch):
    if request.param == "polling":
        def no_pidfd(pid):
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    return sandbox_processes._wait_exited


def test_waits_without_reaping(wait_exited):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert wait_exited(proc.pid, 0.05) is False
        proc.kill()
        assert wait_exited(proc.pid, 10) is True
        assert os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None  # still a zombie
    finally:
        proc.kill()
        proc.wait()
