#!/usr/bin/env bash
# make bench: kernels, collectives and the training step, each next to its reference.
# OpenBLAS is given the right core for every side of a comparison: Debian's build misdetects some
# CPUs as an old core and runs sgemm several times slower otherwise.
set -uo pipefail
BUILD=${BUILD:-build}
if grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}
elif grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}; fi
# OpenMP threads that spin after a parallel region steal the core OpenBLAS's own threads need
# (the pthread build): both sides run with passive waiting.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-auto} OMP_WAIT_POLICY=$OMP_WAIT_POLICY"

echo; echo "== kernels (one thread)"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -np 1 "$BUILD/bench/bench_kernels"

echo; echo "== collectives (bus bandwidth, as nccl-tests reports it)"
OMP_NUM_THREADS=1 mpirun -np 2 "$BUILD/bench/bench_comm"

echo; echo "== training step at dim 256, 4 layers, 8 heads (4 kv), ffn 688, vocab 256, seq 256, batch 8"
shape="--dim 256 --layers 4 --heads 8 --kv-heads 4 --ffn 688 --vocab 256 --seq 256 --batch 8"
torch_ok=0
/usr/bin/python3 -c "import torch" 2>/dev/null && torch_ok=1
printf "%-8s %16s %16s %8s\n" threads "tinyscale tok/s" "pytorch tok/s" ratio
for t in 1 2; do
  ours=$(OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=1 "$BUILD/01_single_gpu" $shape --steps 16 --quiet --device cpu \
         | sed -n 's/^median \([0-9]*\) tokens.*/\1/p')
  if [ $torch_ok = 1 ]; then
    theirs=$(OMP_NUM_THREADS=$t /usr/bin/python3 bench/torch_llama.py $shape --steps 8 --threads $t \
             | sed -n 's/.*tokens_per_s=\([0-9]*\).*/\1/p')
    printf "%-8s %16s %16s %8s\n" "$t" "$ours" "$theirs" "$(awk -v a="$ours" -v b="$theirs" 'BEGIN{printf "%.2fx", a/b}')"
  else
    printf "%-8s %16s %16s\n" "$t" "$ours" "(python3-torch not installed)"
  fi
done

echo; echo "== where the time goes (one thread, per-op share of a training step)"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 TS_PROFILE=1 "$BUILD/01_single_gpu" $shape --steps 4 --quiet --device cpu | sed -n '/^profile/,$p'

echo; echo "== predict, then measure: the planner (--plan --gpu local) against 2-rank runs of 02–08"
# Calibrate on what a rank does without communicating: a training step of 01 (its FLOPs per token ×
# its tokens/s is the rate a rank reaches, non-matmul work included) and bench_comm's bus bandwidths
# at 2 ranks; then predict 2-rank meshes, which the calibration never saw. On a shared machine every number
# moves with the load, so 01 is re-measured right before each run it predicts (side by side), and
# the table is read as ratios; make test asserts none of it.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
cal="$BUILD/calibration.json"
steps=8
rate() { sed -n 's/^median \([0-9.]*\) tokens\/s.*/\1/p'; }
n=$("$BUILD/01_single_gpu" $shape --dry-run | sed -n 's/.*(\([0-9.]*\)M without the embedding).*/\1/p')
comm=$(mpirun -np 2 "$BUILD/bench/bench_comm" --min-bytes 4096 --max-bytes 4194304 </dev/null)
busbw() { awk -v op="$1" '$1 == op && $2 >= 4000000 {print $6}' <<<"$comm"; }
latency=$(awk '$1 == "all_reduce" && $2 == 4096 {printf "%g", $4 * 1e-6}' <<<"$comm")
mem=$(awk '/MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)
# Writes the calibration file from 01's rate now, two copies at once so that each has the share of the
# cores a rank of a 2-rank mesh will have; F = 6N + 12·L·h·s (4 layers, dim 256, seq 256).
calibrate() {
  local a b
  a=$(mktemp) b=$(mktemp)
  "$BUILD/01_single_gpu" $shape --steps $steps --quiet --device cpu </dev/null | rate >"$a" &
  "$BUILD/01_single_gpu" $shape --steps $steps --quiet --device cpu </dev/null | rate >"$b" &
  wait
  one=$(cat "$a" "$b" | awk '{s += $1} END {printf "%.0f", s / NR}')
  rm -f "$a" "$b"
  gflops=$(awk -v n="$n" -v t="$one" 'BEGIN {printf "%.3f", (6 * n * 1e6 + 12 * 4 * 256 * 256) * t / 1e9}')
  printf '{"gflops": %s, "memory_gib": %s, "all_reduce_gbs": %s, "all_gather_gbs": %s, "reduce_scatter_gbs": %s, "latency_s": %s}\n' \
    "$gflops" "$mem" "$(busbw all_reduce)" "$(busbw all_gather)" "$(busbw reduce_scatter)" "$latency" > "$cal"
}
calibrate
echo "calibration ($cal, rewritten before each run): $(cat "$cal")"
printf "%-44s %12s %15s %14s %8s\n" "run (2 ranks, 1 thread each)" "01 tok/s" "predicted tok/s" "measured tok/s" "error"
# binary | its flags | the same mesh for --plan
while IFS='|' read -r bin flags mesh; do
  calibrate
  measured=$(mpirun -np 2 "$BUILD/$bin" $shape $flags --steps $steps --quiet --device cpu </dev/null | rate)
  per_gpu=$("$BUILD/08_5d_mesh" --plan --gpu local --calibration "$cal" --gpus 2 --gpus-per-node 2 $shape --dtype fp32 $mesh |
            sed -n 's/.*; \([0-9]*\) tok\/s\/GPU.*/\1/p')
  awk -v r="$bin $flags" -v o="$one" -v p="$per_gpu" -v m="$measured" \
    'BEGIN {e = m > 0 ? 100 * (2 * p / m - 1) : 0; printf "%-44s %12.0f %15.0f %14.0f %+7.0f%%\n", r, o, 2 * p, m, e}'
done <<'RUNS'
02_data_parallel|--dp 2 --micro-batch 4|--dp 2 --micro-batch 4
03_zero|--dp 2 --zero 1 --micro-batch 4|--dp 2 --zero 1 --micro-batch 4
03_zero|--dp 2 --zero 3 --micro-batch 4|--dp 2 --zero 3 --micro-batch 4
04_tensor_parallel|--tp 2 --sequence-parallel|--tp 2 --micro-batch 8
05_pipeline_parallel|--pp 2 --micro-batch 2|--pp 2 --micro-batch 2
06_context_parallel|--cp 2|--cp 2 --micro-batch 8
08_5d_mesh|--dp 2 --zero 1 --micro-batch 2|--dp 2 --zero 1 --micro-batch 2
RUNS
