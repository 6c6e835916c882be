"""``megatron-cascade doctor [CONFIG]``: what this machine has, and what of a config will not run here.

The first thing to run on a new node (GPU or not): versions of everything the GPU path uses (a
package counts as usable only when it imports — Transformer Engine's torch extension, flash-attn's
CUDA kernels — each probed in a child process, so a broken extension cannot take this one down),
the GPUs and their memory, and for a config one line per feature that will not run here, with why
and what to change. Exit status 1 when a config has any such line.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_cascade.config import ConfigError, RunConfig, load_config
from megatron_cascade.config.loader import resolve_stage
from megatron_cascade.models.architectures import megatron_architecture
from megatron_cascade.rollout.params import FLASH_ATTN2_BLOCK_MULTIPLE

# (distribution names to try, module whose import proves the package usable)
PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "megatron-core": (("megatron-core",), "megatron.core"),
    "triton": (("triton",), "triton"),
    "transformer-engine": (("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"),
                           "transformer_engine.pytorch"),
    "flash-attn": (("flash-attn",), "flash_attn"),
    "flash-attn-3": (("flash-attn-3", "flash_attn_3"), "flash_attn_interface"),
    "mamba-ssm": (("mamba-ssm",), "mamba_ssm"),
    "causal-conv1d": (("causal-conv1d",), "causal_conv1d"),
    "apex": (("apex",), "apex.normalization"),
}
FLASH_ATTN_MIN = (2, 7, 3)  # megatron-core's paged KV-cache attention (dynamic inference)
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer
PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Package:
    """An installed distribution: its version, and why it does not import (None: it does)."""

    version: str
    problem: Optional[str] = None


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    capability: tuple[int, int]


@dataclass(frozen=True)
class Environment:
    """What ``probe_environment`` found; packages not installed are absent from ``packages``."""

    python: str
    torch: str
    cuda: Optional[str] = None  # torch's CUDA build
    cudnn: Optional[int] = None
    nccl: Optional[str] = None
    gpus: tuple[GPU, ...] = ()
    packages: dict[str, Package] = field(default_factory=dict)

    def usable(self, name: str) -> bool:
        package = self.packages.get(name)
        return package is not None and package.problem is None

    def version_at_least(self, name: str, minimum: tuple[int, ...]) -> bool:
        return self.usable(name) and _version_tuple(self.packages[name].version) >= minimum


def probe_environment(import_probe: Optional[Callable[[str], Optional[str]]] = None) -> Environment:
    """This machine's torch build, GPUs and GPU-path packages (each installed one import-probed)."""
    probe = import_probe or _import_problem
    packages = {}
    for name, (dists, module) in PACKAGES.items():
        version = _installed_version(dists)
        if version is not None:
            packages[name] = Package(version, probe(module))
    gpus, nccl = (), None
    if torch.cuda.is_available():
        gpus = tuple(GPU(p.name, p.total_memory / 2**30, (p.major, p.minor))
                     for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count())))
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Environment(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                       cudnn=cudnn, nccl=nccl, gpus=gpus, packages=packages)


def describe_environment(env: Environment) -> list[str]:
    """One line per fact: versions, GPUs, packages (usable or why not)."""
    lines = [f"python {env.python}; torch {env.torch} (CUDA build {env.cuda or 'none'}, cuDNN {env.cudnn or '-'}, "
             f"NCCL {env.nccl or '-'})"]
    if env.gpus:
        for index, gpu in enumerate(env.gpus):
            lines.append(f"gpu {index}: {gpu.name}, {gpu.memory_gib:.1f} GiB, compute capability "
                         f"{gpu.capability[0]}.{gpu.capability[1]}")
    else:
        lines.append("gpu: none (CPU mode: gloo, the local layer spec and the torch stand-ins of the GPU kernels)")
    for name in PACKAGES:
        package = env.packages.get(name)
        if package is None:
            lines.append(f"{name}: not installed")
        elif package.problem is None:
            lines.append(f"{name}: {package.version}")
        else:
            lines.append(f"{name}: {package.version} installed but does not import: {package.problem}")
    return lines


