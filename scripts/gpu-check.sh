#!/usr/bin/env bash
# The GPU check, for a machine with one H100/H200 at hand (lent for about 15 minutes, so the check
# itself is bounded: every step has a time limit, and the limits add up to the budget, 470 s, which
# it prints once its dependencies are found). The GPU machine has nvcc, cuBLAS and NCCL but no MPI,
# OpenBLAS or Catch2 and no network: scripts/fetch-gpu-debs.sh downloads those Debian packages into
# .debs/ here, you carry .debs/ along, and this script unpacks them (dpkg -x, no install) into
# $BUILD-deps/ and builds against that tree.
#
#   scripts/gpu-check.sh              on the GPU machine: make CUDA=1 CUDA_ARCH=90 into build-gpu/
#   scripts/gpu-check.sh --emulated   the rehearsal, on any machine (or GPU_CHECK_EMULATED=1)
#   scripts/gpu-check.sh --deps-only  unpack .debs/, list what is missing, stop (either mode)
#
# Steps, in order; each one's row in the summary is ok or FAIL/TIMEOUT/SKIP with a number, and a
# step that passes without printing its number fails ("no result line"):
#   deps        .debs/ unpacked, then everything the check needs found (else it stops at once with
#               the list of what is missing, before anything is built)
#   build       make CUDA=1 (emulated: CUDA=emu): the techniques, benchmarks, gpu_probe and the
#               test programs that hold [cuda] cases
#   prefix      (with .debs/) each program's libmpich, libopenblas (and libboost_context) and every
#               library they pull in load from $BUILD-deps/, mpi.h, cblas.h, catch.hpp (and
#               fiber.hpp) came from there, and mpirun and its proxy are the unpacked ones
#   gpu_probe   the build sees a GPU
#   cuda_twins  every CUDA kernel against its CPU twin (tests/test_kernels [cuda])
#   bench_S     the kernel benchmark at shape S on CUDA, ending with each kernel's predicted time
#               beside its measured median and the predicted step (notes/gpu_speed.md)
#   01_S_cpu, 01_S_cuda, 01_S_vs_cpu
#               01 on CUDA against 01 on the CPU, 3 steps; losses within 1e-4 relative
#   01_S_bf16   01 on CUDA in bf16: median tokens/s and MFU
#   tests       every [cuda] test case of the other test programs, at each rank count its source
#               declares (the CPU cases are the same code CI runs; here they would not fit the budget)
# S is 124m on the GPU. In the rehearsal 01 runs the tiny preset (0.12 s a step emulated; a 124m
# step is ~25,000 times the FLOPs, most of an hour) and the benchmark the small shape.
#
# The rehearsal (--emulated) runs all of it here, before GPU minutes are spent: make CUDA=emu (g++
# against common/emu/, --device cuda on the CPU, one emulated GPU as on the GPU machine) into
# build-gpu-emu/, against the unpacked .debs/ ONLY: CPATH, LIBRARY_PATH and LD_LIBRARY_PATH name the
# prefix and nothing else, the requirements are looked for in the prefix alone, and the prefix step
# proves from the linker's trace, ldd and the compiler's dependency files that no system copy of
# MPI, OpenBLAS, Catch2 or Boost was used. tests/check_gpu_rehearsal.sh runs it in the suite.
#
# Environment: OUT (else $BUILD/gpu-check/) receives summary.txt and logs.tar.gz. GPU_CHECK_TESTS=
# "test_a test_b" limits the tests step (and the build) to those programs; GPU_CHECK_DEBS (.debs),
# GPU_CHECK_BUILD (build-gpu, emulated build-gpu-emu), GPU_CHECK_JOBS (nproc) name the rest.
set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
EMU=${GPU_CHECK_EMULATED:-0}
DEPS_ONLY=0
for a in "$@"; do
  case $a in
    --emulated) EMU=1 ;;
    --deps-only) DEPS_ONLY=1 ;;
    *) echo "usage: scripts/gpu-check.sh [--emulated] [--deps-only]" >&2; exit 2 ;;
  esac
done
DEBS=${GPU_CHECK_DEBS:-.debs}
JOBS=${GPU_CHECK_JOBS:-$(nproc)}
if [ "$EMU" = 1 ]; then
  BUILD=${GPU_CHECK_BUILD:-build-gpu-emu}
  MAKEVARS=("BUILD=$BUILD" CUDA=emu)
  SHAPE=tiny BENCH_SHAPE=small
  # The GPU machine has one GPU: the rehearsal emulates one (the emulator's default is 8).
  export TS_EMU_GPUS=${TS_EMU_GPUS:-1}
  # Run from the suite (tests/check_gpu_rehearsal.sh), this build's runs are not the suite's own:
  # they must not count in its record of the CUDA code it ran (scripts/emu_coverage.sh).
  unset TS_EMU_COVERAGE
