#!/usr/bin/env bash
# CI stage: `pip install .` in a fresh venv, as a user does it: an isolated
# build (pip fetches pyproject.toml's build requirements from PyPI), then
# `import ringsplash` with only the runtime dependencies (NumPy, ml_dtypes;
# no JAX in the venv) and one small attention call against a NumPy softmax.
# The JAX side is tested by the README's test command (scripts/test.sh).
# Warnings are errors, as in scripts/setup_python.sh's build: the same flags
# let .ci/run's compiler cache serve this build the library's objects.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${RINGSPLASH_PYTHON:-/usr/bin/python3}
[ -x "$python" ] || python=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --disable-pip-version-check -q \
  --config-settings=cmake.define.RINGSPLASH_WERROR=ON .
cd "$tmp"  # away from the source tree: the installed package is imported
"$tmp/venv/bin/python" - <<'PY'
import importlib.util
import numpy as np
import ringsplash as rs

assert importlib.util.find_spec("jax") is None, "jax must not be a runtime dependency"
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 40, 2, 16), dtype=np.float32) for _ in range(3))
out = rs.attention(q, k, v, mask=rs.CausalMask((40, 40)))
s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 4.0
s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
err = np.abs(out - ref).max()
assert err < 1e-5, err  # f32 accumulation over 40 keys of unit-scale values
print(f"ci_python_wheel: installed ringsplash {rs.__version__}, causal attention within {err:.1e}")
PY
