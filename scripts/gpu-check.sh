#!/usr/bin/env bash
# The GPU check, for a machine with a GPU at hand. First it checks that the machine has what the
# check needs (nvcc, a visible GPU, cuBLAS, NCCL, and MPI, OpenBLAS and Catch2 from the system or
# from .debs/, made by scripts/fetch-gpu-debs.sh) and stops at once with the list of what is
# missing. Then: builds with CUDA for sm_90 (H100/H200) into build-gpu/; runs every CUDA kernel
# against its CPU twin; the kernel benchmark at the 124m shape (seq 1024); 01 on CUDA against 01 on
# the CPU at 124m for 3 steps (losses within a stated bound); 01 on CUDA at 124m in bf16 for
# tokens/s and MFU; the whole test suite (where the [cuda] cases also run). Every step is a pass or
# fail with a number. Under 8 minutes. $OUT (else build-gpu/gpu-check/) receives summary.txt and
# logs.tar.gz.
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
    gpu_probe) line=$(head -n 1 "$f") ;;
    bench_124m) line=$(grep -m 1 -E '^linear_forward D->F +cuda +bf16' "$f") ;;
    01_124m_bf16) line=$(median_rate "$LOG/01_124m_bf16.jsonl") ;;
    01_*) line=$(grep -E '^(step|median)' "$f" | tail -n 1) ;;
  esac
  [ -z "$line" ] && [ "$2" -ne 0 ] && line=$(grep -m 1 -E 'error:|FAIL|\*\*\*' "$f")
  echo "$line" | cut -c1-120
}

# compare_losses NAME A B BOUND: pass when the step losses of two --log-json files agree within
# BOUND relative (max over steps); the number is the measured difference.
compare_losses() {
  local name=$1 verdict
  verdict=$(/usr/bin/python3 - "$2" "$3" "$4" <<'PY'
import json, sys
def losses(p):
    try:
        return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
    except OSError:
        return []
a, b, bound = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if not a or len(a) != len(b):
    print("FAIL|missing or unequal logs"); sys.exit()
d = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(("ok" if d <= bound else "FAIL") + "|max rel diff %.3g over %d steps (bound %g)" % (d, len(a), bound))
PY
)
  rows+=("$name|${verdict%%|*}|0|${verdict#*|}")
}

