#!/usr/bin/env bash
# Runs COMMAND while the Python package's requirements install into the
# project's venv beside it (scripts/setup_python.sh --deps: on a fresh clone
# PyPI downloads and unpacking on one core, ~150 s; otherwise a quick import
# check), and returns once both are done: COMMAND's status if it failed,
# else the install's. scripts/setup.sh and scripts/test.sh run the C++ build
# this way, so that the install takes the core the build leaves it instead of
# a stretch of its own, and no test starts before it has finished.
# Usage: scripts/beside_python_deps.sh COMMAND [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  echo "usage: scripts/beside_python_deps.sh COMMAND [ARGS...]" >&2
  exit 2
fi
deps_log=$(mktemp)
trap 'rm -f "$deps_log"' EXIT
# The install gets a process group of its own (job control on while it
# starts), so an interrupt stops it whole, pip included, not only COMMAND.
set -m
bash scripts/setup_python.sh --deps >"$deps_log" 2>&1 &
deps_pid=$!
set +m
trap 'kill -TERM -- -"$deps_pid" 2>/dev/null; exit 130' INT TERM
rc=0
"$@" || rc=$?
deps_rc=0
wait "$deps_pid" || deps_rc=$?
cat "$deps_log"
if [ "$rc" != 0 ]; then exit "$rc"; fi
if [ "$deps_rc" != 0 ]; then
  echo "beside_python_deps: installing the Python requirements failed (above)" >&2
  exit "$deps_rc"
fi
