#!/usr/bin/env bash
# Step 1 of the GPU run, on any Linux x86_64 machine with network access and a Rust toolchain (cargo): fills
# one git-ignored folder with everything benchmarks/gpu/run.sh installs on the GPU machine, which needs
# neither network nor cargo:
#
#   - fasttrain's abi3 wheel (release build; one wheel serves Python 3.10+, the GPU machine has 3.12);
#   - the pure-Python wheels the GPU machine lacks, for Python 3.12, no torch (benchmarks/gpu/wheels.txt).
#
#   bash benchmarks/gpu/prepare.sh [--dest DIR]      (DIR defaults to .whl, ignored by git)
#
# Then copy the repository with DIR to the GPU machine and run `bash benchmarks/gpu/run.sh` there
# (benchmarks/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."

dest=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) dest="$2"; shift 2 ;;
        --dest=*) dest="${1#--dest=}"; shift ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "prepare.sh: unknown option $1 (use --dest DIR)" >&2; exit 2 ;;
    esac
done
# The wheels are small (about 3 MiB in all, --no-deps): a folder far larger than that means a heavy wheel
# (torch, a CUDA library) got in, which the GPU machine has already and must not be shadowed. Fail then.
max_mib=48

[ -x .venv/bin/maturin ] || bash .ci/setup
mkdir -p "$dest"
rm -f "$dest"/*.whl

echo "[prepare] building fasttrain's abi3 wheel (release)" >&2
PYO3_PYTHON="$PWD/.venv/bin/python" .venv/bin/maturin build --release --quiet -o "$dest" >&2
wheel=$(ls "$dest"/fasttrain-*.whl)
case "$wheel" in
    *abi3*) ;;
    *) echo "prepare.sh: $wheel is not an abi3 wheel: it would not load on the GPU machine's Python 3.12" >&2; exit 1 ;;
esac

echo "[prepare] downloading the wheels the GPU machine lacks (benchmarks/gpu/wheels.txt)" >&2
# Pure-Python wheels, but some are tagged per Python version (multiprocess: py312): ask for 3.12's.
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" -r benchmarks/gpu/wheels.txt

# pip on the GPU machine refuses two versions of one package in one install: there must be one of each.
dupes=$(cd "$dest" && printf '%s\n' *.whl | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "prepare.sh: several wheels of: $dupes (remove the stale ones from $dest)" >&2
    exit 1
fi
size_kib=$(du -sk "$dest" | cut -f1)
if [ "$size_kib" -gt $((max_mib * 1024)) ]; then
    echo "prepare.sh: $dest holds $((size_kib / 1024)) MiB, over the $max_mib MiB kept for it" >&2
    exit 1
fi
(cd "$dest" && printf '    %s\n' *.whl) >&2
echo "[prepare] $dest: $(cd "$dest" && printf '%s\n' *.whl | wc -l) wheels, $((size_kib / 1024)) MiB" >&2
