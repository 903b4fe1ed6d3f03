#!/usr/bin/env bash
# Installs the Debian packages ringsplash needs to build, test and benchmark,
# or, given package names, those instead (scripts/cross_test.sh). A NAME:ARCH
# package first enables Debian multiarch for ARCH.
# Idempotent: skips apt entirely when everything is already there.
set -euo pipefail
packages=(
  cmake make g++ clang-14 libclang-rt-14-dev   # compilers; clang runtime for libFuzzer/sanitizers
  libgtest-dev libgmock-dev libbenchmark-dev    # tests and micro-benchmarks
  libopenmpi-dev openmpi-bin                    # the MPI backend
  libcli11-dev nlohmann-json3-dev               # the command line and its JSON output
  gnuplot-nox python3 time                      # docs/PERFORMANCE.md: plot, bench/run_targets.py, /usr/bin/time -v
  python3-numpy                                 # docs/CLI.md: the attend example writes its .npy inputs with NumPy
  python3-venv python3-dev                      # the Python package: its venv (scripts/setup_python.sh), Python headers
  ccache                                        # .ci/run: the two Python builds share their library objects
)
[ $# -eq 0 ] || packages=("$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
for p in "${missing[@]}"; do
  arch=${p#*:}
  [ "$arch" != "$p" ] || continue
  dpkg --print-foreign-architectures | grep -qx "$arch" || $SUDO dpkg --add-architecture "$arch"
done
$SUDO apt-get update -qq
# --no-remove: a multiarch install must never replace the host's packages.
$SUDO apt-get install -y -qq --no-install-recommends --no-remove "${missing[@]}"
