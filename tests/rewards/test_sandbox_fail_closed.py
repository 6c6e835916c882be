"""Where isolation cannot be had (here: a trainer without CAP_SYS_ADMIN, Docker's default) the code
reward refuses to run, with one error naming what is missing, unless its kwargs allow the unsafe mode,
which then warns once (issue 13: without CAP_SYS_ADMIN the sandbox fell back to rlimits and stayed open).

The trainer is a child process that dropped CAP_SYS_ADMIN from its bounding set before exec (root's
capabilities after exec are the bounding set's), so the kernel itself refuses the namespaces."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21

_TRAINER = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    from megatron_cascade.rewards import build_reward, score_batch
    kwargs = json.loads(sys.argv[1])
    reward = build_reward("code", {"timeout_s": 5, **kwargs})
    response = "```python\\nprint(input()[::-1])\\n```"
    row = {"tests": [{"input": "abc", "output": "cba"}]}
    try:
        reward.fn.preflight(**reward.kwargs)
        preflight = "ok"
    except Exception as e:
        preflight = f"{type(e).__name__}: {e}"
    try:
        single = reward(response, row)
    except Exception as e:
        single = f"{type(e).__name__}: {e}"
    scores, errors = score_batch(reward, [response, response], [row, row])
    print(json.dumps({"preflight": preflight, "single": single, "scores": scores, "errors": errors}))
""")


def _drop_sys_admin() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
        os._exit(3)


def _run_trainer(kwargs: dict) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", _TRAINER, json.dumps(kwargs)], capture_output=True, text=True,
                         timeout=120, preexec_fn=_drop_sys_admin)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module", autouse=True)
def _needs_root():
    if os.geteuid() != 0:
        pytest.skip("simulates a root trainer that lacks CAP_SYS_ADMIN (needs root to drop it)")


def test_refuses_without_cap_sys_admin():
    result, log = _run_trainer({})
    assert result["single"].startswith("SandboxUnavailableError"), result
    assert result["preflight"] == result["single"]  # a run can refuse before its first step
    for words in ("CAP_SYS_ADMIN", "allow_unsafe_sandbox"):
        assert words in result["single"], result["single"]
    assert result["scores"] == [0.0, 0.0] and result["errors"] == 2


def test_unsafe_mode_runs_and_warns_once():
    result, log = _run_trainer({"allow_unsafe_sandbox": True})
    assert result["preflight"] == "ok"
    assert result["single"] == 1.0 and result["scores"] == [1.0, 1.0] and result["errors"] == 0
    warnings = [line for line in log.splitlines() if line.startswith("LOG WARNING") and "UNSAFE" in line]
    assert len(warnings) == 1, log
