#!/usr/bin/env bash
# Install the wheels prepare.sh made, without network: no index, no dependency resolution, into a folder of their
# own that goes first on PYTHONPATH (the machine's site-packages stay untouched). Used by run.sh and .ci/env-test.
#
#   bash benchmarks/gpu/install_wheels.sh PYTHON WHEEL_DIR SITE_DIR
set -euo pipefail
usage="usage: install_wheels.sh PYTHON WHEEL_DIR SITE_DIR"
python=${1:?$usage} wheels=${2:?$usage} site=${3:?$usage}
shopt -s nullglob
files=("$wheels"/*.whl)
[ ${#files[@]} -gt 0 ] || { echo "install_wheels.sh: no wheels in $wheels (run benchmarks/gpu/prepare.sh)" >&2; exit 1; }
rm -rf "$site"
"$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "${files[@]}"
echo "installed ${#files[@]} wheels into $site" >&2
