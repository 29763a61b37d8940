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
#   ONLY=07_expert_parallel scripts/bench_plan.sh   (the rows of one program; PLAN_ONLY=1: the search alone)
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

echo; echo "== predict, then measure: each run's predicted step time (the step-time model) on 2 (or 4) ranks of 02–08"
shape="--dim 256 --layers 4 --heads 8 --kv-heads 4 --ffn 688 --vocab 256 --seq 256 --batch 8"
cal="$BUILD/calibration.json"
steps=8
rate() { sed -n 's/^median \([0-9.]*\) tokens\/s.*/\1/p'; }
# bench_comm at the ranks of the run predicted (2, or 4 for the rows that need them), measured once.
declare -A comm_at
measure_comm() {
  [ -n "${comm_at[$1]:-}" ] || comm_at[$1]=$(mpirun -np "$1" "$BUILD/bench/bench_comm" --min-bytes 4096 --max-bytes 4194304 </dev/null)
  comm=${comm_at[$1]}
}
busbw() { awk -v op="$1" '$1 == op && $2 >= 4000000 {print $6}' <<<"$comm"; }
latency_of() { awk '$1 == "all_reduce" && $2 == 4096 {printf "%g", $4 * 1e-6}' <<<"$comm"; }
mem=$(awk '/MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)
# The parameters a token's FLOPs count (millions, without the embedding): a mixture of experts
# counts its active ones (01 prints both; F = 6N + 12·L·h·s).
active_params() {
  local dry
  dry=$("$BUILD/01_single_gpu" $shape $1 --dry-run </dev/null)
  local n=$(sed -n 's/.*FLOPs count the \([0-9.]*\)M active parameters.*/\1/p' <<<"$dry")
  [ -n "$n" ] || n=$(sed -n 's/.*(\([0-9.]*\)M without the embedding).*/\1/p' <<<"$dry")
  echo "$n"
}
# Writes the calibration file from 01's rate now on the model of the run it predicts ($1: its model
# flags), as many copies at once as the mesh has ranks ($2) so that each has the share of the
# cores a rank of the mesh will have; F = 6N + 12·L·h·s (4 layers, dim 256, seq 256). The rate is
# the model's own on one rank (a mixture of experts' routing, row copies and narrower matmuls
# included); what the step-time model predicts is what the mesh adds to it. The file names the
# model ("model"), and every run prints it beside the rate. Each copy runs in a session of its own, as mpirun starts each rank:
# where the kernel groups the scheduler's shares by session (sched_autogroup_enabled), two copies in
# this script's session would split one share while a mesh's two ranks get two, and under load
# every mesh would beat its prediction.
calibrate() {
  local n k files=()
  n=$(active_params "$1")
  measure_comm "$2"
  for ((k = 0; k < $2; k++)); do
    files+=("$(mktemp)")
    setsid -w "$BUILD/01_single_gpu" $shape $1 --steps $steps --quiet --device cpu </dev/null | rate >"${files[k]}" &
  done
  wait
  one=$(cat "${files[@]}" | awk '{s += $1} END {printf "%.0f", s / NR}')
  rm -f "${files[@]}"
  gflops=$(awk -v n="$n" -v t="$one" 'BEGIN {printf "%.3f", (6 * n * 1e6 + 12 * 4 * 256 * 256) * t / 1e9}')
  local model=${shape% --batch*}${1:+ $1}
  printf '{"gflops": %s, "memory_gib": %s, "all_reduce_gbs": %s, "all_gather_gbs": %s, "reduce_scatter_gbs": %s, "latency_s": %s, "model": "%s"}\n' \
    "$gflops" "$mem" "$(busbw all_reduce)" "$(busbw all_gather)" "$(busbw reduce_scatter)" "$(latency_of)" "$model" > "$cal"
}
# Each row: binary | model flags (01 is calibrated on the same model) | mesh flags [| ranks, 2
# unless given: DualPipeV's pairs need pp 2 × ep 2, 4 ranks on this machine's cores]. 07 routes
# every token to both of its 2 experts in the first row: balanced by construction. A learned
# router on this data collapses within a few steps (one expert takes most rows), and the busiest
# rank then paces each layer: the next two rows price it at the imbalance their routing measured
# (notes/07, "The MoE term of the step time"), softmax top-2 of 4 and DeepSeek's routing.
deepseek="--experts 8 --expert-ffn 172 --top-k 2 --shared-experts 1 --router sigmoid"
runs=(
  "02_data_parallel||--dp 2 --micro-batch 4"
  "03_zero||--dp 2 --zero 1 --micro-batch 4"
  "03_zero||--dp 2 --zero 3 --micro-batch 4"
  "04_tensor_parallel||--tp 2 --sequence-parallel"
  "04_tensor_parallel||--tp 2 --sequence-parallel --async-tp"  # 04a: the forward's f/g rings under the GEMMs
  "05_pipeline_parallel||--pp 2 --micro-batch 2"
  "05_pipeline_parallel||--pp 2 --micro-batch 1 --stage-layers 3,1"
  "06_context_parallel||--cp 2"
  "07_expert_parallel|--experts 2 --top-k 2|--dp 2 --ep 2 --micro-batch 4"
  "07_expert_parallel|--experts 4 --top-k 2|--dp 2 --ep 2 --micro-batch 4"
  "07_expert_parallel|$deepseek|--dp 2 --ep 2 --micro-batch 4"
  "07_expert_parallel|--experts 4 --top-k 2|--dp 2 --ep 2 --micro-batch 2"
  "07_expert_parallel|--experts 4 --top-k 2|--dp 2 --ep 2 --micro-batch 2 --overlap-a2a"  # 07b: the pair's all-to-alls under compute
  "08_5d_mesh||--dp 2 --zero 1 --micro-batch 2"
  "08_5d_mesh|--experts 4 --top-k 2|--dp 2 --ep 2 --pp 2 --schedule dualpipev --micro-batch 1|4"
  "08_5d_mesh|--experts 4 --top-k 2|--dp 2 --ep 2 --pp 2 --schedule dualpipev --micro-batch 1 --overlap-a2a|4"  # 07b under the V's pairs
)
if [ -n "${ONLY:-}" ]; then
  kept=()
  for row in "${runs[@]}"; do [ "${row%%|*}" = "$ONLY" ] && kept+=("$row"); done
  [ ${#kept[@]} -gt 0 ] || { echo "ONLY=$ONLY: no such row (a program of 02-08)" >&2; exit 1; }
  runs=("${kept[@]}")
fi
echo "load before: $(uptime | sed 's/.*load average/load average/')"
# One line per run and round: its row, 01's rate just before, the run's own predicted and measured
# tokens/s (its "step time" lines) and the terms of the prediction.
results=$(mktemp)
for ((round = 1; round <= ROUNDS; round++)); do
  for i in "${!runs[@]}"; do
    IFS='|' read -r bin model flags np <<<"${runs[$i]}"
    calibrate "$model" "${np:-2}"
    out=$(mpirun -np "${np:-2}" "$BUILD/$bin" $shape $model $flags --steps $steps --quiet --device cpu --calibration "$cal" </dev/null)
    pred=$(sed -n 's/^  \([0-9]*\) tokens\/s predicted, \([0-9]*\) measured.*/\1 \2/p' <<<"$out")
    terms=$(sed -n 's/^step time: predicted [0-9.]* ms = \(.*\) ms; measured.*/\1/p' <<<"$out")
    echo "$i|$one|${pred:-0 0}|$terms" >>"$results"
  done
done
echo "load after:  $(uptime | sed 's/.*load average/load average/')"
echo "calibration ($cal, the last of those rewritten before each run): $(cat "$cal")"
echo "error = predicted / measured − 1; medians over $ROUNDS rounds, the errors' range in brackets"
printf "%-128s %9s %10s %10s %7s %15s\n" "run (2 ranks unless named, 1 thread each, $steps steps)" "01 tok/s" "predicted" "measured" "error" "range"
for i in "${!runs[@]}"; do
  IFS='|' read -r bin model flags np <<<"${runs[$i]}"
  awk -F'|' -v i="$i" -v r="$bin${model:+ $model} $flags${np:+ ($np ranks)}" '
    function median(a, n,   j, k, t) {
      for (j = 1; j <= n; j++) for (k = j + 1; k <= n; k++) if (a[k] < a[j]) { t = a[j]; a[j] = a[k]; a[k] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    $1 == i { split($3, pm, " "); n++; o[n] = $2; p[n] = pm[1]; m[n] = pm[2]; e[n] = pm[2] > 0 ? 100 * (pm[1] / pm[2] - 1) : 0 }
    END {
      lo = e[1]; hi = e[1]; for (j = 1; j <= n; j++) { if (e[j] < lo) lo = e[j]; if (e[j] > hi) hi = e[j] }
      printf "%-128s %9.0f %10.0f %10.0f %+6.0f%% [%+4.0f%%, %+4.0f%%]\n", r, median(o, n), median(p, n), median(m, n), median(e, n), lo, hi
    }' "$results"
done
echo "the terms of each prediction (ms, last round):"
for i in "${!runs[@]}"; do
  IFS='|' read -r bin model flags np <<<"${runs[$i]}"
  awk -F'|' -v i="$i" -v r="$bin${model:+ $model} $flags${np:+ ($np ranks)}" '$1 == i {t = $4} END {printf "  %-70s %s\n", r, t}' "$results"
done
rm -f "$results"
