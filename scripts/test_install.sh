#!/usr/bin/env bash
# Installs a ringsplash build into a scratch prefix and builds and runs a
# project that uses it the way README.md says (find_package(ringsplash),
# ringsplash::ringsplash): tests/install. Also checks the command was
# installed. Usage: scripts/test_install.sh BUILD_DIR [CXX_COMPILER]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "$1" && pwd)"
cxx="${2:-c++}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
test -x "$scratch/prefix/bin/ringsplash"
test -f "$scratch/prefix/include/ringsplash/ringsplash.h"
cmake -S "$root/tests/install" -B "$scratch/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/consumer" -j2 >/dev/null
"$scratch/consumer/consumer"
