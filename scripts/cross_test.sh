#!/usr/bin/env bash
# Builds ringsplash for 64-bit Arm (aarch64) with Debian's cross compiler and
# runs the test suite under qemu-user: the portable kernel path alone, as an
# Arm cluster gets it. Installs what it needs (cross compiler, qemu-user,
# GoogleTest for arm64 through Debian multiarch). Extra args go to ctest.
# The build lives in build-arm64/; MPI and the micro-benchmarks are left out.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(crossbuild-essential-arm64 qemu-user libgtest-dev:arm64 libgmock-dev:arm64
          libcli11-dev nlohmann-json3-dev cmake)
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "cross_test: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  $SUDO apt-get update -qq
  # --no-remove: a multiarch install must never replace the host's packages.
  $SUDO apt-get install -y -qq --no-remove "${missing[@]}"
fi

cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Release -DRINGSPLASH_WERROR=ON -DRINGSPLASH_MPI=OFF \
  -DRINGSPLASH_BENCH=OFF >/dev/null
cmake --build build-arm64 -j"$(nproc)"
ctest --test-dir build-arm64 --output-on-failure -j"$(nproc)" "$@"
