#!/usr/bin/env bash
# make bench, its last part: predict, then measure. Every run of 02–08 prints the step time the
# step-time model (common/training/step_time.h) predicts for it next to the one it measures; this script
# calibrates the model on this machine and collects both for 2-rank meshes of 02–08.
#
# Calibrate on what a rank does without communicating: a training step of 01 (its FLOPs per token ×
# its tokens/s is the rate a rank reaches, non-matmul work included) and bench_comm's bus bandwidths
# at 2 ranks; then predict 2-rank meshes, which the calibration never saw. On a shared machine every
# number moves with the load, so 01 is re-measured right before each run it predicts (side by side),
# the meshes are run in turn for ROUNDS rounds, and the table shows each one's median error and its
# spread; make test asserts none of it.
#
#   BUILD=build ROUNDS=3 scripts/bench_plan.sh      (make bench runs it last)
set -uo pipefail
BUILD=${BUILD:-build}
ROUNDS=${ROUNDS:-3}

# The planner's own speed: its two largest worked examples (notes/08), the pruned search and the
# exhaustive one it is tested against (--plan-exhaustive), wall and CPU seconds each. PLAN_ONLY=1
# stops after this part.
echo; echo "== the planner's search: seconds per --plan (wall, CPU), pruned and exhaustive"
plan_time() {
  local out start
  start=$(date +%s.%N)
  out=$( { /usr/bin/env time -f "%U %S" "$BUILD/08_5d_mesh" --plan "$@" >/dev/null </dev/null; } 2>&1 | tail -1)
  awk -v s="$start" -v e="$(date +%s.%N)" -v cpu="$out" 'BEGIN {split(cpu, c, " "); printf "%7.2f %7.2f", e - s, c[1] + c[2]}'
}
printf "%-78s %15s %15s\n" "08_5d_mesh --plan" "pruned" "exhaustive"
for args in "--preset 70b --gpus 256 --seq 8192 --global-batch-tokens 4194304" "--preset 8b --gpus 64"; do
  printf "%-78s %15s %15s\n" "$args" "$(plan_time $args)" "$(plan_time $args --plan-exhaustive)"
done
[ "${PLAN_ONLY:-0}" = 1 ] && exit 0
# Every run here is a program, which takes its sgemm core itself (README, Benchmarks), so the
# calibration and the runs it predicts share one core.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

