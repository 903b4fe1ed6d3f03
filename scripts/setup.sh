#!/usr/bin/env bash
# Fresh Debian machine -> installed dependencies and a Release build in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