# The median tokens/s and MFU of a --log-json file's steps after the first two (warm-up).
median_rate() {
  /usr/bin/python3 - "$1" <<'PY' 2>/dev/null
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l][2:]
t = sorted(x["tokens_per_s"] for x in s); m = sorted(x["mfu"] for x in s)
print("median %.0f tokens/s, MFU %.1f%%" % (t[len(t) // 2], 100 * m[len(m) // 2]) if s else "no steps")
PY
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
  cuda_home=$(dirname "$(dirname "$(realpath "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
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
      echo "no nccl.h in $cuda_home/include, /usr/include or Python's nvidia-nccl wheel"
    fi
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 2
}

# ----- what the check needs, before anything runs ------------------------------------------------
# Each missing piece is named with where it was looked for; any missing piece stops the check.
require() {
  local missing=()
  command -v nvcc >/dev/null || missing+=("nvcc (CUDA toolkit) on PATH")
  nvidia-smi -L >/dev/null 2>&1 || missing+=("a visible GPU (nvidia-smi -L lists none)")
  local cuda_home
  cuda_home=$(dirname "$(dirname "$(realpath "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
  CUBLAS_DIR=""
  for d in "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib" /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcublas.so" ] && { CUBLAS_DIR=$d; break; }
  done
  [ -n "$CUBLAS_DIR" ] || missing+=("libcublas.so (looked in $cuda_home/lib64, $cuda_home/targets/x86_64-linux/lib, /usr/lib/x86_64-linux-gnu)")
  [ -n "$(find_header nccl.h "$cuda_home/include")" ] || missing+=("nccl.h (CUDA include dir, /usr/include, or Python's nvidia-nccl wheel)")
  [ -n "$(find_header mpi.h /usr/include/x86_64-linux-gnu/mpich)" ] || missing+=("MPI (mpich headers; or .debs/ from scripts/fetch-gpu-debs.sh)")
  command -v mpirun >/dev/null || missing+=("mpirun (mpich; or .debs/)")
  [ -n "$(find_header cblas.h /usr/include/x86_64-linux-gnu/openblas-pthread)" ] || missing+=("OpenBLAS (cblas.h; or .debs/)")
  [ -n "$(find_header catch2/catch.hpp)" ] || missing+=("Catch2 v2 (catch2/catch.hpp; or .debs/)")
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-check: this machine lacks what the check needs:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    return 1
  fi
  MAKEVARS+=("CUDA_HOME=$cuda_home" "CUDA_LIB=$CUBLAS_DIR")
  echo "CUDA $cuda_home, cuBLAS in $CUBLAS_DIR"
}
# find_header NAME [DIR...]: the first of the given directories, CPATH and /usr/include holding NAME.
find_header() {
  local name=$1 d
  shift
  local IFS_SAVE=$IFS
  IFS=:
  for d in "$@" ${CPATH:-} /usr/include /usr/local/include; do
    [ -n "$d" ] && [ -e "$d/$name" ] && { IFS=$IFS_SAVE; echo "$d"; return 0; }
  done
  IFS=$IFS_SAVE
  return 0
}

# ----- the steps ---------------------------------------------------------------------------------
setup_deps >"$LOG/deps.log" 2>&1 || { cat "$LOG/deps.log"; echo "gpu-check: unpacking .debs/ failed" >&2; exit 1; }
require 2>&1 | tee -a "$LOG/deps.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
# What `make test` builds (without its package check, which needs a mirror): every program under tests/.
tests_bins=$(for f in tests/*.cpp; do [ "$f" = tests/catch_main.cpp ] || echo "$BUILD/tests/$(basename "$f" .cpp)"; done)
# shellcheck disable=SC2086
run build 240 make -j"$JOBS" "${MAKEVARS[@]}" all $tests_bins
built=$?

if [ $built -eq 0 ]; then
  export OMP_NUM_THREADS=4
  run gpu_probe 20 $BUILD/tests/gpu_probe
  run cuda_twins 120 mpirun -np 1 $BUILD/tests/test_kernels "[cuda]"
  run bench_124m 90 $BUILD/bench/bench_kernels --shape 124m --device cuda
  # 01 on CUDA against 01 on the CPU at 124m: fp32, 3 steps of one 1024-token sequence. cuBLAS
  # reorders fp32 sums over K up to 3072 (no TF32), so each logit moves by ~sqrt(K)·2^-24
  # relative; through 3 AdamW steps that stays ≤ 1e-5 relative on the loss: bound 1e-4.
  c124=(--preset 124m --batch 1 --steps 3 --lr-schedule constant --quiet)
  run 01_124m_cpu 150 mpirun -np 1 $BUILD/01_single_gpu --device cpu "${c124[@]}" --log-json $LOG/01_124m_cpu.jsonl
  run 01_124m_cuda 60 mpirun -np 1 $BUILD/01_single_gpu --device cuda "${c124[@]}" --log-json $LOG/01_124m_cuda.jsonl
  compare_losses 01_124m_vs_cpu $LOG/01_124m_cuda.jsonl $LOG/01_124m_cpu.jsonl 1e-4
  run 01_124m_bf16 90 mpirun -np 1 $BUILD/01_single_gpu --device cuda --preset 124m --dtype bf16 --batch 8 \
    --steps 12 --log-json $LOG/01_124m_bf16.jsonl
  run tests 600 env BUILD=$BUILD TEST_TIMEOUT=240 tests/run_tests.sh
fi

# ----- summary: one file, and the logs in one archive ----------------------------------------------
{
  printf '\n%-16s %-8s %6s  %s\n' step status secs detail
  for r in "${rows[@]}"; do
    IFS='|' read -r n s t d <<<"$r"
    printf '%-16s %-8s %6s  %s\n' "$n" "$s" "$t" "$d"
  done
  echo "total $(($(date +%s) - START)) s"
  [ -f "$LOG/bench_124m.log" ] && { echo; echo "bench_kernels --shape 124m (CUDA):"; tail -n +4 "$LOG/bench_124m.log"; }
} > "$LOG/summary.txt"
cat "$LOG/summary.txt"
tar -czf "$LOG/logs.tar.gz" -C "$LOG" --exclude logs.tar.gz --exclude summary.txt . && \
  find "$LOG" -mindepth 1 ! -name summary.txt ! -name logs.tar.gz -delete
for r in "${rows[@]}"; do case $r in *"|FAIL|"* | *"|TIMEOUT|"*) exit 1 ;; esac; done
exit 0
