#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install the package with its test extras.
# torch==2.13.0 goes first. On a machine without a GPU it comes from PyTorch's CPU index when that
# index answers (a ~200 MB wheel instead of PyPI's multi-GB CUDA build); otherwise from the default
# indexes (a local CPU wheel on some machines, else PyPI's CUDA build, which also runs on the CPU:
# CPU mode routes every Triton kernel to torch). TORCH_INDEX_URL overrides the choice.
# Usage: source scripts/setup_env.sh   (sets VENV and puts it first on PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_CASCADE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# Re-install when setup.py or the interpreter changes.
stamp="$VENV/.installed-$( (cat "$ROOT/setup.py"; "$VENV/bin/python" -V) | md5sum | cut -c1-12)"
pip_install() {
    # pip's notes about this machine's optional local indexes are noise; errors still show.
    "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
if [ ! -f "$stamp" ]; then
    pip_install --upgrade pip
    torch_index="${TORCH_INDEX_URL:-}"
    if [ -z "$torch_index" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
            && curl -sf --max-time 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/; then
        torch_index=https://download.pytorch.org/whl/cpu
    fi
    if [ -n "$torch_index" ]; then
        echo "setup_env: torch from $torch_index"
        pip_install torch==2.13.0 --index-url "$torch_index"
    else
        pip_install torch==2.13.0
    fi
    pip_install -e "${ROOT}[test]"
    # (-W: megatron-core's import-time notice that TE/apex are absent, 4 lines, is expected here)
    "$VENV/bin/python" -W "ignore:Transformer Engine and Apex are not installed" \
        -c "import megatron.core, torch, megatron_cascade, pytest, pytest_timeout, transformers" \
        || { echo "setup_env: installation is incomplete" >&2; exit 1; }
    touch "$stamp"
fi
export VENV
export PATH="$VENV/bin:$PATH"
