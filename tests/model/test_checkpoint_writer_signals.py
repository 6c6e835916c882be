"""A stop signal while the checkpoint writer's manager starts (the first save of a process) must not
kill it (issue 28): under Slurm that was exit 1 instead of 75, so no requeue and every later stage
cancelled by afterok."""

from __future__ import annotations

import os
import subprocess
import sys


def test_sigterm_bursts_while_the_writer_starts_leave_it_running():
    """Before: 3 runs of 3 ended in EOFError (the manager died of SIGTERM between its birth and its
    initializer, which ignores stop signals). Now it starts with them blocked; the trainer's own
    handler still sees the signal."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "signal_burst.py")
    for _ in range(3):
        res = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                             start_new_session=True)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "queue: alive trainer saw SIGTERM: True" in res.stdout, res.stdout + res.stderr[-2000:]


_TRAINER = """
import sys, time
from megatron_cascade.model import weights_checkpoint as checkpoint
checkpoint._signal_safe_writer_queue()
print(checkpoint._MANAGERS[0]._process.pid, flush=True)
time.sleep(120)
"""


def test_the_writer_dies_with_a_sigkilled_trainer():
    """Issue 29: after SIGKILL of a trainer, its checkpoint writer's manager (~270 MiB) lived on."""
    import psutil

    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        manager = psutil.Process(int(trainer.stdout.readline()))
        trainer.kill()
        trainer.wait(timeout=30)
        gone, alive = psutil.wait_procs([manager], timeout=10)
        assert not alive, f"the writer's manager {manager.pid} outlived its trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        try:
            manager.kill()
        except (psutil.Error, NameError):
            pass
