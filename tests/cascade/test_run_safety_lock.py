"""One run per output_dir: an exclusive ``flock`` on ``OUTPUT_DIR/.megatron-cascade.lock``.

* A second run on a directory a running trainer holds is refused (exit 2) naming the holder's host,
  pid and start time; before the lock both trained into the same folder (a hybrid run).
* A two-rank launch refused by its rank 0 stops on every rank (no rank left waiting in a collective).
* The kernel drops the lock when its holder dies, even by SIGKILL and even while a child it forked
  (a multiprocessing worker) lives on; a Slurm requeue (same job id, higher restart count) waits for
  its previous incarnation, another job is refused at once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from cascade_fixtures import TINY, cli_command, run_cli

from megatron_cascade.cascade.run_lock import LOCK_FILE, RunLockError, acquire_run_lock

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64}}
training: {{micro_batch_size: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0, keep_last: 2}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: {steps}, prompts_per_step: 8, domains: {{math: 1.0}}}}
"""

# A process that takes the lock (printing "held" once it has it) and sleeps; with "fork" it first
# forks a child (as a fork-started multiprocessing worker would) that sleeps on after the parent dies.
HOLDER = """
import os, sys, time
from megatron_cascade.cascade.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
if sys.argv[2] == "fork" and os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _no_slurm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra)
    return env


def _write_config(tmp_path, steps: int) -> tuple[str, str]:
    out = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tiny=TINY, out=out, steps=steps))
    return str(path), out


def _start_holder(out: str, mode: str = "plain", hold_s: float = 60, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, out, mode, str(hold_s)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env=env or _no_slurm_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.slow
def test_a_second_run_on_the_output_dir_of_a_running_one_is_refused_naming_the_holder(tmp_path):
    config, out = _write_config(tmp_path, steps=3000)  # outlasts the second run; killed after it
    first = subprocess.Popen(cli_command("run", config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env=_no_slurm_env())
    try:
        deadline = time.monotonic() + 120
        while not os.path.isfile(os.path.join(out, "manifest.json")):  # the first run is under way
            assert first.poll() is None, "the first run ended early"
            assert time.monotonic() < deadline, "the first run never started"
            time.sleep(0.05)
        second = run_cli("run", config, timeout=240, env=_no_slurm_env())
        assert first.poll() is None, "the first run must still be running (else the test proves nothing)"
    finally:
        _kill(first)
    assert second.returncode == 2, second.stdout[-3000:]
    text = second.stdout
    assert "is in use by another run" in text, text[-3000:]
    assert f"pid {first.pid}" in text and socket.gethostname() in text and "started " in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_two_ranks_refused_by_rank_0_both_stop(tmp_path):
    """Rank 0 alone takes the lock; rank 1 must learn the refusal instead of waiting in a collective."""
    from megatron_cascade.cascade.runtime import find_free_port

    config, out = _write_config(tmp_path, steps=2)
    port = str(find_free_port())
    with acquire_run_lock(out):  # held by this test process
        procs = [subprocess.Popen(cli_command("run", config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True,
                                  env=_no_slurm_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                    LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                    MASTER_PORT=port))
                 for r in range(2)]
        try:
            outputs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            for p in procs:
                _kill(p)
    assert [p.returncode for p in procs] == [2, 2], "\n".join(o[-2000:] for o in outputs)
    assert f"pid {os.getpid()}" in outputs[0], outputs[0][-2000:]
    assert "is in use by another run" in outputs[1], outputs[1][-2000:]
    assert not os.path.exists(os.path.join(out, "manifest.json"))  # nothing was written by the refused run


def test_the_lock_names_its_holder_and_is_free_again_after_release(tmp_path):
    out = str(tmp_path / "run")
    holder = _start_holder(out)
    try:
        with pytest.raises(RunLockError) as refused:
            acquire_run_lock(out)
    finally:
        _kill(holder)
    message = str(refused.value)
    assert f"pid {holder.pid}" in message and socket.gethostname() in message, message
    assert os.path.join(out, LOCK_FILE) in message, message
    with acquire_run_lock(out):
        pass
    with acquire_run_lock(out):  # released on exit from the block
        pass


def test_sigkill_of_the_holder_releases_the_lock_even_with_a_forked_child_alive(tmp_path):
    out = str(tmp_path / "run")
    holder = _start_holder(out, mode="fork")
    try:
        children = subprocess.run(["pgrep", "-g", str(holder.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children  # the holder and its forked child
        os.kill(holder.pid, signal.SIGKILL)  # the holder only: its child sleeps on
        holder.wait()
        child = int(next(pid for pid in children if int(pid) != holder.pid))
        os.kill(child, 0)  # still alive
        with acquire_run_lock(out):
            pass
    finally:
        _kill(holder)


def test_a_requeued_slurm_job_waits_for_its_previous_incarnation_another_job_is_refused(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    holder = _start_holder(out, hold_s=2.0, env=_no_slurm_env(SLURM_JOB_ID="777", SLURM_RESTART_COUNT="0"))
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "778")
        start = time.monotonic()
        with pytest.raises(RunLockError, match="Slurm job 777"):
            acquire_run_lock(out)
        assert time.monotonic() - start < 1.0  # another job: refused at once
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with acquire_run_lock(out, requeue_wait_s=60):  # the requeue: waits for the holder's exit
            assert holder.poll() is not None
    finally:
        _kill(holder)


def test_an_output_dir_that_cannot_hold_a_lock_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RunLockError, match="cannot create the lock file .*output_dir must be a writable folder"):
        acquire_run_lock(str(blocker / "run"))
