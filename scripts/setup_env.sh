#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install the package with its test extras.
# torch==2.13.0 goes first so that pip takes the CPU build instead of a multi-GB CUDA one.
# Usage: source scripts/setup_env.sh   (sets VENV and puts it first on PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_CASCADE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(md5sum < "$ROOT/setup.py" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -m pip install -q -e "${ROOT}[test]" 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -c "import megatron.core, torch, megatron_cascade" 2>/dev/null \
        || { echo "setup_env: installation failed" >&2; exit 1; }
    touch "$stamp"
fi
export VENV
export PATH="$VENV/bin:$PATH"
