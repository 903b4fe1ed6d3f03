#!/usr/bin/env bash
# Sanitizer stage of CI (docs/RELIABILITY.md).
#   asan: the whole test suite (library, CLI, MPI, reliability) built with
#         AddressSanitizer + UndefinedBehaviorSanitizer (clang-14); any
#         report fails the test that triggered it (UB is not recoverable).
#   tsan: ThreadSanitizer build of the tests that run threads: the thread
#         pool, kernel thread-count invariance, the threads communicator, the
#         ring over thread ranks (results and fault injection) and the
#         determinism suite.
#   The ASan build also holds the libFuzzer targets (RINGSPLASH_FUZZ=ON: the
#   library gets coverage instrumentation, which the tests tolerate), so
#   scripts/ci_fuzz.sh links its fuzzers there instead of compiling the
#   library a third time.
# Usage: scripts/ci_sanitizers.sh [asan|tsan|all|configure-asan]   (default all)
#   configure-asan: only (re)configure build-asan (used by ci_fuzz.sh).
# Environment: JOBS (build/test parallelism, default nproc), SANITIZER_CXX
# (default clang++-14), CTEST_ARGS (extra ctest arguments, e.g. -R Ring).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
jobs=${JOBS:-$(nproc)}
cxx=${SANITIZER_CXX:-clang++-14}
read -r -a extra <<<"${CTEST_ARGS:-}"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# -O1 -g1: stacks with file and line (line tables, no variable info: a
# tenth faster to compile than -g) and a build about half as long as -O3;
# asserts on.
cmake_common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1"
  -DCMAKE_CXX_COMPILER="$cxx" -DRINGSPLASH_BENCH=OFF)

# The ThreadSanitizer subset: every test whose code runs on several threads.
tsan_tests="ThreadPoolTest|InvarianceTest|FlashTest.BitwiseIdenticalAcrossThreadCounts|CommTest|LinkModelTest"
tsan_tests+="|RingTest|RingCoveringTest|RingFaultTest|RingDefaultTiles|RingPlan|Determinism|Concurrency"
tsan_targets=(thread_pool_test attention_test flash_kernel_test flash_schedule_test comm_test
  ring_test ring_tiles_test ring_fault_test ring_plan_test determinism_test)

configure_asan() {
  cmake -S . -B build-asan "${cmake_common[@]}" -DRINGSPLASH_SANITIZE=address,undefined \
    "-DCMAKE_CXX_FLAGS=-fno-sanitize-recover=all" -DRINGSPLASH_FUZZ=ON >/dev/null
}

run_asan() {
  local start=$SECONDS
  echo "== ASan + UBSan: build"
  configure_asan
  cmake --build build-asan -j"$jobs"
  echo "== ASan + UBSan: ctest ($((SECONDS - start)) s so far)"
  # Leak checking stays on. Open MPI allocates at MPI_Init and does not free
  # everything at MPI_Finalize (its own documented behaviour, not ours): those
  # reports are suppressed by tests/reliability/lsan_mpi.supp, which names only
  # Open MPI's libraries. Open MPI is built without frame pointers, so the
  # fast unwinder stops at its first frame ("<unknown module>") and no
  # suppression could match: the tests that start Open MPI append
  # fast_unwind_on_malloc=0 (DWARF unwinding; RINGSPLASH_MPIRUN_TEST_PROPS in
  # tests/CMakeLists.txt). The rest keep the fast unwinder: DWARF unwinding
  # on every allocation made the whole suite about a fifth slower.
  # UBSan: the first report fails the test (-fno-sanitize-recover=all too).
  ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:check_initialization_order=1:strict_string_checks=1 \
  LSAN_OPTIONS=suppressions=$PWD/tests/reliability/lsan_mpi.supp:print_suppressions=0 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 900 "${extra[@]}"
  echo "== ASan + UBSan: clean in $((SECONDS - start)) s"
}

run_tsan() {
  local start=$SECONDS
  echo "== TSan: build"
  cmake -S . -B build-tsan "${cmake_common[@]}" -DRINGSPLASH_SANITIZE=thread \
    -DRINGSPLASH_MPI=OFF >/dev/null
  cmake --build build-tsan -j"$jobs" --target "${tsan_targets[@]}"
  echo "== TSan: ctest ($((SECONDS - start)) s so far)"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure -j"$jobs" --timeout 900 \
    -R "$tsan_tests" "${extra[@]}"
  echo "== TSan: clean in $((SECONDS - start)) s"
}

case "$stage" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  all) run_asan && run_tsan ;;
  configure-asan) configure_asan ;;
  *) echo "usage: $0 [asan|tsan|all|configure-asan]" >&2; exit 2 ;;
esac
