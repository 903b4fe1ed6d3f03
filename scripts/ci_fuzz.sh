#!/usr/bin/env bash
# Fuzzing stage of CI (docs/RELIABILITY.md): builds the libFuzzer targets with
# clang-14 + AddressSanitizer + UBSan — in the ASan build directory of
# scripts/ci_sanitizers.sh, configured the same way, so after the ASan stage
# only the fuzzers themselves are compiled — and runs each for FUZZ_SECONDS seconds
# (default 30), starting from the seed corpus (fuzz/corpus/<target>; the ring
# target also from fuzz/corpus/attention, whose problems it decodes) and the
# saved crash inputs (fuzz/regressions/<target>). New interesting inputs go to
# a scratch directory, never into the repository.
#
# The random seed is fixed (FUZZ_SEED, default 1): two CI runs of the same
# code try the same inputs in the same order (as far as the time allows), so
# a submission is not failed by a bug that an unrelated change's run merely
# happened to draw. Campaigns that should explore: FUZZ_SEED=0 (a fresh seed
# per run, libFuzzer's convention) with a longer FUZZ_SECONDS.
#
# On a crash: the script fails, the input is saved as
# $FUZZ_ARTIFACTS/<target>-crash-<hash> (default build-asan/fuzz-artifacts). Turn it
# into a regression test by copying it to fuzz/regressions/<target>/ — the
# corpus replay test (tests/reliability/fuzz_corpus_test.cc) then runs it in
# every build — and fix the bug.
#
# Environment: FUZZ_SECONDS (per target), FUZZ_SEED, FUZZ_TARGETS (default all
# four: npy attention mask_parse ring), JOBS (build parallelism and fuzzers run
# at a time, default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-30}
seed=${FUZZ_SEED:-1}
targets=${FUZZ_TARGETS:-"npy attention mask_parse ring"}
build=build-asan
artifacts=${FUZZ_ARTIFACTS:-$build/fuzz-artifacts}
jobs=${JOBS:-$(nproc)}

start=$SECONDS
bash scripts/ci_sanitizers.sh configure-asan
fuzzers=()
for t in $targets; do fuzzers+=("${t}_fuzzer"); done
cmake --build "$build" -j"$jobs" --target "${fuzzers[@]}"
echo "ci_fuzz: build took $((SECONDS - start)) s"

mkdir -p "$artifacts"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# UB and ASan reports are fatal (the binaries also use -fno-sanitize-recover).
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1
total=0
summary=""

# Runs fuzzer $1 into $scratch/$1.log and writes its exit status to
# $scratch/$1.rc (a failure is reported by report_fuzzer, in target order).
run_fuzzer() {
  local t=$1 rc=0
  mkdir -p "$scratch/$t"
  local seeds=("fuzz/corpus/$t")
  [ -d "fuzz/regressions/$t" ] && seeds+=("fuzz/regressions/$t")
  # The ring target decodes the attention target's problems: its own seeds
  # only add what those do not reach through the ring.
  [ "$t" = ring ] && seeds+=("fuzz/corpus/attention")
  # -timeout: an input that runs 20 s is a hang (inputs are small by design);
  # -rss_limit_mb: a leak or a runaway allocation is a failure too.
  "$build/fuzz/${t}_fuzzer" -seed="$seed" -max_total_time="$seconds" -timeout=20 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/$t-" \
    "$scratch/$t" "${seeds[@]}" >"$scratch/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$scratch/$t.rc"
}

report_fuzzer() {
  local t=$1 log="$scratch/$1.log"
  if [ "$(cat "$scratch/$t.rc")" != 0 ]; then
    tail -n 60 "$log"
    echo "ci_fuzz: $t FAILED; crashing input saved under $artifacts/ (copy it to" \
      "fuzz/regressions/$t/ to make it a regression test)"
    return 1
  fi
  local execs corpus
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
  corpus=$(ls "$scratch/$t" | wc -l)
  echo "== $t:"
  grep -E "stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)" "$log"
  total=$((total + execs))
  summary+="$t: $execs executions, $corpus new corpus entries; "
}

# JOBS fuzzers at a time (each is one process; the attention and ring
# targets run a few threads at most), so the stage takes about
# FUZZ_SECONDS x targets / JOBS; the default order pairs a small-input target
# with a kernel target.
read -r -a list <<<"$targets"
for ((i = 0; i < ${#list[@]}; i += jobs)); do
  batch=("${list[@]:i:jobs}")
  for t in "${batch[@]}"; do
    echo "== fuzzing $t for $seconds s (seed $seed)"
    run_fuzzer "$t" &
  done
  wait
  for t in "${batch[@]}"; do report_fuzzer "$t" || exit 1; done
done
echo "ci_fuzz: ${summary}total $total executions, no crash, in $((SECONDS - start)) s"