echo; echo "== predict, then measure: each run's predicted step time (the step-time model) on 2 ranks of 02–08"
shape="--dim 256 --layers 4 --heads 8 --kv-heads 4 --ffn 688 --vocab 256 --seq 256 --batch 8"
cal="$BUILD/calibration.json"
steps=8
rate() { sed -n 's/^median \([0-9.]*\) tokens\/s.*/\1/p'; }
n=$("$BUILD/01_single_gpu" $shape --dry-run | sed -n 's/.*(\([0-9.]*\)M without the embedding).*/\1/p')
comm=$(mpirun -np 2 "$BUILD/bench/bench_comm" --min-bytes 4096 --max-bytes 4194304 </dev/null)
busbw() { awk -v op="$1" '$1 == op && $2 >= 4000000 {print $6}' <<<"$comm"; }
latency=$(awk '$1 == "all_reduce" && $2 == 4096 {printf "%g", $4 * 1e-6}' <<<"$comm")
mem=$(awk '/MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)
# Writes the calibration file from 01's rate now, two copies at once so that each has the share of the
# cores a rank of a 2-rank mesh will have; F = 6N + 12·L·h·s (4 layers, dim 256, seq 256). Each copy
# runs in a session of its own, as mpirun starts each rank: where the kernel groups the scheduler's
# shares by session (sched_autogroup_enabled), two copies in this script's session would split one
# share while a mesh's two ranks get two, and under load every mesh would beat its prediction.
calibrate() {
  local a b
  a=$(mktemp) b=$(mktemp)
  setsid -w "$BUILD/01_single_gpu" $shape --steps $steps --quiet --device cpu </dev/null | rate >"$a" &
  setsid -w "$BUILD/01_single_gpu" $shape --steps $steps --quiet --device cpu </dev/null | rate >"$b" &
  wait
  one=$(cat "$a" "$b" | awk '{s += $1} END {printf "%.0f", s / NR}')
  rm -f "$a" "$b"
  gflops=$(awk -v n="$n" -v t="$one" 'BEGIN {printf "%.3f", (6 * n * 1e6 + 12 * 4 * 256 * 256) * t / 1e9}')
  printf '{"gflops": %s, "memory_gib": %s, "all_reduce_gbs": %s, "all_gather_gbs": %s, "reduce_scatter_gbs": %s, "latency_s": %s}\n' \
    "$gflops" "$mem" "$(busbw all_reduce)" "$(busbw all_gather)" "$(busbw reduce_scatter)" "$latency" > "$cal"
}
# 07 routes every token to both of its 2 experts: balanced by construction, as the prediction
# assumes. A learned router on this data collapses within a few steps (one expert takes every row),
# and the busiest rank then paces each layer: top-1 of 2 measured 1.8-2.2 x its balanced prediction
# (notes/07, "routing imbalance").
runs=(
  "02_data_parallel|--dp 2 --micro-batch 4"
  "03_zero|--dp 2 --zero 1 --micro-batch 4"
  "03_zero|--dp 2 --zero 3 --micro-batch 4"
  "04_tensor_parallel|--tp 2 --sequence-parallel"
  "05_pipeline_parallel|--pp 2 --micro-batch 2"
  "05_pipeline_parallel|--pp 2 --micro-batch 1 --stage-layers 3,1"
  "06_context_parallel|--cp 2"
  "07_expert_parallel|--dp 2 --ep 2 --experts 2 --top-k 2 --micro-batch 4"
  "08_5d_mesh|--dp 2 --zero 1 --micro-batch 2"
)
echo "load before: $(uptime | sed 's/.*load average/load average/')"
# One line per run and round: its row, 01's rate just before, the run's own predicted and measured
# tokens/s (its "step time" lines) and the terms of the prediction.
results=$(mktemp)
for ((round = 1; round <= ROUNDS; round++)); do
  for i in "${!runs[@]}"; do
    IFS='|' read -r bin flags <<<"${runs[$i]}"
    calibrate
    out=$(mpirun -np 2 "$BUILD/$bin" $shape $flags --steps $steps --quiet --device cpu --calibration "$cal" </dev/null)
    pred=$(sed -n 's/^  \([0-9]*\) tokens\/s predicted, \([0-9]*\) measured.*/\1 \2/p' <<<"$out")
    terms=$(sed -n 's/^step time: predicted [0-9.]* ms = \(.*\) ms; measured.*/\1/p' <<<"$out")
    echo "$i|$one|${pred:-0 0}|$terms" >>"$results"
  done
done
echo "load after:  $(uptime | sed 's/.*load average/load average/')"
echo "calibration ($cal, the last of those rewritten before each run): $(cat "$cal")"
echo "error = predicted / measured − 1; medians over $ROUNDS rounds, the errors' range in brackets"
printf "%-72s %9s %10s %10s %7s %15s\n" "run (2 ranks, 1 thread each, $steps steps)" "01 tok/s" "predicted" "measured" "error" "range"
for i in "${!runs[@]}"; do
  IFS='|' read -r bin flags <<<"${runs[$i]}"
  awk -F'|' -v i="$i" -v r="$bin $flags" '
    function median(a, n,   j, k, t) {
      for (j = 1; j <= n; j++) for (k = j + 1; k <= n; k++) if (a[k] < a[j]) { t = a[j]; a[j] = a[k]; a[k] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    $1 == i { split($3, pm, " "); n++; o[n] = $2; p[n] = pm[1]; m[n] = pm[2]; e[n] = pm[2] > 0 ? 100 * (pm[1] / pm[2] - 1) : 0 }
    END {
      lo = e[1]; hi = e[1]; for (j = 1; j <= n; j++) { if (e[j] < lo) lo = e[j]; if (e[j] > hi) hi = e[j] }
      printf "%-72s %9.0f %10.0f %10.0f %+6.0f%% [%+4.0f%%, %+4.0f%%]\n", r, median(o, n), median(p, n), median(m, n), median(e, n), lo, hi
    }' "$results"
done
echo "the terms of each prediction (ms, last round):"
for i in "${!runs[@]}"; do
  IFS='|' read -r bin flags <<<"${runs[$i]}"
  awk -F'|' -v i="$i" -v r="$bin $flags" '$1 == i {t = $4} END {printf "  %-70s %s\n", r, t}' "$results"
done
rm -f "$results"
