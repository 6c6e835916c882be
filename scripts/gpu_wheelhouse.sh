#!/usr/bin/env bash
# Build, on a machine with registry access, the bundle a bare CUDA node needs to run
# benchmarks/gpu_check.sh when that node has torch only and can install nothing from a registry:
# every distribution megatron-cascade's base requirements (and transformers, for the Nemotron-H check)
# pull in, at the versions of this project's virtualenv, as wheels for the node's Python, torch and
# what torch already brings (sympy, networkx, jinja2, filelock, fsspec, nvidia-*, triton) left out;
# megatron-cascade itself as a wheel; packed in parts of at most PART_MIB (default 60) MiB, for
# carriers that move 64 MiB at a time.
#
#   bash scripts/gpu_wheelhouse.sh [OUT_DIR]      # default: dist/gpu_wheelhouse; PYTHON_VERSION=3.12
#
# On the node: cat gpu_wheelhouse.tar.part-* | tar -x, then
#   python -m pip install --no-index --find-links gpu_wheelhouse megatron-cascade transformers
# (the wheels it lacks are torch's own: pip stops naming them), and run
#   bash benchmarks/gpu_check.sh (from a checkout, or PYTHONPATH pointing at one): without TE,
# flash-attn or mamba-ssm the checks run on the local layer spec with the torch stand-ins
# (megatron_cascade/torch_kernels.py) and SKIP what needs TE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/dist/gpu_wheelhouse}")"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
PART_MIB="${PART_MIB:-60}"
cd "$ROOT"
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh >/dev/null
set -euo pipefail
rm -rf "$OUT"
mkdir -p "$OUT"
# name==version of every distribution in the closure, torch's own closure excluded.
python - "$OUT/requirements.txt" <<'PY'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement


def closure(names, extras_of=None):
    seen, todo = {}, list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        seen[key] = dist
        extras = (extras_of or {}).get(key, ())
        for text in dist.requires or []:
            req = Requirement(text)
            env = [{"extra": e} for e in ("", *extras)]
            if req.marker is None or any(req.marker.evaluate(e) for e in env):
                todo.append(req.name)
    return seen


ours = closure(["megatron-cascade", "transformers"])
torch_own = closure(["torch"])
wanted = sorted((k, d.version) for k, d in ours.items() if k not in torch_own and k != "megatron-cascade")
with open(sys.argv[1], "w") as f:
    f.writelines(f"{k}=={v}\n" for k, v in wanted)
print(f"gpu_wheelhouse: {len(wanted)} distributions (torch and its {len(torch_own) - 1} dependencies left to the node)")
PY
binary=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform linux_x86_64 --platform any)
while read -r req; do
    # A wheel for the node's Python where the registry has one, else one built here (pure-Python sdists:
    # antlr4-python3-runtime, which omegaconf needs, has no wheel).
    if ! python -m pip download -q --no-deps "${binary[@]}" -d "$OUT" "$req" 2>/dev/null; then
        python -m pip wheel -q --no-deps -w "$OUT" "$req"
    fi
done < "$OUT/requirements.txt"
python -m pip wheel -q --no-deps -w "$OUT" "$ROOT"
# Anything compiled for this machine's Python instead of the node's would not install there.
bad=$(find "$OUT" -name '*.whl' | grep -E -- '-cp3[0-9]+-' | grep -v -E -- "-cp${PYTHON_VERSION/./}-|-abi3-" || true)
if [ -n "$bad" ]; then
    echo "gpu_wheelhouse: built for another Python than $PYTHON_VERSION:" >&2
    echo "$bad" >&2
    exit 1
fi
(cd "$(dirname "$OUT")" && tar -cf - "$(basename "$OUT")" | split -b "${PART_MIB}M" -d - "$(basename "$OUT").tar.part-")
total=$(du -sm "$OUT" | cut -f1)
parts=$(find "$(dirname "$OUT")" -maxdepth 1 -name "$(basename "$OUT").tar.part-*" | wc -l)
echo "gpu_wheelhouse: $(find "$OUT" -name '*.whl' | wc -l) wheels, ${total} MiB in $OUT; ${parts} part(s) of <= ${PART_MIB} MiB beside it"
