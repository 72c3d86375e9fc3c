#!/usr/bin/env bash
# bash benchmarks/gpu/prepare.sh [--dest DIR]: fill .whl/ (or DIR) with the wheels run.sh installs on the GPU
# machine; needs network and cargo. What it writes: docs/contributing.md, "The GPU proof".
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
case "${1-}" in --dest) dest=${2:?prepare.sh: --dest needs a folder} ;; "") ;; *) echo "usage: prepare.sh [--dest DIR]" >&2; exit 2 ;; esac
max_mib=48  # the wheels are about 3 MiB: more means a heavy wheel (torch, CUDA) got in and would shadow the machine's

[ -x .venv/bin/maturin ] || bash .ci/setup
mkdir -p "$dest"
rm -f "$dest"/*.whl
PYO3_PYTHON="$PWD/.venv/bin/python" .venv/bin/maturin build --release --quiet -o "$dest" >&2
case "$(ls "$dest"/fasttrain-*.whl)" in
    *abi3*) ;;
    *) echo "prepare.sh: fasttrain's wheel is not abi3: it would not load on the GPU machine's Python 3.12" >&2; exit 1 ;;
esac
# some pure-Python wheels are tagged per Python version (multiprocess: py312): ask for 3.12's
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" -r benchmarks/gpu/wheels.txt
# the GPU machine gets the tree without .git: its results name this commit (fasttrain.bench.provenance)
.venv/bin/python -c 'from fasttrain.bench import provenance; print(provenance.git_commit() or "")' > "$dest/COMMIT"
# pip on the GPU machine refuses two versions of one package in one install
dupes=$(cd "$dest" && printf '%s\n' *.whl | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "prepare.sh: several wheels of: $dupes (remove the stale ones from $dest)" >&2; exit 1; }
size_mib=$(($(du -sk "$dest" | cut -f1) / 1024))
[ "$size_mib" -le "$max_mib" ] || { echo "prepare.sh: $dest holds $size_mib MiB, over $max_mib MiB" >&2; exit 1; }
echo "[prepare] $dest: $(cd "$dest" && ls *.whl | wc -l) wheels, $size_mib MiB" >&2
