#!/usr/bin/env bash
# Prepares the wheels that tests/gpu/run_gpu_checks.sh installs from local files on a GPU machine
# without network. Run it where PyPI is reachable, before the GPU run:
#
#   bash tests/gpu/prepare_wheelhouse.sh
#
# then carry the folder along with the working tree (device tool: carry=["tests/gpu/wheels"]); it is
# git-ignored, since transformers' wheel (about 13.5 MB) is too large to commit.
#
# What the GPU image lacks (as seen 2026-11: Python 3.12, torch 2.11, transformers 5.17,
# huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, ninja, pytest): transformers >= 5.24,
# which dspark_hf needs; its other requirements are met there. The wheel is pure Python.
# EXTRA_WHEELS="name==version ..." fetches more (binary ones for CPython 3.12 on x86-64 Linux).
#
# Knobs: WHEELS_DIR (default tests/gpu/wheels), TRANSFORMERS_VERSION (default 5.24.0), PYTHON.

set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DIR=${WHEELS_DIR:-tests/gpu/wheels}
VERSION=${TRANSFORMERS_VERSION:-5.24.0}
LIMIT_MIB=64  # what the device tool carries in all: the working tree plus carried folders
mkdir -p "$DIR"

# Only one version of each package may sit in the folder (pip refuses two at once).
for whl in "$DIR"/transformers-*.whl; do
  [ -e "$whl" ] && [ "$(basename "$whl")" != "transformers-$VERSION-py3-none-any.whl" ] && rm -f "$whl"
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # EXTRA_WHEELS is a list of requirements
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$DIR" "transformers==$VERSION" ${EXTRA_WHEELS:-}

echo "wheels in $DIR:"
ls -l "$DIR"/*.whl
wheels_bytes=$(cat "$DIR"/*.whl | wc -c)
tree_bytes=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
total_mib=$(( (wheels_bytes + tree_bytes) / 1048576 ))
echo "wheels: $((wheels_bytes / 1048576)) MiB; tracked tree: $((tree_bytes / 1048576)) MiB; together about ${total_mib} MiB" \
  "(the device tool carries at most ${LIMIT_MIB} MiB)"
if [ "$total_mib" -ge "$LIMIT_MIB" ]; then
  echo "too large to carry: drop EXTRA_WHEELS or untracked files from the run" >&2
  exit 1
fi
echo "next: run  QUICK=1 bash tests/gpu/run_gpu_checks.sh  on the GPU machine with tests/gpu/wheels carried along"
