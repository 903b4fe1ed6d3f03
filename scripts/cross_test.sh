#!/usr/bin/env bash
# Builds ringsplash for 64-bit Arm (aarch64) with Debian's cross compiler and
# runs the test suite under qemu-user: the portable kernel path alone, as an
# Arm cluster gets it. Installs what it needs (cross compiler, qemu-user,
# GoogleTest for arm64 through Debian multiarch). Extra args go to ctest.
# The build lives in build-arm64/; MPI and the micro-benchmarks are left out.
set -euo pipefail
cd "$(dirname "$0")/.."

# g++-aarch64-linux-gnu pulls in the arm64 C and C++ libraries (Depends).
bash scripts/install_deps.sh g++-aarch64-linux-gnu qemu-user libgtest-dev:arm64 \
  libgmock-dev:arm64 libcli11-dev nlohmann-json3-dev cmake

cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Release -DRINGSPLASH_WERROR=ON -DRINGSPLASH_MPI=OFF \
  -DRINGSPLASH_BENCH=OFF >/dev/null
cmake --build build-arm64 -j"$(nproc)"
ctest --test-dir build-arm64 --output-on-failure -j"$(nproc)" "$@"