else
  BUILD=${GPU_CHECK_BUILD:-build-gpu}
  MAKEVARS=("BUILD=$BUILD" CUDA=1 CUDA_ARCH=90)
  SHAPE=124m BENCH_SHAPE=124m
fi
PFX=$BUILD-deps  # the unpacked .debs/ (beside the build, so a wiped build keeps it)
LOG=${OUT:-$BUILD/gpu-check}
mkdir -p "$LOG" "$BUILD"
rm -f "$LOG"/*.log "$LOG"/*.jsonl "$LOG"/summary.txt "$LOG"/logs.tar.gz  # an interrupted run's

# ----- the budget: each step's limit in seconds; their sum is the budget ---------------------------
# GPU machine (16 cores, H100/H200): estimates, since the check has not run on one yet, each with a
# margin of 2-3x. The build compiles ~55 files, ~220 CPU-seconds on a 2-core dev machine (the 3 nvcc
# files for sm_90 ~20 s of it), on 16 cores; 01 on the CPU at 124m is ~1 TFLOP a step, on every
# core. deps (a few seconds of dpkg -x) is not stopped at its limit; every other step is. The
# rehearsal's limits are for a 2-core machine, where a cold build took 90-110 s and the whole
# [cuda] set ~90 s.
STEPS=(deps build prefix gpu_probe cuda_twins "bench_$BENCH_SHAPE" "01_${SHAPE}_cpu" "01_${SHAPE}_cuda"
       "01_${SHAPE}_vs_cpu" "01_${SHAPE}_bf16" tests)
declare -A LIMIT RESULT
if [ "$EMU" = 1 ]; then
  LIMIT=([deps]=30 [build]=600 [prefix]=30 [gpu_probe]=10 [cuda_twins]=120 ["bench_$BENCH_SHAPE"]=60
         ["01_${SHAPE}_cpu"]=20 ["01_${SHAPE}_cuda"]=30 ["01_${SHAPE}_vs_cpu"]=0 ["01_${SHAPE}_bf16"]=30 [tests]=600)
else
  # tests: 7 programs' [cuda] cases, test_comm at 1, 2, 4 and 8 ranks, each rank a CUDA context.
  LIMIT=([deps]=20 [build]=150 [prefix]=10 [gpu_probe]=10 [cuda_twins]=45 ["bench_$BENCH_SHAPE"]=45
         ["01_${SHAPE}_cpu"]=50 ["01_${SHAPE}_cuda"]=30 ["01_${SHAPE}_vs_cpu"]=0 ["01_${SHAPE}_bf16"]=30 [tests]=80)
fi
# Without .debs/ (a machine with the system's packages) there is no prefix to prove.
if [ "$EMU" = 0 ] && ! ls "$DEBS"/*.deb >/dev/null 2>&1; then
  kept=()
  for s in "${STEPS[@]}"; do [ "$s" = prefix ] || kept+=("$s"); done
  STEPS=("${kept[@]}")
fi
BUDGET=0
for s in "${STEPS[@]}"; do BUDGET=$((BUDGET + ${LIMIT[$s]:-0})); done
# 8 minutes less 10 s for the summary and the archive, which come after the steps.
[ "$EMU" = 1 ] || [ $BUDGET -le 470 ] || { echo "gpu-check: the step limits add up to $BUDGET s, over 470" >&2; exit 1; }

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run NAME CMD...: runs CMD (a command or a function of this script) within the step's limit (less
# if the budget has less left), output to $LOG/NAME.log; records the status, the time and the
# step's result line for the summary. Returns CMD's status.
run() {
  local name=$1 limit=${LIMIT[$1]}
  shift
  local budget
  budget=$(left)
  [ "$limit" -gt "$budget" ] && limit=$budget
  if [ "$limit" -le 5 ]; then
    RESULT[$name]="SKIP|0|out of time"
    return 1
  fi
  local t0 rc
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then
    # A function runs in a child bash (timeout needs a process), with this script's functions.
    timeout "$limit" bash -c "$(declare -f); \"\$@\"" "$1" "$@" >"$LOG/$name.log" 2>&1
  else
    timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  fi
  rc=$?
  record "$name" $rc $(($(date +%s) - t0))
  return $rc
}

# record NAME RC SECS: the row of a finished step. Its number comes from its log (detail); a step
# that exits 0 without it has no verdict, and fails.
record() {
  local name=$1 rc=$2 secs=$3 status=ok line
  line=$(detail "$name" "$rc")
  [ "$rc" -ne 0 ] && status=FAIL
  [ "$rc" -eq 124 ] && status=TIMEOUT && line="over its ${LIMIT[$name]} s limit; ${line}"
  if [ "$rc" -eq 0 ] && [ -z "$line" ]; then status=FAIL line="no result line in $name.log"; fi
  RESULT[$name]="$status|$secs|$line"
}

# The one line of a log that says how it went: the step's own result line, else (when it failed)
# its first error.
detail() {
  local f="$LOG/$1.log" line=""
  case $1 in
    deps | build | prefix | tests) line=$(tail -n 1 "$f") ;;
    cuda_twins) line=$(grep -m 1 -E '^(All tests passed|test cases:)|no GPU visible' "$f") ;;
    gpu_probe) line=$(grep -m 1 'GPU' "$f") ;;
    bench_*) line=$(grep -m 1 -E '^linear_forward D->F +cuda +bf16' "$f") ;;
    01_*_bf16) line=$(median_rate "$LOG/$1.jsonl") ;;
    01_*) line=$(grep -E '^(step|median)' "$f" | tail -n 1) ;;
  esac
  [ -z "$line" ] && [ "$2" -ne 0 ] && line=$(grep -m 1 -E 'error:|FAIL|\*\*\*' "$f")
  echo "$line" | cut -c1-140
}

# The step records (lines with "step") of a --log-json file as "STEP LOSS TOKENS_PER_S MFU", one
# per line; a field that is not a plain number (JSON's null for a NaN) is printed as "bad".
steps_of() {
  awk '
    function field(k,   v) {
      if (!match($0, "\"" k "\": *[^,}]*")) return "bad"
      v = substr($0, RSTART, RLENGTH); sub(/^[^:]*: */, "", v)
      return v ~ /^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/ ? v : "bad"
    }
    /^\{"step":/ { print field("step"), field("loss"), field("tokens_per_s"), field("mfu") }' "$1"
}

