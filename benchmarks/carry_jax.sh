#!/usr/bin/env bash
# Packs a newer jax for the GPU machine, which cannot download and takes at most 64 MiB of
# carried files a call: jax, jaxlib and the CUDA 13 plugin and PJRT wheels of VERSION for
# Python 3.12, unpacked into one site folder, compressed (xz) and cut into PARTS pieces, one
# ignored folder each (.jx1, .jx2, ...). Carry one piece a call on the same warm machine (it
# is given back 30 s after a call: send the next at once) and copy each to /tmp/jx there; with
# the last one, unpack and put the folder first on the path:
#   cat /tmp/jx/part.* | tar -C /tmp/site12 -xJf - && export PYTHONPATH=/tmp/site12
# jax 0.12.1 came to 157 MB compressed, three pieces (benchmarks/README.md).
# Usage: bash benchmarks/carry_jax.sh VERSION [PARTS]
set -euo pipefail
version=${1:?usage: carry_jax.sh VERSION [PARTS]}
parts=${2:-3}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/whl" "jax==$version" "jaxlib==$version" "jax-cuda13-plugin==$version" \
  "jax-cuda13-pjrt==$version"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
tar -C "$work/site" -cf - . | xz -T0 -9e > "$work/site.tar.xz"
split -n "$parts" -d "$work/site.tar.xz" "$work/part."
for i in $(seq 1 "$parts"); do
  d=".jx$i"
  grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
  rm -rf "$d" && mkdir "$d" && mv "$work/part.$(printf %02d $((i - 1)))" "$d/"
done
ls -l .jx*/
