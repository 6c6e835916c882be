#!/usr/bin/env bash
# Install everything the test suite needs (virtualenv, and as root the Debian packages for the
# Slurm and shell-script tests), then run the whole suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
APT_PACKAGES=(slurm-wlm munge shellcheck)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: installing ${missing[*]}"
    apt_log="$(mktemp)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
            >"$apt_log" 2>&1; then
        cat "$apt_log" >&2
        echo "test.sh: apt-get failed; the Slurm and shellcheck tests need ${missing[*]}" >&2
        exit 1
    fi
    rm -f "$apt_log"
fi
# shellcheck source=scripts/setup_env.sh
source scripts/setup_env.sh
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
    # pytest's "no tests collected" (e.g. a -k filter matching nothing) is not a failure.
    echo "test.sh: pytest collected no tests" >&2
    exit 0
fi
exit "$rc"
