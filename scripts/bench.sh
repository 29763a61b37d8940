#!/usr/bin/env bash
# make bench: kernels, collectives and the training step, each next to its reference.
# OpenBLAS is given the right core for every side of a comparison: Debian's build misdetects some
# CPUs as an old core and runs sgemm several times slower otherwise.
set -uo pipefail
BUILD=${BUILD:-build}
# Both sides of every comparison run their fastest kernels on this CPU, whatever the environment
# forced (an environment may pin Haswell on an AVX-512 Xeon, which would compare 01 on AVX2 with
# PyTorch's MKL on AVX-512). 01's sgemm core is the one the programs take by themselves (by
# instruction set; Haswell's AVX2 kernels on Zen 4, where they outrun the AVX-512 ones: README),
# and the GEMM-only limit and the kernel rows get the same. A forced core is reported, then
# overridden; BENCH_KEEP_CORETYPE=1 keeps it.
best=$(env -u OPENBLAS_CORETYPE "$BUILD/01_single_gpu" --preset tiny --steps 0 --quiet --device cpu </dev/null |
       sed -n 's/.*sgemm core \([A-Za-z0-9]*\).*/\1/p')
if [ -n "${OPENBLAS_CORETYPE:-}" ] && [ -n "$best" ] && [ "$OPENBLAS_CORETYPE" != "$best" ]; then
  if [ "${BENCH_KEEP_CORETYPE:-0}" = 1 ]; then best=$OPENBLAS_CORETYPE
  else echo "the environment forces OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE; 01 takes $best on this CPU, which the bench uses"; fi
fi
[ -n "$best" ] && export OPENBLAS_CORETYPE=$best
# Both sides' idle OpenMP threads wait the same way, 01's default (common/comm/threads.h): a short spin,
# then sleep (PyTorch's bundled libgomp reads the same variables). Set either to compare others.
if [ -z "${OMP_WAIT_POLICY:-}${GOMP_SPINCOUNT:-}" ]; then export OMP_WAIT_POLICY=passive GOMP_SPINCOUNT=10000; fi
echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-auto} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset} GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-unset}"

echo; echo "== kernels (one thread)"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -np 1 "$BUILD/bench/bench_kernels"

echo; echo "== collectives (bus bandwidth, as nccl-tests reports it)"
OMP_NUM_THREADS=1 mpirun -np 2 "$BUILD/bench/bench_comm"

echo; echo "== training step at dim 256, 4 layers, 8 heads (4 kv), ffn 688, vocab 256, seq 256, batch 8"
# 01 next to the same step in PyTorch 2.x (F.scaled_dot_product_attention, torch.compile), and next
# to the step's GEMM-only limit: its matmuls alone, at their shapes, as plain sgemm calls
# (bench_gemm). The machine may be shared, so they run in turns: a round runs 01, PyTorch and
# bench_gemm at 1 thread, then at 2 (01 and PyTorch swap places every round), ROUNDS rounds. Each
# column shows the median and [min-max] of the rounds; ratios (01 over PyTorch, over the limit, 2
# threads over 1) are taken within a round, where the load was about the same.
shape="--dim 256 --layers 4 --heads 8 --kv-heads 4 --ffn 688 --vocab 256 --seq 256 --batch 8"
rounds=${ROUNDS:-3}
venv=${TORCH_VENV:-build/torch-venv}
torch_py="$venv/bin/python"
tok_s() { awk '/^median [0-9.]+ tokens\/s/ {print $2}'; }  # 01's last line and torch2_llama.py's
# Which sgemm PyTorch's MKL runs: MKL_VERBOSE names the instruction set it dispatched to. On AMD
# CPUs stock MKL stays on its AVX2 kernels (about half the AVX-512 speed) unless its Intel check
# is overridden: a one-line library that says "Intel" (MKL_AMD_AVX512=0 keeps stock MKL).
vendor=$(awk -F': *' '/^vendor_id/ {print $2; exit}' /proc/cpuinfo)
preload=
if [ "$vendor" = AuthenticAMD ] && [ "${MKL_AMD_AVX512:-1}" = 1 ] && [ -x "$torch_py" ]; then
  preload="$BUILD/bench/libmkl_intel_cpu_true.so"
  echo 'int mkl_serv_intel_cpu_true(void) { return 1; }' | gcc -O2 -shared -fPIC -x c - -o "$preload" || preload=