def config_problems(cfg: RunConfig, env: Environment,
                    sandbox_problem: Optional[Callable[[RunConfig], list[str]]] = None) -> list[str]:
    """What of ``cfg`` will not run on ``env``, one line each (key: why, and what to change)."""
    problems = []
    gpu = bool(env.gpus)
    te = env.usable("transformer-engine")
    m = cfg.model
    if m.fp8.format is not None:
        capability = min((g.capability for g in env.gpus), default=None)
        if not (te and capability is not None and capability >= FP8_MIN_CAPABILITY):
            where = (f"compute capability {capability[0]}.{capability[1]}" if capability else "no GPU")
            problems.append(f"model.fp8.format={m.fp8.format.value}: FP8 needs Transformer Engine's torch extension "
                            f"and a GPU of compute capability >= 8.9 (here: {where}, Transformer Engine "
                            f"{'usable' if te else 'not usable'}); set model.fp8.format=null")
    if m.moe is not None and m.moe.grouped_gemm and not (gpu and te):
        problems.append("model.moe.grouped_gemm=true: Transformer Engine's grouped GEMM needs its torch extension "
                        "and a GPU; set model.moe.grouped_gemm=false")
    if gpu and cfg.parallel.context_parallel_size > 1 and not te:
        problems.append(f"parallel.context_parallel_size={cfg.parallel.context_parallel_size}: context-parallel "
                        "attention on GPU is Transformer Engine's; install it or set it to 1")
    if gpu and cfg.cluster.transformer_engine and not te:
        problems.append("cluster.transformer_engine=true: the plan assumes Transformer Engine's layer spec, but it "
                        "does not import here (the run would take the local spec); install it or set it to false")
    for name in megatron_architecture(m).gpu_packages if gpu else ():
        if not env.usable(name):
            problems.append(f"model.architecture={m.architecture}: its layers' GPU kernels need {name} "
                            f"({_state(env, name)}): pip install --no-build-isolation {name}")
    if gpu and _generates(cfg):
        problems += _generation_problems(cfg, env)
    memory = min((g.memory_gib for g in env.gpus), default=None)
    if memory is not None and memory + 0.5 < cfg.cluster.gpu_memory_gib:
        problems.append(f"cluster.gpu_memory_gib={cfg.cluster.gpu_memory_gib:g}: this node's GPUs have "
                        f"{memory:.1f} GiB; the dry run's plan assumes more (set it to {int(memory)})")
    problems += (sandbox_problem or sandbox_problems)(cfg)
    return problems


def _generation_problems(cfg: RunConfig, env: Environment) -> list[str]:
    """Paged generation on GPU: flash-attn's paged kernels (>= 2.7.3, or FA3), 16-bit weights, and
    flash-attn 2's block multiple of 256."""
    problems = []
    fa3 = env.usable("flash-attn-3")
    if not fa3 and not env.version_at_least("flash-attn", FLASH_ATTN_MIN):
        problems.append(f"rollouts and evaluation: the paged KV cache needs flash-attn >= 2.7.3 or flash-attn 3 on GPU "
                        f"(flash-attn: {_state(env, 'flash-attn')}): pip install --no-build-isolation 'flash-attn>=2.7.3'")
    if cfg.model.precision == "fp32":
        problems.append("model.precision=fp32: flash-attn's paged kernels take bf16/fp16 only; set model.precision=bf16")
    if not fa3:
        keys = {}  # the key each bad block size comes from: a stage's override, else the run-level one
        for stage_cfg in cfg.stages:
            block = resolve_stage(cfg, stage_cfg).rollout.kv_block_size_tokens
            if block % FLASH_ATTN2_BLOCK_MULTIPLE:
                own = "kv_block_size_tokens" in (stage_cfg.rollout or {})
                keys[f"stages.{stage_cfg.name}.rollout" if own else "rollout"] = block
        for key, block in keys.items():
            problems.append(f"{key}.kv_block_size_tokens={block}: flash-attn 2's paged kernels need a multiple of "
                            f"{FLASH_ATTN2_BLOCK_MULTIPLE} (flash-attn 3 takes any)")
    return problems