# compare_losses NAME A B BOUND: passes when two --log-json files have the same steps and their
# losses agree within BOUND relative (the max over steps is the number). Anything else, an empty
# or missing file included, fails.
compare_losses() {
  local name=$1 a=$2 b=$3 bound=$4 verdict=""
  if [ -s "$a" ] && [ -s "$b" ]; then
    verdict=$(join <(steps_of "$a" | sort -k1,1) <(steps_of "$b" | sort -k1,1) -a 1 -a 2 -e missing -o 0,1.2,2.2 |
      awk -v bound="$bound" '
        $2 == "missing" || $3 == "missing" { bad = bad " step " $1 " in one log only;" ; next }
        $2 == "bad" || $3 == "bad" { bad = bad " step " $1 " loss not a number;"; next }
        { d = $2 - $3; d = d < 0 ? -d : d; r = $3 < 0 ? -$3 : $3; d = r > 0 ? d / r : d
          if (d > max) max = d; n++ }
        END {
          if (bad != "") print "FAIL|" substr(bad, 2)
          else if (n == 0) print "FAIL|no step losses"
          else printf "%s|max rel diff %.3g over %d steps (bound %g)\n", max <= bound ? "ok" : "FAIL", max, n, bound
        }')
  fi
  [ -n "$verdict" ] || verdict="FAIL|missing or empty logs ($(basename "$a"), $(basename "$b"))"
  RESULT[$name]="${verdict%%|*}|0|${verdict#*|}"
}

# The median tokens/s and MFU of a --log-json file's steps after the first two (warm-up); nothing
# when there are none (the step then has no number, and fails).
median_rate() {
  [ -s "$1" ] || return 0
  steps_of "$1" | awk 'BEGIN { n = 0 } $1 >= 2 && $3 != "bad" && $4 != "bad" { t[n] = $3; m[n] = $4; n++ }
    END {
      if (n == 0) exit
      for (i = 1; i < n; i++) for (j = i; j > 0 && t[j - 1] > t[j]; j--) { x = t[j]; t[j] = t[j - 1]; t[j - 1] = x }
      for (i = 1; i < n; i++) for (j = i; j > 0 && m[j - 1] > m[j]; j--) { x = m[j]; m[j] = m[j - 1]; m[j - 1] = x }
      printf "median %.0f tokens/s, MFU %.1f%% over %d steps\n", t[int(n / 2)], 100 * m[int(n / 2)], n
    }'
}

# ----- dependencies: the carried .debs, unpacked ---------------------------------------------------
# Sets PATH, CPATH, LIBRARY_PATH and LD_LIBRARY_PATH for everything that follows (the build, mpirun,
# the programs), and MAKEVARS for what the Makefile reads from `mpicxx -show`: that wrapper prints
# the packaged /usr paths, which hold nothing on the GPU machine (and the system's copies here).
setup_deps() {
  local R=$PFX/root L=$PFX/root/usr/lib/x86_64-linux-gnu debs=() f
  for f in "$DEBS"/*.deb; do
    [ -e "$f" ] || continue
    # Boost is for the emulated build alone: the GPU machine leaves it packed (138 MB unpacked).
    [ "$EMU" = 0 ] && [[ $(basename "$f") == libboost* ]] && continue
    debs+=("$f")
  done
  if [ ${#debs[@]} -eq 0 ]; then
    if [ "$EMU" = 1 ]; then
      echo "gpu-check --emulated: no packages in $DEBS/: run scripts/fetch-gpu-debs.sh first" >&2
      return 1
    fi
    echo "no $DEBS/: using the system's mpich, OpenBLAS and Catch2"
  else
    # Unpacked again only when the packages changed (a rerun on a warm machine, the rehearsal).
    local stamp
    stamp=$(cksum "${debs[@]}" | cksum)
    if [ "$(cat "$PFX/stamp" 2>/dev/null)" != "$stamp" ]; then
      rm -rf "$PFX" && mkdir -p "$R" || return 1
      for f in "${debs[@]}"; do dpkg -x "$f" "$R" || { echo "dpkg -x $f failed" >&2; return 1; }; done
      # dpkg -x runs no maintainer scripts: make the links that update-alternatives would.
      ln -sf mpiexec.hydra "$R/usr/bin/mpirun"
      ln -sf mpiexec.hydra "$R/usr/bin/mpiexec"
      ln -sf mpicxx.mpich "$R/usr/bin/mpicxx"
      ln -sf mpicc.mpich "$R/usr/bin/mpicc"
      echo "$stamp" >"$PFX/stamp"
      echo "unpacked ${#debs[@]} packages from $DEBS/ into $R"
    else
      echo "$R is already unpacked from these ${#debs[@]} packages"
    fi
    R=$(realpath "$R") L=$(realpath "$L")
    PFX_ROOT=$R
    export PATH=$R/usr/bin:$PATH
    local cpath=$R/usr/include:$R/usr/include/x86_64-linux-gnu/openblas-pthread
    local libs=$L:$L/openblas-pthread
    if [ "$EMU" = 1 ]; then
      # The rehearsal names the prefix and nothing else, so that nothing is found by accident.
      export CPATH=$cpath LIBRARY_PATH=$libs LD_LIBRARY_PATH=$libs
    else
      export CPATH=$cpath${CPATH:+:$CPATH}
      export LIBRARY_PATH=$libs${LIBRARY_PATH:+:$LIBRARY_PATH}
      export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    # gcc searches LIBRARY_PATH only after its own system folders (where this machine's OpenBLAS
    # and Boost are), so the prefix's folders go on the link line as -L too. MPI_LIB is the
    # Makefile's one variable that precedes -lopenblas and -lboost_context on every link line.
    MAKEVARS+=("MPI_INC=-I$R/usr/include/x86_64-linux-gnu/mpich" "MPI_LIB=-L$L -L$L/openblas-pthread -lmpich")
  fi
  [ "$EMU" = 0 ] || return 0
  # NCCL: the CUDA toolkit's, or else the one in the image's Python (an nvidia-nccl wheel).
  local cuda_home
  cuda_home=$(dirname "$(dirname "$(realpath "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
  if [ ! -e "$cuda_home/include/nccl.h" ] && [ ! -e /usr/include/nccl.h ] && [ ! -e /usr/local/include/nccl.h ]; then
    local d h lib
    for d in $(python3 -c 'import nvidia; print(*nvidia.__path__)' 2>/dev/null); do
      h=$(find "$d" -maxdepth 4 -name nccl.h 2>/dev/null | head -n 1)
      lib=$(find "$d" -maxdepth 4 -name 'libnccl.so.2' 2>/dev/null | head -n 1)
      [ -n "$h" ] && [ -n "$lib" ] && break
    done
    if [ -n "${h:-}" ] && [ -n "${lib:-}" ]; then
      mkdir -p "$PFX/nccl"
      ln -sf "$lib" "$PFX/nccl/libnccl.so"  # the wheel has only libnccl.so.2, and -lnccl wants this name
      CPATH=$(dirname "$h")${CPATH:+:$CPATH}
      LIBRARY_PATH=$(realpath "$PFX/nccl")${LIBRARY_PATH:+:$LIBRARY_PATH}
      LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      export CPATH LIBRARY_PATH LD_LIBRARY_PATH
      echo "NCCL from $(dirname "$(dirname "$h")")"
    else
      echo "no nccl.h in $cuda_home/include, /usr/include or Python's nvidia-nccl wheel"
    fi
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 2
}

# ----- what the check needs, before anything runs ------------------------------------------------
# Each missing piece is named with where it was looked for; any missing piece stops the check. The
# rehearsal looks in the prefix alone (this machine's own packages must not count).
require() {
  local missing=() inc=() lib=() R=${PFX_ROOT:-}
  if [ -n "$R" ]; then
    inc=("$R/usr/include" "$R/usr/include/x86_64-linux-gnu/mpich" "$R/usr/include/x86_64-linux-gnu/openblas-pthread")
    lib=("$R/usr/lib/x86_64-linux-gnu" "$R/usr/lib/x86_64-linux-gnu/openblas-pthread")
  fi
  if [ "$EMU" = 0 ]; then
    inc+=(/usr/include /usr/local/include /usr/include/x86_64-linux-gnu/mpich /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/x86_64-linux-gnu)
    lib+=(/usr/lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/local/lib)
    command -v nvcc >/dev/null || missing+=("nvcc (CUDA toolkit) on PATH")
    nvidia-smi -L >/dev/null 2>&1 || missing+=("a visible GPU (nvidia-smi -L lists none)")
    local cuda_home
    cuda_home=$(dirname "$(dirname "$(realpath "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
    CUBLAS_DIR=""
    for d in "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib" /usr/lib/x86_64-linux-gnu; do
      [ -e "$d/libcublas.so" ] && { CUBLAS_DIR=$d; break; }
    done
    [ -n "$CUBLAS_DIR" ] || missing+=("libcublas.so (looked in $cuda_home/lib64, $cuda_home/targets/x86_64-linux/lib, /usr/lib/x86_64-linux-gnu)")
    [ -n "$(find_in nccl.h "$cuda_home/include" ${CPATH//:/ })" ] || missing+=("nccl.h (CUDA include dir, /usr/include, or Python's nvidia-nccl wheel)")
  fi
  local where="the system's folders or $DEBS/ from scripts/fetch-gpu-debs.sh"
  [ "$EMU" = 1 ] && where="looked for only in $R, unpacked from $DEBS/, which scripts/fetch-gpu-debs.sh fills"
  [ -n "$(find_in mpi.h "${inc[@]}")" ] || missing+=("MPI headers (mpich's mpi.h; $where)")
  [ -n "$(find_in libmpich.so "${lib[@]}")" ] || missing+=("MPI library (libmpich.so; $where)")
  local mpirun
  mpirun=$(command -v mpirun)
  [ -n "$mpirun" ] && { [ "$EMU" = 0 ] || [[ $mpirun == "$R"/* ]]; } || missing+=("mpirun (mpich; $where)")
  [ -n "$(find_in cblas.h "${inc[@]}")" ] || missing+=("OpenBLAS headers (cblas.h; $where)")
  [ -n "$(find_in libopenblas.so "${lib[@]}")" ] || missing+=("OpenBLAS library (libopenblas.so; $where)")
  [ -n "$(find_in catch2/catch.hpp "${inc[@]}")" ] || missing+=("Catch2 v2 (catch2/catch.hpp; $where)")
  if [ "$EMU" = 1 ]; then
    [ -n "$(find_in boost/context/fiber.hpp "${inc[@]}")" ] || missing+=("Boost.Context headers (boost/context/fiber.hpp; $where)")
    [ -n "$(find_in libboost_context.so "${lib[@]}")" ] || missing+=("Boost.Context library (libboost_context.so; $where)")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-check: this machine lacks what the check needs:"
    printf '  - %s\n' "${missing[@]}"
    return 1
  fi
  if [ "$EMU" = 0 ]; then
    MAKEVARS+=("CUDA_HOME=$cuda_home" "CUDA_LIB=$CUBLAS_DIR")
    echo "CUDA $cuda_home, cuBLAS in $CUBLAS_DIR"
  fi
  echo "${#MAKEVARS[@]} make variables: ${MAKEVARS[*]}"
}
# find_in NAME DIR...: the first DIR holding NAME, or nothing.
find_in() {
  local name=$1 d
  shift
  for d in "$@"; do
    [ -n "$d" ] && [ -e "$d/$name" ] && { echo "$d"; return 0; }
  done
  return 0
}

# ----- the prefix step: what the build and the programs used came from the prefix ------------------
# prefix_used ROOT EMU BUILD BUILDLOG PROGRAM...: fails on any library, header or tool that the
# build or a program took from outside ROOT while ROOT has it. The evidence: ldd of every program
# (every library the prefix provides must load from it, and libmpich/libopenblas/libboost_context
# must be among them), the linker's trace in the build log (the rehearsal links with --trace), the
# compilers' dependency files (CPATH's headers are listed there, the system folders' are not; so
# each header must be listed from ROOT at least once and never from elsewhere), and mpirun's proxy.
prefix_used() {
  local R=$1 emu=$2 build=$3 blog=$4 bad=0 p
  shift 4
  local w want=(libmpich.so.12 libopenblas.so.0) heads=(/mpi.h /cblas.h catch2/catch.hpp)
  [ "$emu" = 1 ] && want+=(libboost_context.so.1.74.0) heads+=(boost/context/fiber.hpp)
  PROVIDED=" $(find "$R" \( -type f -o -type l \) -name 'lib*.so*' -printf '%f ') " LOADS=0 LOADED=" "
  for p in "$@" "$R/usr/bin/mpiexec.hydra" "$R/usr/bin/hydra_pmi_proxy"; do ldd_from "$R" "$p" || bad=1; done
  for w in "${want[@]}"; do
    [[ $LOADED == *" $w "* ]] || { echo "FAIL no program loads $w"; bad=1; }
  done
  if [ "$emu" = 1 ]; then
    local traced f
    traced=$(grep -oE '[^ ()]*/lib(mpich|openblas|boost_context)\.(so|a)' "$blog" | sort -u)
    for w in mpich openblas boost_context; do
      grep -q "/lib$w\." <<<"$traced" || { echo "FAIL the build's link trace names no lib$w (did it link?)"; bad=1; }
    done
    while read -r f; do
      [ -n "$f" ] && [[ $f != "$R"/* ]] && { echo "FAIL a program was linked against $f"; bad=1; }
    done <<<"$traced"
    echo "the linker's trace names $(wc -l <<<"$traced") of them:"
    echo "$traced"
  fi
  local h used elsewhere
  used=$(find "$build" -name '*.d' -exec grep -ohE '[^ ]*(/mpi\.h|/cblas\.h|catch2/catch\.hpp|boost/context/fiber\.hpp)' {} + | sort | uniq -c)
  for h in "${heads[@]}"; do
    grep -qE " $R/.*$h\$" <<<"$used" || { echo "FAIL no object's dependency file lists $h from $R"; bad=1; }
    elsewhere=$(grep -E "$h\$" <<<"$used" | grep -vE " $R/")
    [ -z "$elsewhere" ] || { echo "FAIL objects used $h from elsewhere:"; echo "$elsewhere"; bad=1; }
  done
  echo "headers in the dependency files:"
  echo "$used"
  local tool proxy
  for tool in mpirun mpicxx; do
    [[ $(command -v $tool) == "$R"/* ]] || { echo "FAIL $tool is $(command -v $tool), not $R's"; bad=1; }
  done
  proxy=$(mpirun -np 1 sh -c 'readlink /proc/$PPID/exe' 2>&1)
  [[ $proxy == "$R"/usr/bin/hydra_pmi_proxy ]] || { echo "FAIL mpirun's ranks run under $proxy"; bad=1; }
  [ $bad -eq 0 ] || { echo "FAIL: something came from outside $R"; return 1; }
  echo "$# programs: $LOADS loads of the prefix's libraries, ${#heads[@]} headers, mpirun and its proxy, all from $R"
}
# ldd_from ROOT PROGRAM: every library PROGRAM loads that ROOT provides (PROVIDED) loads from ROOT
# (each one counted in LOADS and named in LOADED); nothing is "not found".
ldd_from() {
  local R=$1 p=$2 out so path bad=0
  out=$(ldd "$p" 2>&1) || { echo "FAIL ldd $p: $out"; return 1; }
  if grep -q 'not found' <<<"$out"; then echo "FAIL $p: $(grep 'not found' <<<"$out" | tr -s ' \t' ' ')"; bad=1; fi
  while read -r so _ path _; do
    [[ $PROVIDED == *" $so "* ]] || continue
    LOADS=$((LOADS + 1)) LOADED+="$so "
    [[ $path == "$R"/* ]] || { echo "FAIL $p: $so from $path, not $R"; bad=1; }
  done < <(grep '=> /' <<<"$out")
  return $bad
}

# ----- the tests step ------------------------------------------------------------------------------
# cuda_cases BUILD PROGRAM...: every [cuda] test case of each test program, under mpirun at each
# rank count its source declares ("// ranks: 1 2 4"), as tests/run_tests.sh runs them; one line per
# run, then the count. No [cuda] case run at all is a failure, not a pass.
cuda_cases() {
  local build=$1 total=0 failed=0 progs=0 name n np ranks out rc f t0
  shift
  for name in "$@"; do
    if [ ! -x "$build/tests/$name" ]; then echo "FAIL $name: no $build/tests/$name"; failed=$((failed + 1)); continue; fi
    n=$("$build/tests/$name" --list-test-names-only "[cuda]" 2>/dev/null | grep -c .)
    if [ "${n:-0}" -eq 0 ]; then echo "--   $name: no [cuda] test cases in this build"; continue; fi
    progs=$((progs + 1))
    ranks=$(grep -m1 -E '^// ranks:' "tests/$name.cpp" | sed 's/^\/\/ ranks://')
    for np in ${ranks:-1}; do
      t0=$(date +%s)
      out=$(mpirun -np "$np" "$build/tests/$name" "[cuda]" 2>&1)
      rc=$?
      total=$((total + n))
      if [ $rc -eq 0 ] && grep -q '^All tests passed' <<<"$out"; then
        echo "ok   $name (np $np): $n [cuda] test cases ($(($(date +%s) - t0)) s)"
      else
        f=$(grep -m1 -E '^test cases:' <<<"$out" | sed -nE 's/.*\| *([0-9]+) failed.*/\1/p')
        [[ $f =~ ^[0-9]+$ ]] && [ "$f" -gt 0 ] || f=$n
        failed=$((failed + f))
        echo "FAIL $name (np $np): $f of $n failed (exit $rc, $(($(date +%s) - t0)) s)"
        sed 's/^/    /' <<<"$out" | tail -n 60
      fi
    done
  done
  echo "$((total - failed)) of $total [cuda] test cases passed in $progs programs"
  [ $total -gt 0 ] && [ $failed -eq 0 ]
}

# ----- the steps ---------------------------------------------------------------------------------
if [ "$EMU" = 1 ]; then mode="rehearsal (emulated GPU, make CUDA=emu)"; else mode="make CUDA=1 CUDA_ARCH=90"; fi
limits=""
for s in "${STEPS[@]}"; do [ -n "$s" ] && [ "${LIMIT[$s]}" -gt 0 ] && limits+=" $s ${LIMIT[$s]},"; done
t0=$(date +%s)
if ! setup_deps >"$LOG/deps.log" 2>&1; then
  cat "$LOG/deps.log" >&2
  echo "gpu-check: unpacking $DEBS/ failed" >&2
  exit 1
fi
# Not in a pipe: require adds to MAKEVARS, which a pipeline's subshell would lose.
require >"$LOG/require.log" 2>&1
rc=$?
cat "$LOG/require.log" >>"$LOG/deps.log"
if [ $rc -ne 0 ]; then
  cat "$LOG/require.log" >&2
  exit 1
fi
rm -f "$LOG/require.log"
if [ "$DEPS_ONLY" = 1 ]; then cat "$LOG/deps.log"; exit 0; fi
echo "gpu-check: $mode into $BUILD/; budget $BUDGET s:${limits%,}"
echo "$(grep -m1 -E '^(unpacked|no |.* already unpacked)' "$LOG/deps.log"); everything the check needs found" >>"$LOG/deps.log"
record deps 0 $(($(date +%s) - t0))

# A build made with other variables or another prefix is wiped (make tracks files, not flags, and
# the prefix step must see every object compiled against this prefix).
identity="${MAKEVARS[*]} CPATH=${CPATH:-} LIBRARY_PATH=${LIBRARY_PATH:-} $(cat "$PFX/stamp" 2>/dev/null)"
if [ "$(cat "$BUILD/.gpu-check-identity" 2>/dev/null)" != "$identity" ]; then
  if [ ! -e "$BUILD/.gpu-check-identity" ] && [ -n "$(find "$BUILD" -mindepth 1 -maxdepth 1 ! -name gpu-check)" ]; then
    echo "gpu-check: $BUILD/ holds a build this script did not make; remove it or name another GPU_CHECK_BUILD" >&2
    exit 1
  fi
  find "$BUILD" -mindepth 1 -maxdepth 1 ! -name gpu-check -exec rm -rf {} +
  echo "$identity" >"$BUILD/.gpu-check-identity"
fi

# What the steps run: 01, the kernel benchmark, gpu_probe, test_kernels, and the test programs with
# [cuda] cases (the CPU-only ones are CI's); `all` besides, since tests start the technique programs.
if [ -n "${GPU_CHECK_TESTS:-}" ]; then
  read -ra cuda_tests <<<"$GPU_CHECK_TESTS"
  targets=("$BUILD/01_single_gpu" "$BUILD/bench/bench_kernels")
else
  mapfile -t cuda_tests < <(grep -l '\[cuda\]' tests/test_*.cpp | xargs -n1 basename | sed 's/\.cpp$//' | grep -vx test_kernels)
  targets=(all)
fi
programs=("$BUILD/01_single_gpu" "$BUILD/bench/bench_kernels" "$BUILD/tests/gpu_probe" "$BUILD/tests/test_kernels")
for t in "${cuda_tests[@]}"; do programs+=("$BUILD/tests/$t"); done
targets+=("${programs[@]:2}")
mk=(env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make --no-print-directory -j"$JOBS" "${MAKEVARS[@]}")
if [ "$EMU" = 1 ]; then
  # Relinked every time, with the linker's trace, so that the prefix step sees where each library
  # came from (the objects stay: the identity above keeps them to this prefix).
  rm -f "${programs[@]}"
  mk+=("LD=g++ -fopenmp -Wl,--trace")
fi
# build_programs MAKE...: runs make, then counts the programs of $GPU_CHECK_PROGRAMS it left.
build_programs() {
  echo "+ $*"
  "$@" || return
  local p n=0 total=0
  for p in $GPU_CHECK_PROGRAMS; do total=$((total + 1)); [ -x "$p" ] && n=$((n + 1)); done
  echo "$n of $total programs the steps run built, $(find "$(dirname "${GPU_CHECK_PROGRAMS%% *}")" -name '*.o' | wc -l) objects"
  [ $n -eq $total ]
}
export GPU_CHECK_PROGRAMS="${programs[*]}"
run build build_programs "${mk[@]}" "${targets[@]}"
built=$?

if [ $built -eq 0 ]; then
  export TS_BUILD=$BUILD  # where the tests that start programs (01, the chapters) find them
  export OMP_NUM_THREADS=4
  [ "$EMU" = 1 ] && OMP_NUM_THREADS=$((JOBS < 4 ? JOBS : 4))
  if [ -n "${PFX_ROOT:-}" ]; then
    all_programs=()
    while IFS= read -r p; do all_programs+=("$p"); done < <(find "$BUILD" -type f -executable ! -name '*.o' ! -name '*.a' | sort)
    run prefix prefix_used "$PFX_ROOT" "$EMU" "$BUILD" "$LOG/build.log" "${all_programs[@]}"
  fi
  run gpu_probe "$BUILD/tests/gpu_probe"
  run cuda_twins mpirun -np 1 "$BUILD/tests/test_kernels" "[cuda]"
  bench_args=(--shape "$BENCH_SHAPE" --device cuda)
  # Emulated, the small shape's four linear ops alone take ~20 s: only the row the summary reports.
  [ "$EMU" = 1 ] && bench_args+=(linear_forward)
  run "bench_$BENCH_SHAPE" "$BUILD/bench/bench_kernels" "${bench_args[@]}"
  # 01 on CUDA against 01 on the CPU, fp32, 3 steps of one sequence (at 124m, 1024 tokens). cuBLAS
  # reorders fp32 sums over K up to 3072 (no TF32), so each logit moves by ~sqrt(K)·2^-24 relative;
  # through 3 AdamW steps that stays <= 1e-5 relative on the loss: bound 1e-4. The CPU side runs on
  # every core (it is the slow one).
  cmp=(--preset "$SHAPE" --batch 1 --steps 3 --lr-schedule constant --quiet)
  run "01_${SHAPE}_cpu" env OMP_NUM_THREADS="$JOBS" mpirun -np 1 "$BUILD/01_single_gpu" --device cpu "${cmp[@]}" \
    --log-json "$LOG/01_${SHAPE}_cpu.jsonl"
  run "01_${SHAPE}_cuda" mpirun -np 1 "$BUILD/01_single_gpu" --device cuda "${cmp[@]}" --log-json "$LOG/01_${SHAPE}_cuda.jsonl"
  compare_losses "01_${SHAPE}_vs_cpu" "$LOG/01_${SHAPE}_cuda.jsonl" "$LOG/01_${SHAPE}_cpu.jsonl" 1e-4
  bf16_steps=12
  [ "$EMU" = 1 ] && bf16_steps=5
  run "01_${SHAPE}_bf16" mpirun -np 1 "$BUILD/01_single_gpu" --device cuda --preset "$SHAPE" --dtype bf16 --batch 8 \
    --steps $bf16_steps --log-json "$LOG/01_${SHAPE}_bf16.jsonl"
  run tests cuda_cases "$BUILD" "${cuda_tests[@]}"
fi

# ----- summary: one file, and the logs in one archive ----------------------------------------------
failed=()
{
  printf '\n%-16s %-8s %6s  %s\n' step status secs detail
  for s in "${STEPS[@]}"; do
    [ -n "$s" ] || continue
    r=${RESULT[$s]:-"SKIP|0|not run: the build failed"}
    IFS='|' read -r st t d <<<"$r"
    printf '%-16s %-8s %6s  %s\n' "$s" "$st" "$t" "$d"
    [ "$st" = ok ] || failed+=("$s")
  done
  echo "total $(($(date +%s) - START)) s of a $BUDGET s budget"
  if [ ${#failed[@]} -eq 0 ]; then echo "gpu-check: every step passed"
  else echo "gpu-check: ${#failed[@]} steps did not pass: ${failed[*]}"; fi
  b="$LOG/bench_$BENCH_SHAPE.log"
  [ -f "$b" ] && { echo; echo "bench_kernels ${bench_args[*]}:"; tail -n +4 "$b"; }
} >"$LOG/summary.txt"
cat "$LOG/summary.txt"
# Written beside, then moved in: tar fails on a folder that changes while it reads it.
tarball=$(mktemp) && tar -czf "$tarball" -C "$LOG" --exclude summary.txt . && mv "$tarball" "$LOG/logs.tar.gz" &&
  find "$LOG" -mindepth 1 ! -name summary.txt ! -name logs.tar.gz -delete
[ ${#failed[@]} -eq 0 ]
