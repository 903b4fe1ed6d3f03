#!/usr/bin/env bash
# Runs the performance targets (docs/PERFORMANCE.md) and writes one JSON line
# per case to docs/perf/targets.jsonl. Needs a Release build (scripts/setup.sh);
# RINGSPLASH=path/to/ringsplash picks another binary. Extra arguments go to
# bench/run_targets.py (--only fwd_f32,causal | --quick | --out FILE); with
# --only, the other rows already in the output file are kept.
# Takes ~10 minutes on 2 cores: run it when the machine is otherwise idle
# (`uptime`), since every case is a wall-clock measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 bench/run_targets.py --ringsplash "${RINGSPLASH:-build/ringsplash}" "$@"
