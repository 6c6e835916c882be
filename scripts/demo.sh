#!/usr/bin/env bash
# The main job: install, then run the tiny cascade on CPU (sft -> if_rl -> math_rl -> mopd, with
# grpo_ref: GRPO from the same SFT weights as MOPD, for comparison -> code_rl from MOPD) and print its
# report (score ± standard error per stage and domain, pass@8, report.png). Extra arguments are config
# overrides (key=value). benchmarks/claims.py repeats it over seeds next to the mixed-RL baseline.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh
OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/outputs/tiny_cascade}"
megatron-cascade run examples/tiny_cascade/cascade.yaml output_dir="$OUTPUT_DIR" "$@"
megatron-cascade report "$OUTPUT_DIR"