def sandbox_problems(cfg: RunConfig) -> list[str]:
    """Domains whose rewards or environments run model-written code in the sandbox, where its isolated
    mode cannot be had here and the domain does not allow the unisolated one."""
    from megatron_cascade.rewards.sandbox import CodeSandbox, SandboxUnavailableError

    problems = []
    for name, domain in cfg.domains.items():
        uses = []
        if domain.reward.name == "code":
            uses.append(("reward", domain.reward.kwargs))
        env_kwargs = domain.environment.kwargs
        if domain.environment.name == "swe" or (domain.environment.name == "tool_calling"
                                                and "python" in (env_kwargs.get("tools") or {})):
            uses.append(("environment", env_kwargs))
        for part, kwargs in uses:
            try:
                CodeSandbox(allow_unsafe=bool(kwargs.get("allow_unsafe_sandbox", False))).resolve_backend()
            except SandboxUnavailableError as exc:
                reason = str(exc).split(". Isolation needs", 1)[0]
                problems.append(f"domains.{name}.{part}: {reason}; to run its programs unisolated (trusted data "
                                f"only): domains.{name}.{part}.kwargs.allow_unsafe_sandbox=true")
    return problems


def run_doctor(config: Optional[str], overrides: list[str]) -> int:
    """Print the environment, then (with a config) its problems here; 1 if any, else 0."""
    env = probe_environment()
    print("\n".join(describe_environment(env) + [_sandbox_line()]))
    if config is None:
        return 0
    problems = []
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:  # a missing data file or checkpoint: report it, check the rest
        cfg = load_config(config, overrides, check_paths=False)
        problems.append(str(exc))
    problems += config_problems(cfg, env)
    if not problems:
        print(f"{config}: every feature it uses runs here")
        return 0
    print(f"{config}: {len(problems)} problem(s) here:")
    for line in problems:
        print(f"  - {line}")
    return 1


def _sandbox_line() -> str:
    """Which code-sandbox mode this machine gives (``rewards/sandbox.py``)."""
    from megatron_cascade.rewards.sandbox import (SandboxUnavailableError, isolation_kind, isolation_problem,
                                                  program_python)

    try:
        problem = isolation_problem(program_python())
    except SandboxUnavailableError as exc:
        problem = str(exc)
    if problem is None:
        how = ("a uid per program" if isolation_kind() == "root"
               else "in an unprivileged user namespace: the programs run as your uid, which is all the namespace maps")
        return f"code sandbox: isolated mode works here (namespaces, seccomp, {how})"
    return (f"code sandbox: isolated mode unavailable ({problem}); model-written programs run only where a "
            "domain sets allow_unsafe_sandbox: true (rlimits only)")


def _generates(cfg: RunConfig) -> bool:
    from megatron_cascade.config.stage_types import stage_type

    return cfg.eval.enabled or any(stage_type(s.type).generates for s in cfg.stages)


def _state(env: Environment, name: str) -> str:
    package = env.packages.get(name)
    if package is None:
        return "not installed"
    return package.version if package.problem is None else f"{package.version}, does not import"


def _installed_version(dists: tuple[str, ...]) -> Optional[str]:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_problem(module: str) -> Optional[str]:
    """None if ``module`` imports in a fresh interpreter, else the error's last line (a crash or a hang
    of a broken CUDA extension stays in the child)."""
    try:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return f"import {module} did not finish in {PROBE_TIMEOUT_S} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"import {module} exited with {proc.returncode}"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
