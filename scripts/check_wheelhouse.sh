#!/usr/bin/env bash
# Rehearse, on this machine (CPU, registry access), what a bare CUDA node does with the bundle of
# scripts/gpu_wheelhouse.sh: a fresh virtualenv of the node's Python with the node's torch only
# (PYTHON_VERSION 3.12, TORCH_SPEC torch==2.11.0 — the lent H200's), the bundle's parts joined and
# installed with no index and no pip configuration (as on a node that reaches no registry), then the
# GPU check's own CPU drive (tests/examples/test_gpu_check.py, with pytest added for it) and the
# doctor, megatron_cascade taken from this checkout as benchmarks/gpu_check.sh takes it.
#
#   bash scripts/check_wheelhouse.sh [WORK_DIR]     # default: dist/wheelhouse_check
#   (NODE_PYTHON: the node's interpreter, default python$PYTHON_VERSION)
#
# Exit status: that of the test run (0: the bundle installs and the checks pass on CPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(realpath -m "${1:-$ROOT/dist/wheelhouse_check}")"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.11.0}"
NODE_PYTHON="${NODE_PYTHON:-python$PYTHON_VERSION}"
if ! "$NODE_PYTHON" -c 'import venv' >/dev/null 2>&1; then
    echo "check_wheelhouse: $NODE_PYTHON does not run (the node's Python; set NODE_PYTHON)" >&2
    exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK/node"
PYTHON_VERSION="$PYTHON_VERSION" bash "$ROOT/scripts/gpu_wheelhouse.sh" "$WORK/bundle/gpu_wheelhouse"
"$NODE_PYTHON" -m venv "$WORK/venv"
# What the node already has: its Python and torch (the only registry install before the bundle).
"$WORK/venv/bin/python" -m pip install -q "$TORCH_SPEC"
# What the node does: join the parts, install from them alone.
cat "$WORK"/bundle/gpu_wheelhouse.tar.part-* | tar -x -C "$WORK/node"
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$WORK/venv/bin/python" -m pip install -q --no-index --find-links "$WORK/node/gpu_wheelhouse" \
    megatron-cascade transformers
"$WORK/venv/bin/python" -m pip install -q pytest pytest-timeout  # the drive's runner, not the node's
cd "$ROOT"
env -u RANK -u WORLD_SIZE PYTHONPATH="$ROOT" "$WORK/venv/bin/python" -m megatron_cascade.cli doctor || true
env -u RANK -u WORLD_SIZE PYTHONPATH="$ROOT" "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/examples/test_gpu_check.py
