#!/usr/bin/env bash
# Runs the whole test suite (builds first if needed): ctest (extra args go to
# it), then the Python package's tests (pytest, after re-installing the
# package from this tree into .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build/CMakeCache.txt ]; then bash scripts/setup.sh; fi
# The Python requirements install beside the build (beside_python_deps.sh).
bash scripts/beside_python_deps.sh cmake --build build -j"$(nproc)"
# Open MPI refuses root without these; the MPI tests run ranks as processes.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
bash scripts/setup_python.sh
# The tests import the installed package (.venv), not python/ in the tree.
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider
