#!/usr/bin/env bash
# The main job: install, then run the tiny cascade on CPU (sft -> if_rl -> math_rl -> code_rl -> mopd,
# with grpo_ref: GRPO from the same weights as MOPD, for comparison) and print its
# report (score ± standard error per stage and domain, pass@8, report.png). Extra arguments are config
# overrides (key=value). benchmarks/claims.py repeats it over seeds next to the mixed-RL baseline.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh
# What changes the demo's digits besides the seed: the number of threads (how each sum is split), the
# SIMD code path of torch's kernels, MKL's and oneDNN's, and the torch build (README, "What the demo
# shows"). Pinned to what README's table was made with and what any x86-64 CPU of the last decade has;
# set them to your own values to trade the match for speed.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    export ATEN_CPU_CAPABILITY="${ATEN_CPU_CAPABILITY:-avx2}"
    export MKL_CBWR="${MKL_CBWR:-AVX2}"
fi
export ONEDNN_MAX_CPU_ISA="${ONEDNN_MAX_CPU_ISA:-AVX2}"
OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/outputs/tiny_cascade}"
megatron-cascade run examples/tiny_cascade/cascade.yaml output_dir="$OUTPUT_DIR" "$@"
megatron-cascade report "$OUTPUT_DIR"