fi
probe=$(MKL_VERBOSE=1 LD_PRELOAD=$preload "$torch_py" -c \
        'import torch; torch.ones(64, 64) @ torch.ones(64, 64); print("torch", torch.__version__)' 2>/dev/null)
version=$(sed -n 's/^torch \([0-9].*\)/\1/p' <<<"$probe")
if [ "${version%%.*}" -ge 2 ] 2>/dev/null; then
  mkl=$(sed -n 's/^MKL_VERBOSE oneMKL \([0-9.]*\).*(Intel(R) \(AVX[^)]*\)).*/MKL \1, \2 kernels/p' <<<"$probe" | head -1)
  # On AMD MKL's banner names no instruction set ("Intel(R) Architecture processors"): say so.
  [ -z "$mkl" ] && mkl=$(sed -n 's/^MKL_VERBOSE oneMKL \([0-9.]*\).*/MKL \1 (its banner names no instruction set on this CPU)/p' <<<"$probe" | head -1)
  echo "PyTorch $version ($venv), attn sdpa, torch.compile default;" \
       "sgemm: ${mkl:-MKL (MKL_VERBOSE printed nothing)} on $vendor${preload:+ (LD_PRELOAD overrides the Intel check of MKL)}"
  if [ "$vendor" = AuthenticAMD ] && [ -z "$preload" ]; then
    echo "  stock MKL on AMD: AVX2 sgemm, about half the speed of PyTorch at its best (MKL_AMD_AVX512=1: AVX-512)"
  fi
else
  torch_py= preload=
  echo "PyTorch 2.x: not found in $venv; scripts/torch-venv.sh installs it there (CPU-only, about 2 GB;"
  echo "TORCH_VENV=DIR for another place). The rows below run without it."
fi
# The kernels 01's bf16 matmuls run (common/kernels/kernels_bf16.h: amx, avx512-bf16 or widen).
echo "01: $(OMP_NUM_THREADS=1 "$BUILD/01_single_gpu" --preset tiny --steps 1 --dtype bf16 --quiet --device cpu \
             </dev/null | sed -n 's/^threads: .*; \(sgemm core .*\)/\1/p')"
