#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install the package with its test extras.
# torch==2.13.0 goes first: on these machines pip takes it from the local CPU wheel instead of a
# multi-GB CUDA build (elsewhere, point pip at PyTorch's CPU index for the same effect).
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
    pip_install torch==2.13.0
    pip_install -e "${ROOT}[test]"
    "$VENV/bin/python" -c "import megatron.core, torch, megatron_cascade, pytest, pytest_timeout, transformers" \
        || { echo "setup_env: installation is incomplete" >&2; exit 1; }
    touch "$stamp"
fi
export VENV
export PATH="$VENV/bin:$PATH"
