"""``megatron-cascade doctor [CONFIG]``: versions and GPUs of this machine, and one line (exit 1) per
feature of a config that will not run here, with the change that makes it run."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cascade.config import load_config
from megatron_cascade.doctor import GPU, Environment, Package, config_problems

ROOT = Path(__file__).resolve().parents[2]
CI = str(ROOT / "examples" / "tiny_cascade" / "ci.yaml")
HYBRID = str(ROOT / "examples" / "tiny_cascade" / "hybrid.yaml")
PR_CAPBSET_DROP, CAP_SYS_ADMIN = 24, 21


def _doctor(*args: str, drop_sys_admin: bool = False) -> subprocess.CompletedProcess:
    def drop() -> None:  # a trainer without CAP_SYS_ADMIN (a default Docker container): no isolated sandbox
        if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
            os._exit(3)

    return subprocess.run([sys.executable, "-m", "megatron_cascade.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, preexec_fn=drop if drop_sys_admin else None)


def test_doctor_prints_this_machine_and_passes_the_demo_here():
    # As a normal user the code sandbox cannot isolate (doctor says so, tested below as root): allow its
    # unisolated mode so that the rest of the demo's config is what is checked.
    unsafe = [] if os.geteuid() == 0 else ["domains.code.reward.kwargs.allow_unsafe_sandbox=true"]
    res = _doctor(CI, *unsafe)
    assert res.returncode == 0, res.stdout + res.stderr
    for words in ("python ", "torch ", "megatron-core: 0.16", "transformer-engine: not installed", "gpu: none",
                  "code sandbox:", "every feature it uses runs here"):
        assert words in res.stdout, res.stdout
    fp8 = _doctor(CI, *unsafe, "model.precision=bf16", "model.fp8.format=hybrid")
    assert fp8.returncode == 1 and "model.fp8.format=hybrid: FP8 needs Transformer Engine" in fp8.stdout, fp8.stdout


def test_doctor_without_isolation_gives_the_command_line_override():
    if os.geteuid() != 0:
        pytest.skip("drops CAP_SYS_ADMIN from a root process")
    res = _doctor(CI, drop_sys_admin=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "code sandbox: isolated mode unavailable" in res.stdout
    assert "domains.code.reward: code sandbox unavailable" in res.stdout
    assert "domains.code.reward.kwargs.allow_unsafe_sandbox=true" in res.stdout
    allowed = _doctor(CI, "domains.code.reward.kwargs.allow_unsafe_sandbox=true", drop_sys_admin=True)
    assert allowed.returncode == 0, allowed.stdout


def test_doctor_names_each_gpu_feature_that_cannot_run():
    """A GPU node with an old flash-attn and no Mamba kernels, for the hybrid demo in fp32 with a block
    size flash-attn 2 cannot page, FP8 on an Ampere GPU, and a plan for more memory than the GPU has."""
    env = Environment(python="3.12", torch="2.11", cuda="13.0", gpus=(GPU("A100-SXM4-40GB", 39.4, (8, 0)),),
                      packages={"transformer-engine": Package("2.10.0"), "flash-attn": Package("2.6.3"),
                                "mamba-ssm": Package("2.2.4", problem="ImportError: libcudart.so.12")})
    # (the tiny configs plan their 24 GiB CPU machine; here the cluster this GPU node is planned as)
    cfg = load_config(HYBRID, ["model.precision=fp32", "rollout.kv_block_size_tokens=64", "cluster.gpu_memory_gib=80"],
                      check_paths=False)
    problems = config_problems(cfg, env, sandbox_problem=lambda cfg: [])
    text = "\n".join(problems)
    for words in ("flash-attn >= 2.7.3", "model.precision=fp32", "\nrollout.kv_block_size_tokens=64",
                  "need mamba-ssm (2.2.4, does not import)", "need causal-conv1d (not installed)",
                  "cluster.gpu_memory_gib=80: this node's GPUs have 39.4 GiB"):
        assert words in text, text
    fp8 = load_config(CI, ["model.precision=bf16", "model.fp8.format=hybrid"], check_paths=False)
    assert any("compute capability 8.0" in line for line in config_problems(fp8, env, lambda cfg: []))
    hopper = Environment(python="3.12", torch="2.11", cuda="13.0", gpus=(GPU("H100", 79.6, (9, 0)),),
                         packages={"transformer-engine": Package("2.10.0"), "flash-attn": Package("2.8.3"),
                                   "mamba-ssm": Package("2.2.4"), "causal-conv1d": Package("1.5.2")})
    assert config_problems(fp8, hopper, lambda cfg: []) == []
