#!/bin/bash
# GPU check on ONE GPU, bounded to 7.5 minutes in all (doctor 45 s, main checks 300 s, hybrid 75 s,
# 10 s grace each; GPU_CHECK_*_LIMIT_S change them): a 4-layer slice of the Qwen3-30B-A3B recipe's MoE
# model trained at 8K and 32K tokens (peak memory vs the dry run's plan), a CPU-written MoE checkpoint
# into grouped experts, a Transformer Engine spec model (local spec when TE is absent), a CPU-written
# checkpoint loaded into it, bf16 steps after the load (fp32 masters reloaded), an optimizer resume,
# generation, the decode copy (rollout.parallel: refit over NCCL, bit-identical weights, same tokens,
# KV on demand preempting) with and without CUDA graphs, FP8 (TE only: steps, a checkpoint's scales
# restored, the bf16 frozen copy vs FP8, generation); hybrid: the paged engine with the mamba_ssm /
# causal_conv1d kernels (and under a tight budget) and the static context vs a full recompute; prints
# step time, tokens/s, refit time and peak memory. Without TE / flash-attn / mamba-ssm (a node with
# torch only: scripts/gpu_wheelhouse.sh) the torch stand-ins run instead (megatron_cascade/torch_kernels.py).
#
#   benchmarks/gpu_check.sh [gpu_check.py options, e.g. --json results.json]
#
# Installs nothing: PYTHON (default: python3, or $VENV/bin/python) must already have torch and
# megatron-core (carried wheels or a prepared venv); megatron_cascade comes from this working tree.
# Exit status: 0 all checks passed or skipped, 1 a check failed, 2 no CUDA device, 124 over time.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
if [[ -n ${VENV:-} ]]; then
    PYTHON=${PYTHON:-$VENV/bin/python}
fi
PYTHON=${PYTHON:-python3}
LIMIT_S=${GPU_CHECK_LIMIT_S:-300}
HYBRID_LIMIT_S=${GPU_CHECK_HYBRID_LIMIT_S:-75}
DOCTOR_LIMIT_S=${GPU_CHECK_DOCTOR_LIMIT_S:-45}

command -v "$PYTHON" >/dev/null || { echo "gpu_check.sh: $PYTHON not found (set PYTHON or VENV)" >&2; exit 2; }
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False): nothing checked" >&2
    exit 2
fi
# One process, one GPU; Megatron's in-order kernel issue as on the cluster (slurm/stage.sbatch).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# Preflight: versions, GPUs and which GPU-path packages import (informational; never fails the check).
timeout "$DOCTOR_LIMIT_S" "$PYTHON" -m megatron_cascade.cli doctor || true
status=0
timeout --signal=TERM --kill-after=10 "$LIMIT_S" "$PYTHON" "$HERE/gpu_check.py" "$@" || status=$?
# The hybrid (Mamba-2) model: TE mamba_stack_spec and mamba_ssm kernels vs the CPU-written weights,
# cached SSM state in generation (SKIPs its TE/mamba_ssm parts where they do not import).
hybrid=0
timeout --signal=TERM --kill-after=10 "$HYBRID_LIMIT_S" "$PYTHON" "$HERE/gpu_check_hybrid.py" || hybrid=$?
if (( status == 0 )); then status=$hybrid; fi
exit "$status"
