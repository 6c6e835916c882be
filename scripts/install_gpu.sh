#!/usr/bin/env bash
# Install megatron-cascade on a GPU node into the current Python (a container's, or a cluster
# module's: the one that holds the CUDA torch; no virtualenv is made). Versions come from setup.py
# (its gpu and hybrid extras), never from here.
#   bash scripts/install_gpu.sh                    # NGC PyTorch container: its torch, Transformer Engine
#                                                  # and flash-attn stay as they are
#   bash scripts/install_gpu.sh --build            # bare CUDA node with a CUDA torch: also builds TE's
#                                                  # torch extension and flash-attn against that torch
#   bash scripts/install_gpu.sh [--build] --hybrid # + mamba-ssm and causal-conv1d (Nemotron-3-Nano)
# Then `megatron-cascade doctor CONFIG` says what of a config will not run here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
build=0
hybrid=0
for arg in "$@"; do
    case "$arg" in
        --build) build=1 ;;
        --hybrid) hybrid=1 ;;
        *) echo "usage: $0 [--build] [--hybrid]" >&2; exit 2 ;;
    esac
done
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "install_gpu: $PYTHON has no CUDA build of torch; install one first (https://pytorch.org/get-started)" >&2
    exit 1
fi
pip_install() { "$PYTHON" -m pip install "$@"; }
requirements() {
    # The package's requirements of one extra ("" = the base ones, torch left out: it stays as it is).
    "$PYTHON" - "$1" <<'PY'
import importlib.metadata
import re
import sys

extra = sys.argv[1]
for req in importlib.metadata.requires("megatron-cascade") or []:
    name, _, marker = req.partition(";")
    wanted = re.search(r'extra\s*==\s*"([^"]+)"', marker)
    if (wanted.group(1) if wanted else "") == extra and not re.match(r"torch\b", name.strip()):
        print(name.strip())
PY
}
# The package alone (so that pip never replaces the node's torch, TE or flash-attn), then what it needs.
pip_install --no-deps -e "$ROOT"
requirements "" | xargs -r -d '\n' "$PYTHON" -m pip install
if [ "$build" = 1 ]; then
    # CUDA extensions compile against the installed torch: without build isolation (pip's isolated build
    # would download another torch and build against that one).
    requirements gpu | xargs -r -d '\n' "$PYTHON" -m pip install --no-build-isolation
fi
if [ "$hybrid" = 1 ]; then
    requirements hybrid | xargs -r -d '\n' "$PYTHON" -m pip install --no-build-isolation
fi
"$PYTHON" -m megatron_cascade.cli doctor
