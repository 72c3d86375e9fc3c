#!/usr/bin/env bash
# bash benchmarks/gpu/install_wheels.sh PYTHON WHEEL_DIR SITE_DIR: prepare.sh's wheels, installed without network
# into a folder of their own for PYTHONPATH (docs/contributing.md, "The GPU proof"). Used by run.sh and .ci/env-test.
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
