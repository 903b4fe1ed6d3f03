#!/usr/bin/env bash
# Fresh Debian machine -> installed dependencies, a Release build in build/ and
# the Python package in the project's venv .venv (scripts/setup_python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
# The Python requirements install beside the build (beside_python_deps.sh).
bash scripts/beside_python_deps.sh cmake --build build -j"$(nproc)"
bash scripts/setup_python.sh
