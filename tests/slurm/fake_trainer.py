#!/usr/bin/env python3
"""Test-only stand-in for the ``megatron-cascade`` CLI (same contract, no torch).

    fake_trainer.py stages CONFIG [key=value ...]       -> "<stage>\\t<complete|partial|pending>" lines
    fake_trainer.py run CONFIG [key=value ...] --stage NAME   (the real CLI's argument order)
        exit 0  = stage complete
        exit 75 = got SIGUSR1/SIGTERM, checkpointed, please requeue
        other   = failure (message on stderr)

CONFIG is a JSON file::

    {"stages": ["sft", "math", "code"], "out": "/abs/dir", "steps": 4, "step_time": 0.1}

Overrides (``key=value``, JSON-decoded when possible) replace top-level keys; the test knobs are

    fail_stage=NAME      that stage exits 3 after its first step
    hold_stage=NAME      on its first attempt (no checkpoint yet) that stage blocks after
                         step 1 until a signal arrives (deterministic preemption tests)

State lives in ``<out>/<stage>/``: ``ckpt`` (last saved step, written by rank 0), ``DONE`` and
``events.jsonl`` (one JSON object per rank and event: start / signal / exit, with the
torchrun-style variables the rank saw).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

EX_TEMPFAIL = 75


def load_config(path: str, overrides: list[str]) -> dict:
    cfg = json.loads(Path(path).read_text())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"fake_trainer: bad override {item!r}, expected key=value")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    return cfg


def stage_dir(cfg: dict, stage: str) -> Path:
    return Path(cfg["out"]) / stage


def status(cfg: dict, stage: str) -> str:
    d = stage_dir(cfg, stage)
    if (d / "DONE").exists():
        return "complete"
    if (d / "ckpt").exists():
        return "partial"
    return "pending"


def event(cfg: dict, stage: str, kind: str, **extra) -> None:
    d = stage_dir(cfg, stage)
    d.mkdir(parents=True, exist_ok=True)
    rec = {
        "event": kind,
        "pid": os.getpid(),
        "time": time.time(),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "job": os.environ.get("SLURM_JOB_ID"),
        **{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        **extra,
    }
    with open(d / "events.jsonl", "a") as f:  # O_APPEND: one small write per line
        f.write(json.dumps(rec) + "\n")


def cmd_stages(cfg: dict) -> int:
    for stage in cfg["stages"]:
        print(f"{stage}\t{status(cfg, stage)}")
    return 0


def cmd_run(cfg: dict, stage: str) -> int:
    if stage not in cfg["stages"]:
        print(f"fake_trainer: unknown stage {stage!r}", file=sys.stderr)
        return 2
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            print(f"fake_trainer: {var} not set", file=sys.stderr)
            return 2
    rank = int(os.environ["RANK"])
    d = stage_dir(cfg, stage)
    d.mkdir(parents=True, exist_ok=True)
    ckpt = d / "ckpt"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    first_attempt = not ckpt.exists()

    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    event(cfg, stage, "start", step=start)
    steps = int(cfg.get("steps", 4))
    step_time = float(cfg.get("step_time", 0.1))
    step = start
    while step < steps:
        time.sleep(step_time)
        step += 1
        if rank == 0:
            (d / "progress").write_text(str(step))
        if cfg.get("fail_stage") == stage:
            print(f"fake_trainer: stage {stage} failed at step {step} (fail_stage)", file=sys.stderr)
            event(cfg, stage, "exit", code=3, step=step)
            return 3
        if cfg.get("hold_stage") == stage and first_attempt and step == 1:
            event(cfg, stage, "holding", step=step)
            deadline = time.monotonic() + float(cfg.get("hold_timeout", 60))
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
        if got:
            event(cfg, stage, "signal", signum=got[0], step=step)
            if rank == 0:
                tmp = d / "ckpt.tmp"
                tmp.write_text(str(step))
                tmp.replace(ckpt)
            print(f"fake_trainer: rank {rank} checkpointed {stage} at step {step}, exit 75", flush=True)
            event(cfg, stage, "exit", code=EX_TEMPFAIL, step=step)
            return EX_TEMPFAIL
    if rank == 0:
        (d / "DONE").write_text(str(step))
        tmp = d / "ckpt.tmp"
        tmp.write_text(str(step))
        tmp.replace(ckpt)
    print(f"fake_trainer: rank {rank} finished {stage} ({step} steps)", flush=True)
    event(cfg, stage, "exit", code=0, step=step)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "stages":
        return cmd_stages(load_config(argv[1], argv[2:]))
    if len(argv) >= 4 and argv[0] == "run" and "--stage" in argv[2:-1]:
        i = argv.index("--stage", 2)
        return cmd_run(load_config(argv[1], argv[2:i] + argv[i + 2:]), argv[i + 1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