declare -A ours theirs limit solo pair  # tokens/s by "threads,round" (fp32) and "threads bf16,round"
# 01 as it runs by default: t OpenMP threads share the work, OpenBLAS runs one thread (see Threads
# in the README). $1: fp32 or bf16 (01's --dtype; PyTorch's bf16 peer is autocast).
run_ours() {
  local key=$t${1#fp32}; key=${key/bf16/ bf16}
  ours[$key,$r]=$(OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=1 "$BUILD/01_single_gpu" $shape --dtype $1 --steps 16 \
                  --quiet --device cpu </dev/null | tok_s)
}
run_theirs() {
  [ -n "$torch_py" ] || return 0
  local key=$t${1#fp32} autocast=none; key=${key/bf16/ bf16}; [ "$1" = bf16 ] && autocast=bf16
  theirs[$key,$r]=$(OMP_NUM_THREADS=$t LD_PRELOAD=$preload "$torch_py" bench/torch2_llama.py $shape --threads $t \
                    --attn sdpa --compile default --autocast $autocast --warmup 2 --steps 8 </dev/null \
                    2>"$BUILD/torch2_llama.err" | tok_s)
  [ -n "${theirs[$key,$r]}" ] || { echo "bench/torch2_llama.py failed:"; tail -5 "$BUILD/torch2_llama.err"; }
}
gemm_limit() {  # tokens/s of the step's matmuls alone, as plain sgemm calls on $1 threads
  OPENBLAS_NUM_THREADS=$1 "$BUILD/bench/bench_gemm" $shape --threads $1 </dev/null |
    sed -n 's/^gemm_limit tokens_per_s=\([0-9]*\).*/\1/p'
}
sustained() {  # tokens/s of one process running the step's matmuls back to back for 4 s, one thread
  OPENBLAS_NUM_THREADS=1 "$BUILD/bench/bench_gemm" $shape --threads 1 --seconds 4 </dev/null |
    sed -n 's/^gemm_sustained tokens_per_s=\([0-9]*\).*/\1/p'
}
for ((r = 0; r < rounds; r++)); do
  for t in 1 2; do
    for dt in fp32 bf16; do
      if ((r % 2 == 0)); then run_ours $dt; run_theirs $dt; else run_theirs $dt; run_ours $dt; fi
    done
    limit[$t,$r]=$(gemm_limit $t)
  done
  # The machine's own ceiling for a second thread: two one-thread bench_gemm processes at once share
  # no data and no locks, only the hardware (cores, caches, memory, and whatever the host gives the
  # virtual CPUs). Their summed sustained rate over one process's, just before, bounds what any
  # two-thread run can gain here.
  solo[1,$r]=$(sustained)
  pair[2,$r]=$( (sustained & sustained; wait) | awk '{s += $1; n++} END {if (n == 2) print s}')
done
# The median [min-max] of the numbers on stdin (blank or 0: not measured), printed with format $1
# after scaling by $2.
stats() { awk '$1 > 0' | sort -g | awk -v f="$1" -v k="${2:-1}" '{v[++n] = $1 * k}
  END {if (!n) print "-"; else printf f "\n", n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2, v[1], v[n]}'; }
col() { local -n a=$1; local r; for ((r = 0; r < rounds; r++)); do echo "${a[$2,$r]:-0}"; done; }
# round by round, column $1 over column $2 (rounds where either is missing are left out)
per_round() { paste <(col "$1" "$2") <(col "$3" "$4") | awk '$1 > 0 && $2 > 0 {print $1 / $2}'; }
echo "tokens/s, median [min-max] of $rounds rounds; ratios per round"
printf "%-8s %-20s %-20s %-20s %-20s %s\n" "threads" "01_single_gpu" "PyTorch compiled" "01/PyTorch" "GEMM-only limit" "01/limit"
for key in 1 2 "1 bf16" "2 bf16"; do
  t=${key%% *}
  printf "%-8s %-20s %-20s %-20s %-20s %s\n" "$key" "$(col ours "$key" | stats '%.0f [%.0f-%.0f]')" \
    "$(col theirs "$key" | stats '%.0f [%.0f-%.0f]')" "$(per_round ours "$key" theirs "$key" | stats '%.2fx [%.2f-%.2f]')" \
    "$(col limit $t | stats '%.0f [%.0f-%.0f]')" "$(per_round ours "$key" limit $t | stats '%.0f%% [%.0f-%.0f]' 100)"
done
echo "bf16 rows: 01 --dtype bf16, PyTorch under torch.autocast(bfloat16); the GEMM-only limit stays fp32 sgemm's"
echo "01 bf16 over 01 fp32, round by round: 1 thread $(per_round ours "1 bf16" ours 1 | stats '%.2fx [%.2f-%.2f]')," \
     "2 threads $(per_round ours "2 bf16" ours 2 | stats '%.2fx [%.2f-%.2f]')"
echo "01 at 2 threads over 1 thread, round by round: fp32 $(per_round ours 2 ours 1 | stats '%.2fx [%.2f-%.2f]')," \
     "bf16 $(per_round ours "2 bf16" ours "1 bf16" | stats '%.2fx [%.2f-%.2f]')"
echo "the machine's ceiling for 2 over 1: two one-thread bench_gemm processes at once, summed, over one alone:" \
     "$(per_round pair 2 solo 1 | stats '%.2fx [%.2f-%.2f]')"
echo "GEMM-only limit: every matmul of the step at its M, N, K as one cblas_sgemm (causal attention's"
echo "products at half their dense time), the fastest of 5 rounds; $BUILD/bench/bench_gemm prints the rate of each."

echo; echo "== where the time goes (one thread, per-op share of a training step)"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 TS_PROFILE=1 "$BUILD/01_single_gpu" $shape --steps 4 --quiet --device cpu | sed -n '/^profile/,$p'

echo; echo "== checkpoint stall per save: synchronous vs --async-save (01, 31 steps, --save-every 10, one rank)"
# The seconds training waits in each periodic save: the whole save when synchronous; the staging
# copy (and any wait for the previous save) when asynchronous. The checkpoints are the fp32
# weights and both moments, 12 bytes per parameter. A short sequence keeps the steps short, and
# ten steps between saves give the background writer its time. The first asynchronous save also
# faults its staging pages in (the max); later ones reuse them (the median).
for preset in small 124m; do
  for how in "" "--async-save"; do
    dir=$(mktemp -d)
    line=$(OMP_NUM_THREADS=2 "$BUILD/01_single_gpu" --preset "$preset" --batch 1 --seq 64 --steps 31 --save-every 10 \
      --save "$dir/ck" $how --quiet --device cpu | grep '^checkpoints:')
    rm -rf "$dir"
    printf "%-5s %-13s %s\n" "$preset" "${how:---sync}" "${line#checkpoints: }"
  done
done

"$(dirname "$0")/bench_plan.sh"  # predict, then measure: each run's predicted step time against its own
