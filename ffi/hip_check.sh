#!/usr/bin/env bash
# Compile every ffi/*.cc as HIP (host and device passes) for AMD GPU architectures, with no ROCm
# installed: a check that the FFI sources build under a HIP toolchain, as they would with hipcc
# on a ROCm host. Nothing is linked or run.
#
# Usage: ffi/hip_check.sh [ARCH...]            (default: gfx942 gfx950)
#
# The compiler: $CLANGXX if set; otherwise Debian's clang-19 (+ lld-19 and clang-tools-19 for
# the device link and the offload bundler), fetched without root with `apt-get download` and
# unpacked with `dpkg -x` into $JAX_MLA_HIP_CHECK_CACHE (default ~/.cache/jax_mla/hip-check),
# once. Flags: -x hip --offload-arch=ARCH -nogpuinc -nogpulib (no HIP headers or device
# libraries needed: the sources include none). An architecture the compiler does not know
# (Debian bookworm's clang 19 has no gfx950) is checked with the newest one it knows, and the
# script says so. The XLA FFI headers come from `$PYTHON -c 'import jax; ...'` (default python3).
#
# Exit status: 0 all compiled, 1 a source failed to compile, 3 no toolchain could be obtained
# (no apt-get, no network or package lists): the pytest wrapper skips then.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
archs=("$@")
[[ ${#archs[@]} -gt 0 ]] || archs=(gfx942 gfx950)
python="${PYTHON:-python3}"
cache="${JAX_MLA_HIP_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jax_mla/hip-check}"
known=(gfx950 gfx942 gfx941 gfx940 gfx90a gfx908)  # newest first

unavailable() { echo "hip_check: $*" >&2; exit 3; }

clangxx="${CLANGXX:-}"
if [[ -z "$clangxx" ]]; then
  root="$cache/root"
  clangxx="$root/usr/lib/llvm-19/bin/clang++"
  if [[ ! -f "$cache/.unpacked" ]]; then
    command -v apt-get >/dev/null || unavailable "no apt-get to fetch Debian's clang-19"
    command -v dpkg >/dev/null || unavailable "no dpkg to unpack Debian's clang-19"
    mkdir -p "$cache/debs" "$root"
    pkgs=(clang-19 libclang-cpp19 libllvm19 libclang-common-19-dev lld-19 liblld-19
          clang-tools-19)
    (cd "$cache/debs" && apt-get download "${pkgs[@]}" >/dev/null 2>"$cache/apt.log") ||
      unavailable "apt-get download ${pkgs[*]} failed (see $cache/apt.log)"
    for deb in "$cache"/debs/*.deb; do dpkg -x "$deb" "$root"; done
    touch "$cache/.unpacked"
  fi
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
[[ -x "$clangxx" ]] || unavailable "no compiler at $clangxx"
version="$("$clangxx" --version | head -n 1)"
include="$("$python" -c 'import jax; print(jax.ffi.include_dir())')" ||
  unavailable "cannot find the XLA FFI headers (import jax failed with $python)"

knows() {  # does the compiler accept this offload arch?
  echo "" | "$clangxx" -x hip --offload-arch="$1" -nogpuinc -nogpulib -fsyntax-only - \
    >/dev/null 2>&1
}

checked=()
for arch in "${archs[@]}"; do
  use=""
  if knows "$arch"; then
    use="$arch"
  else
    for k in "${known[@]}"; do
      if knows "$k"; then use="$k"; break; fi
    done
    [[ -n "$use" ]] || unavailable "$version knows none of ${known[*]}"
    echo "hip_check: $version does not know $arch; checking with $use, the newest it knows"
  fi
  [[ " ${checked[*]:-} " == *" $use "* ]] || checked+=("$use")
done

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for arch in "${checked[@]}"; do
  for src in "$here"/*.cc; do
    if "$clangxx" -x hip --offload-arch="$arch" -nogpuinc -nogpulib -std=c++17 -O1 -fPIC \
        -fvisibility=hidden -isystem "$include" -c "$src" -o "$out/$(basename "$src").o"; then
      echo "hip_check: ok   $arch $(basename "$src") ($version)"
    else
      echo "hip_check: FAIL $arch $(basename "$src") ($version)" >&2
      status=1
    fi
  done
done
exit "$status"
