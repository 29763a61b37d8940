#!/usr/bin/env bash
# The test driver behind `make test`: runs every Catch2 binary in $BUILD/tests, each under mpirun
# at the rank counts its source declares on a line "// ranks: 1 2 4" (default 1), counts test
# cases, runs the scripted checks tests/check_*.sh (one case each), prints every failure in full,
# and ends with "N passed, M failed" (non-zero exit on failure).
#
# ONLY="test_tp check_notes ..." runs just the named test binaries and scripted checks (no fuzzing):
# .ci/run uses it to run the equivalence suites again under a second OpenBLAS kernel.
set -u
ONLY=${ONLY:-}
selected() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
BUILD=${BUILD:-build}
TIMEOUT=${TEST_TIMEOUT:-900}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TS_BUILD=$BUILD
passed=0; failed=0; not_run=0; failures=()
# Test cases tagged [cuda] compare the CUDA backend with the CPU one. Without a GPU this build can use
# (gpu_probe asks cudaGetDeviceCount, as the binaries do) they are not run, and the driver says how
# many, rather than counting them as passed.
if "$BUILD/tests/gpu_probe" >/dev/null 2>&1; then gpu=1; filter=(); else gpu=0; filter=("~[cuda]"); fi
# In the emulated GPU's build every binary notes what CUDA code it ran (scripts/emu_coverage.sh).
emu=0
if "$BUILD/tests/test_emu" --list-test-names-only 2>/dev/null | grep -q .; then
  emu=1
  export TS_EMU_COVERAGE=$PWD/$BUILD/emu_coverage.txt
  [ -z "$ONLY" ] && rm -f "$TS_EMU_COVERAGE"
fi
log=$(mktemp); trap 'rm -f "$log"' EXIT
for src in tests/test_*.cpp; do
  name=$(basename "$src" .cpp)
  selected "$name" || continue
  bin=$BUILD/tests/$name
  # The emulated GPU's own suites (test_emu*) hold test cases only in its build (make CUDA=emu).
  if [[ $name == test_emu* ]] && ! "$bin" --list-test-names-only 2>/dev/null | grep -q .; then
    echo "--   $name: no test cases in this build (the emulated GPU's checks: make CUDA=emu test)"
    continue
  fi
  ranks=$(grep -m1 -E '^// ranks:' "$src" | sed 's/^\/\/ ranks://')
  variants=${ranks:-1}
  # "// shared GPU: 2 4": in the emulated GPU's build the [cuda] cases run again at those rank
  # counts with every rank on one emulated GPU (TS_EMU_GPUS=1), the path that stages CUDA tensors
  # through host memory for MPI.
  if [ $emu = 1 ]; then
    for np in $(grep -m1 -E '^// shared GPU:' "$src" | sed 's/^\/\/ shared GPU://'); do variants+=" $np:shared"; done
  fi
  for variant in $variants; do
    np=${variant%%:*}
    label="$name (np $np)"; run_env=(); args=("${filter[@]}")
    if [[ $variant == *:shared ]]; then
      label="$name (np $np, one emulated GPU)"; run_env=(TS_EMU_GPUS=1); args=("[cuda]")
    fi
    start=$(date +%s)
    timeout "$TIMEOUT" env "${run_env[@]}" mpirun -np "$np" "$bin" "${args[@]}" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    # Catch2 prints one summary per rank; rank 0's comes first.
    if line=$(grep -m1 -E '^All tests passed' "$log"); then
      n=$(echo "$line" | sed -E 's/.* in ([0-9]+) test case.*/\1/'); f=0
    elif line=$(grep -m1 -E '^test cases:' "$log"); then
      n=$(echo "$line" | sed -E 's/^test cases: *([0-9]+).*/\1/')
      f=$(echo "$line" | sed -E 's/.*\| *([0-9]+) failed.*/\1/'); [[ "$f" =~ ^[0-9]+$ ]] || f=0
    else
      n=1; f=1
    fi
    # A summary line cut by another write (a rank's stderr forwarded mid-line) still has its
    # count: the test cases the filter selects.
    [[ "$n" =~ ^[0-9]+$ ]] || n=$("$bin" --list-test-names-only "${args[@]}" 2>/dev/null | grep -c . || true)
    [[ "$n" =~ ^[0-9]+$ ]] || n=1
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; [ "$n" -ge 1 ] || n=1; fi
    passed=$((passed + n - f)); failed=$((failed + f))
    if [ $rc -ne 0 ]; then
      [ $rc -eq 124 ] && echo "TIMEOUT after ${TIMEOUT}s" >>"$log"
      echo "FAIL $label: $f of $n failed (exit $rc, ${secs}s)"
      sed 's/^/    /' "$log" | tail -n 80
      failures+=("$label")
    else
      skipped=""
      if [ $gpu = 0 ] && [[ $variant != *:shared ]]; then
        k=$("$bin" --list-test-names-only "[cuda]" 2>/dev/null | grep -c . || true)
        if [ "$k" -gt 0 ]; then skipped=", $k CUDA test cases not run (no GPU)"; not_run=$((not_run + k)); fi
      fi
      echo "ok   $label: $n test cases (${secs}s)$skipped"
    fi
  done
done
# Each fuzz target briefly from its seed corpus (make fuzz runs them longer): one test case each.
if [ -z "$ONLY" ] && ls "$BUILD"/fuzz/fuzz_* >/dev/null 2>&1; then
  while IFS= read -r line; do
    echo "$line"
    case "$line" in
      "ok   fuzz "*) passed=$((passed + 1)) ;;
      "FAIL fuzz "*) failed=$((failed + 1)); failures+=("${line#FAIL }") ;;
    esac
  done < <(BUILD=$BUILD FUZZ_SECONDS=${FUZZ_TEST_SECONDS:-5} scripts/fuzz.sh)
fi
# Scripted checks (tests/check_*.sh): one test case each, passed when the script exits 0.
for check in tests/check_*.sh; do
  label=$(basename "$check" .sh)
  selected "$label" || continue
  start=$(date +%s)
  timeout "$TIMEOUT" "$check" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); echo "ok   $label: $(tail -n 1 "$log") (${secs}s)"
  else
    failed=$((failed + 1)); failures+=("$label")
    echo "FAIL $label (exit $rc, ${secs}s)"; sed 's/^/    /' "$log" | tail -n 80
  fi
done
[ ${#failures[@]} -gt 0 ] && printf 'failed: %s\n' "${failures[@]}"
[ $not_run -gt 0 ] && echo "no GPU visible: $not_run CUDA test cases not run (scripts/gpu-check.sh runs them on a GPU machine)"
[ $emu = 1 ] && [ $gpu = 1 ] && echo "0 CUDA test cases not run: every [cuda] case ran on the emulated GPU"
[ $emu = 1 ] && [ -z "$ONLY" ] && scripts/emu_coverage.sh "$TS_EMU_COVERAGE"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
