#!/usr/bin/env bash
# The GPU check, for a machine with a GPU at hand (DESIGN.md, "One binary, two devices"): builds
# with CUDA for sm_90 (H100/H200) into build-gpu/, runs every CUDA kernel against its CPU twin,
# the kernel benchmark, 01 on CUDA (tiny preset; 124m in bf16 for 10 steps), then the whole test
# suite (which on a GPU machine also compares 01 on CUDA with 01 on the CPU), and prints a
# summary table. Under 8 minutes; logs go to $OUT when set (else build-gpu/gpu-check/).
#
# For a machine with nvcc but without the Debian packages and without a mirror: carry .debs/
# (scripts/fetch-gpu-debs.sh); they are unpacked with dpkg -x into /tmp/debroot, no install.
set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for everything, a margin under 8 minutes
BUILD=build-gpu
LOG=${OUT:-$BUILD/gpu-check}
mkdir -p "$LOG" "$BUILD"
JOBS=$(nproc)
MAKEVARS=("BUILD=$BUILD" CUDA=1 CUDA_ARCH=90)
rows=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run NAME LIMIT CMD...: runs CMD with a time limit (capped by what is left of the budget), output
# to $LOG/NAME.log; records the status and time for the summary. Returns CMD's status.
run() {
  local name=$1 limit=$2
  shift 2
  local budget
  budget=$(left)
  [ "$limit" -gt "$budget" ] && limit=$budget
  if [ "$limit" -le 5 ]; then
    rows+=("$name|SKIP|0|out of time")
    return 1
  fi
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  rc=$?
  local secs=$(($(date +%s) - t0)) status=ok
  [ $rc -ne 0 ] && status=FAIL
  [ $rc -eq 124 ] && status=TIMEOUT
  rows+=("$name|$status|$secs|$(detail "$name" $rc)")
  return $rc
}

# The one line of a log that says how it went: the step's own result line, else (when it failed)
# its first error.
detail() {
  local f="$LOG/$1.log" line=""
  case $1 in
    tests) line=$(tail -n 1 "$f") ;;
    cuda_twins) line=$(grep -m 1 -E '^(All tests passed|test cases:)|no GPU visible' "$f") ;;
    01_*) line=$(grep -E '^step +[0-9]+ \|' "$f" | tail -n 1) ;;
  esac
  [ -z "$line" ] && [ "$2" -ne 0 ] && line=$(grep -m 1 -E 'error:|FAIL|\*\*\*' "$f")
  echo "$line" | cut -c1-120
}

# ----- dependencies: the carried .debs, unpacked, when the system lacks the packages --------------
setup_deps() {
  if ls .debs/*.deb >/dev/null 2>&1; then
    local R=/tmp/debroot L=/tmp/debroot/usr/lib/x86_64-linux-gnu
    rm -rf $R && mkdir -p $R
    for f in .debs/*.deb; do dpkg -x "$f" $R || return 1; done
    # dpkg -x runs no maintainer scripts: make the links that update-alternatives would.
    ln -sf mpiexec.hydra $R/usr/bin/mpirun
    ln -sf mpiexec.hydra $R/usr/bin/mpiexec
    export PATH=$R/usr/bin:$PATH
    export LD_LIBRARY_PATH=$L:$L/openblas-pthread:$R/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LIBRARY_PATH=$L:$L/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
    export CPATH=$R/usr/include:$R/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
    # The mpicxx wrapper would print the packaged paths: name the unpacked ones instead.
    MAKEVARS+=("MPI_INC=-I$R/usr/include/x86_64-linux-gnu/mpich" "MPI_LIB=-L$L -lmpichcxx -lmpich")
    echo "unpacked .debs/ into $R"
  else
    echo "no .debs/: using the system's mpich, OpenBLAS and Catch2"
  fi
  # NCCL: the CUDA toolkit's, or else the one in the image's Python (nvidia-nccl wheel).
  local cuda_home
  cuda_home=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
  if [ ! -e "$cuda_home/include/nccl.h" ] && [ ! -e /usr/include/nccl.h ] && [ ! -e /usr/local/include/nccl.h ]; then
    local d
    d=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) || d=""
    if [ -n "$d" ] && [ -e "$d/include/nccl.h" ]; then
      mkdir -p /tmp/debroot/nccl
      ln -sf "$d/lib/libnccl.so.2" /tmp/debroot/nccl/libnccl.so
      export CPATH=$d/include${CPATH:+:$CPATH}
      export LIBRARY_PATH=/tmp/debroot/nccl${LIBRARY_PATH:+:$LIBRARY_PATH}
      export LD_LIBRARY_PATH=$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      echo "NCCL from $d"
    else
      echo "warning: no nccl.h found"
    fi
  fi
  [ -e "$cuda_home/lib64/libcublas.so" ] || echo "warning: no libcublas.so in $cuda_home/lib64"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 2
}

# ----- the steps ---------------------------------------------------------------------------------
setup_deps >"$LOG/deps.log" 2>&1 || rows+=("deps|FAIL|0|see $LOG/deps.log")
# What `make test` builds (without its package check, which needs a mirror): every program under tests/.
tests_bins=$(for f in tests/*.cpp; do [ "$f" = tests/catch_main.cpp ] || echo "$BUILD/tests/$(basename "$f" .cpp)"; done)
# shellcheck disable=SC2086
run build 240 make -j"$JOBS" "${MAKEVARS[@]}" all $tests_bins
built=$?

if [ $built -eq 0 ]; then
  export OMP_NUM_THREADS=4
  run cuda_twins 90 mpirun -np 1 $BUILD/tests/test_kernels "[cuda]"
  if [ -x $BUILD/bench/bench_kernels ]; then
    run bench_kernels 60 $BUILD/bench/bench_kernels
  else
    rows+=("bench_kernels|SKIP|0|no $BUILD/bench/bench_kernels")
  fi
  run 01_tiny 60 mpirun -np 1 $BUILD/01_single_gpu --device cuda --preset tiny --steps 30 \
    --log-json $BUILD/01_tiny.jsonl
  run 01_124m_bf16 120 mpirun -np 1 $BUILD/01_single_gpu --device cuda --preset 124m --dtype bf16 --steps 10 \
    --log-json $BUILD/01_124m_bf16.jsonl
  run tests 600 env BUILD=$BUILD TEST_TIMEOUT=240 tests/run_tests.sh
fi

# ----- summary -----------------------------------------------------------------------------------
{
  printf '\n%-14s %-8s %6s  %s\n' step status secs detail
  for r in "${rows[@]}"; do
    IFS='|' read -r n s t d <<<"$r"
    printf '%-14s %-8s %6s  %s\n' "$n" "$s" "$t" "$d"
  done
  echo "total $(($(date +%s) - START)) s; logs in $LOG/"
  [ -f "$LOG/bench_kernels.log" ] && { echo; echo "bench_kernels (tail):"; tail -n 25 "$LOG/bench_kernels.log"; }
} | tee "$LOG/summary.txt"
for r in "${rows[@]}"; do case $r in *"|FAIL|"* | *"|TIMEOUT|"*) exit 1 ;; esac; done
exit 0
