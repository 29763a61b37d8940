#!/usr/bin/env bash
# The planner against the playbook's measurements: for each cell of its heatmap of best
# configurations (nodes of 8 H100s, sequences of 4096, 1M tokens per step; the mesh, micro-batch
# and ZeRO stage the cell names), the MFU it measured next to the one `--plan` predicts for that
# very mesh, and the error predicted/measured − 1. The single-node row calibrated the planner's one
# free constant (kH100Achievable); every other row is held out.
#   scripts/plan_vs_playbook.sh [BUILD_DIR] [records]
# PLAN_FLAGS adds flags to every cell's --plan (PLAN_FLAGS="--collective-model flat": the table alone).
set -euo pipefail
build=${1:-build}
# model nodes dp tp pp micro-batch zero measured-MFU% (the playbook, "best configurations" heatmap)
cells="
1b 1 4 1 2 4 1 44.32
1b 2 8 1 2 1 1 41.59
1b 4 16 1 2 1 1 38.38
1b 8 32 1 2 1 1 32.47
1b 16 64 2 1 4 0 29.46
1b 32 64 4 1 4 0 23.20
1b 64 128 2 2 2 1 5.25
3b 1 4 1 2 2 1 46.68
3b 2 8 1 2 2 1 43.77
3b 4 16 1 2 2 1 40.39
3b 8 32 1 2 1 1 35.53
3b 16 32 4 1 8 0 34.59
3b 32 64 4 1 4 0 26.77
3b 64 128 4 1 2 1 10.49
8b 1 2 1 4 1 1 45.22
8b 2 4 4 1 4 1 43.94
8b 4 16 1 2 1 1 43.31
8b 8 32 1 2 1 1 39.50
8b 16 16 8 1 8 0 36.33
8b 32 32 8 1 8 0 32.71
8b 64 128 4 1 2 0 18.69
80b 4 1 8 4 1 0 14.76
80b 8 1 4 16 1 0 30.65
80b 16 1 4 32 1 0 34.29
80b 32 4 4 16 1 1 30.75
80b 64 32 16 1 2 1 17.79
"
echo "| model | nodes | mesh (the playbook's) | measured MFU | predicted MFU | error |"
echo "|---|---|---|---|---|---|"
errs=()
while read -r model nodes dp tp pp mb zero measured; do
  [ -z "$model" ] && continue
  extra=""
  [ "$tp" -gt 8 ] && extra="--kv-heads $tp"  # tp 16 needs 16 kv heads (the preset has 8)
  out=$("$build/08_5d_mesh" --plan --preset "$model" --gpus $((8 * nodes)) --seq 4096 --global-batch-tokens 1048576 \
        --dp "$dp" --tp "$tp" --pp "$pp" --micro-batch "$mb" --zero "$zero" --virtual-stages 1 --recompute none $extra ${PLAN_FLAGS:-})
  pred=$(sed -n 's/.*MFU \([0-9.]*\)%.*/\1/p' <<<"$out" | head -1)
  err=$(awk -v p="$pred" -v m="$measured" 'BEGIN{printf "%+.0f%%", 100 * (p / m - 1)}')
  [ "$nodes" -gt 1 ] && errs+=("$(awk -v p="$pred" -v m="$measured" 'BEGIN{e = p / m - 1; print (e < 0 ? -e : e)}')")
  echo "| $model | $nodes | dp $dp tp $tp pp $pp, micro-batch $mb, ZeRO-$zero | $measured% | $pred% | $err |"
done <<<"$cells"
printf '%s\n' "${errs[@]}" | sort -g | awk '{a[NR] = $1} END {m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2;
  over = 0; for (i = 1; i <= NR; i++) if (a[i] > 0.5) over++;
  printf "held out (2-64 nodes): %d cells, median |error| %.0f%%, largest %.0f%%, %d above 50%%\n", NR, 100 * m, 100 * a[NR], over}'
[ "${2:-}" = records ] || exit 0
# With `records`: the frontier's published runs, planned as the chapters run them (before) and with
# the overlaps those runs use (--frontier all; DeepSeek-V3 also in FP8, recomputing nothing that
# costs matmul FLOPs): Llama 3 405B's table 4 (MFU) and DeepSeek-V3's table 1 (H800 GPU-hours for
# 14.8T tokens, from the plan's tokens/s per GPU).
echo
echo "| published run | published | planned before | planned after | gap after |"
echo "|---|---|---|---|---|"
mfu() { sed -n 's/^  step .*MFU \([0-9.]*\)%.*/\1/p' <<<"$1"; }
# GPU-hours: 14.8T tokens in steps of 62,914,560 tokens, each the plan's step on 2,048 GPUs.
hours() { awk -v t="$(sed -n 's/^  step \([0-9.]*\) s:.*/\1/p' <<<"$1")" 'BEGIN{printf "%.2fM", 14.8e12 / 62914560 * t * 2048 / 3600 / 1e6}'; }
llama="--preset 405b --global-batch-tokens 16777216 --tp 8 --pp 16 --zero 1 --micro-batch 1 --schedule interleaved --virtual-stages 4 --recompute selective"
while read -r gpus seq dp cp published name; do
  [ -z "$gpus" ] && continue
  args="--plan $llama --gpus $gpus --seq $seq --dp $dp --cp $cp ${PLAN_FLAGS:-}"
  b=$(mfu "$("$build/08_5d_mesh" $args)"); a=$(mfu "$("$build/08_5d_mesh" $args --frontier all)")
  echo "| $name | $published% MFU | $b% | $a% | $(awk -v a="$a" -v p="$published" 'BEGIN{printf "%+.0f%%", 100 * (a / p - 1)}') |"
done <<<"
8192 8192 64 1 43 Llama 3 405B, 8,192 H100, tp 8 pp 16 dp 64, seq 8K
16384 8192 128 1 41 the same on 16,384 H100, dp 128
16384 131072 8 16 38 16,384 H100, tp 8 cp 16 pp 16 dp 8, seq 128K
"
ds="--plan --preset deepseek-v3 --gpu h800 --gpus 2048 --dp 128 --pp 16 --tp 1 --ep 64 --global-batch-tokens 62914560 --dispatch two-level --rank-order pp-dp-cp-tp --zero 0 --micro-batch 1 --virtual-stages 1 ${PLAN_FLAGS:-}"
b=$(hours "$("$build/08_5d_mesh" $ds --dtype bf16 --recompute full)"); a=$(hours "$("$build/08_5d_mesh" $ds --dtype fp8 --recompute none --frontier all)")
echo "| DeepSeek-V3, 2,048 H800, pp 16 ep 64, 14.8T tokens | 2.664M GPU-hours | $b | $a | $(awk -v a="${a%M}" 'BEGIN{printf "%+.0f%%", 100 * (a / 2.664 - 1)}') |"
