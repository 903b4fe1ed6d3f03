#!/usr/bin/env bash
# The Python package in the project's venv (.venv): creates the venv if
# missing, installs the build and test requirements from PyPI (nanobind,
# scikit-build-core, NumPy, ml_dtypes, JAX, PyTorch, pytest), then builds and installs
# ringsplash from this tree. Re-run after changing the sources: the CMake
# build is kept in build-python/, so a re-install compiles only what changed.
# Usage: scripts/setup_python.sh [--deps]   (--deps: the venv and the
# requirements only, not ringsplash; scripts/beside_python_deps.sh runs
# that beside the C++ build)
# Environment: RINGSPLASH_PYTHON (interpreter for a new venv, default Debian's
# /usr/bin/python3), RINGSPLASH_VENV (default .venv).
set -euo pipefail
deps_only=false
case "${1:-}" in
  "") ;;
  --deps) deps_only=true ;;
  *)
    echo "usage: scripts/setup_python.sh [--deps]" >&2
    exit 2
    ;;
esac
cd "$(dirname "$0")/.."
venv=${RINGSPLASH_VENV:-.venv}
python=${RINGSPLASH_PYTHON:-/usr/bin/python3}
[ -x "$python" ] || python=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "setup_python: creating $venv with $("$python" --version)"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Build requirements (pyproject.toml [build-system]) and the test extras,
# installed once: the build below runs without isolation, against these.
# PyTorch from PyPI brings its CUDA libraries (~3 GB, a minute or two to
# fetch); pip's cache keeps them for the next venv on the same machine.
if ! "$venv/bin/python" -c "import nanobind, scikit_build_core, jax, ml_dtypes, pytest, torch" \
  2>/dev/null; then
  echo "setup_python: installing requirements from PyPI"
  "${pip[@]}" install --upgrade pip
  "${pip[@]}" install "scikit-build-core>=0.10" "nanobind>=2.0" "numpy>=1.24" "ml_dtypes>=0.4" \
    "jax>=0.5" "jaxlib>=0.5" "torch>=2.4" "pytest>=7"
fi
if $deps_only; then
  echo "setup_python: requirements in $venv"
  exit 0
fi
echo "setup_python: building and installing ringsplash into $venv"
"${pip[@]}" install --no-build-isolation --no-deps -C build-dir=build-python -C cmake.define.RINGSPLASH_WERROR=ON .
"$venv/bin/python" -c "import ringsplash, ringsplash.jax, ringsplash.torch; print('setup_python: ringsplash', ringsplash.__version__, 'kernel path', ringsplash.kernel_path())"
