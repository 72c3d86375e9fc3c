#!/usr/bin/env bash
# Install the wheels prepare.sh put in .whl/ without network: pip, no index, no dependency resolution, into a
# folder of their own that goes first on PYTHONPATH (the machine's own site-packages stay untouched). Used by
# run.sh on the GPU machine and by CI's replica of that machine (.ci/env-test gpu).
#
#   bash benchmarks/gpu/install_wheels.sh PYTHON WHEEL_DIR SITE_DIR
set -euo pipefail
python=${1:?usage: install_wheels.sh PYTHON WHEEL_DIR SITE_DIR}
wheels=${2:?usage: install_wheels.sh PYTHON WHEEL_DIR SITE_DIR}
site=${3:?usage: install_wheels.sh PYTHON WHEEL_DIR SITE_DIR}
shopt -s nullglob
files=("$wheels"/*.whl)
if [ ${#files[@]} -eq 0 ]; then
    echo "install_wheels.sh: no wheels in $wheels (run benchmarks/gpu/prepare.sh first, on a machine with network and cargo)" >&2
    exit 1
fi
rm -rf "$site"
"$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "${files[@]}"
echo "installed ${#files[@]} wheels into $site" >&2
