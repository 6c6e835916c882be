#!/usr/bin/env bash
# The main job: install, then run the tiny cascade (sft -> if_rl -> math_rl -> mopd -> code_rl) on
# CPU and print its report. Extra arguments are config overrides (key=value).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh
OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/outputs/tiny_cascade}"
megatron-cascade run examples/tiny_cascade/cascade.yaml output_dir="$OUTPUT_DIR" "$@"
megatron-cascade report "$OUTPUT_DIR"
