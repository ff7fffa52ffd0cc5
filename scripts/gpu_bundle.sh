#!/usr/bin/env bash
# Prepare, on a machine with network, what the GPU machine lacks for bench/gpu/check.sh:
# cp312 manylinux wheels of the packages its image does not ship (it has torch 2.11, numpy,
# transformers, safetensors, msgpack, uvloop, PyYAML and pytest; tests/conftest.py also needs
# hypothesis), into a git-ignored folder.
#
#   scripts/gpu_bundle.sh [DIR]          # DIR defaults to bench/gpu/wheels (< 16 MiB)
#   # on the GPU machine (no network):
#   pip install --no-index --find-links bench/gpu/wheels pyzmq msgspec structlog pydantic \
#       pytest-asyncio hypothesis        (bench/gpu/check.sh does this itself)
#
# Pins: the versions this repo is tested with. typing-extensions is bundled because pydantic
# 2.14 needs a newer one than torch images often carry; pytest and its dependencies are bundled
# so pytest-asyncio 1.x finds a pytest it accepts if the image's is older (pip keeps the
# installed one when it already satisfies). --no-deps: exactly this list, nothing pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-bench/gpu/wheels}
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
mkdir -p "$DIR"
PINS=(
  pyzmq==27.3.0
  msgspec==0.22.0
  structlog==26.1.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  pytest-asyncio==1.5.0
  hypothesis==6.170.17
  sortedcontainers==2.4.0
  pytest==9.2.0
  pluggy==1.6.0
  iniconfig==2.1.0
  packaging==25.0
  pygments==2.19.2
)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any \
  -d "$DIR" "${PINS[@]}"
size=$(du -sb "$DIR" | cut -f1)
echo "gpu_bundle: $(ls "$DIR" | wc -l) wheels, $((size / 1024)) KiB in $DIR"
if (( size >= 16 * 1024 * 1024 )); then
  echo "gpu_bundle: $DIR is over 16 MiB" >&2
  exit 1
fi
