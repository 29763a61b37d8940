#!/usr/bin/env bash
# The planner's best mesh for each model and node count of the playbook's benchmark grid (H100
# nodes of 8 GPUs, sequence 4096, 1M tokens per step), one markdown table row each.
#   scripts/plan_grid.sh [BUILD_DIR] [MODELS] [NODES]      default: build "1b 3b 8b 80b" "1 4 8 64"
set -euo pipefail
build=${1:-build}
models=${2:-1b 3b 8b 80b}
nodes=${3:-1 4 8 64}
echo "| model | nodes | best mesh | memory per GPU | tok/s/GPU | MFU |"
echo "|---|---|---|---|---|---|"
for m in $models; do
  for n in $nodes; do
    out=$("$build/08_5d_mesh" --plan --preset "$m" --gpus $((8 * n)) --seq 4096 --global-batch-tokens 1048576)
    best=$(grep -E '^1 ' <<<"$out" || true)
    if [ -z "$best" ]; then
      echo "| $m | $n | $(grep -o 'no mesh fits.*' <<<"$out") | | | |"
      continue
    fi
    # "1    dp 64 tp 1 ZeRO-1, micro-batch 1, recompute none   64.33 GiB   9607   50.0%   0.0 ms   0.0%"
    read -r mesh mem tok mfu < <(sed -E 's/^1 +(.*[a-z]) +([0-9.]+ [KMGT]?i?B) +([0-9]+) +([0-9.]+%).*/\1|\2|\3|\4/' <<<"$best" | tr '|' '\t' | tr ' ' '_' | tr '\t' ' ')
    echo "| $m | $n | ${mesh//_/ } | ${mem//_/ } | $tok | $mfu |"
  done
done
