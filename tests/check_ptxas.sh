#!/usr/bin/env bash
# make ptxas's arithmetic and parser (scripts/ptxas_table.py): the occupancy calculator's rules for
# sm_90 on cases worked by hand, the table of a captured ptxas -v log of kernels_cuda.cu
# (tests/reference/ptxas_sm90.log, CUDA 13.0), a constructed log with spills, and, where nvcc
# exists, one real compile of a small kernel.
set -u
cd "$(dirname "$0")/.." || exit 1
py=/usr/bin/python3
t=scripts/ptxas_table.py
fail=0
expect() {  # expect WHAT EXPECTED ACTUAL
  if [ "$2" = "$3" ]; then echo "ok   $1"; else echo "FAIL $1: expected '$2', got '$3'"; fail=1; fi
}
# Registers: ceil(regs·32 / 256)·256 per warp, 16,384 per sub-partition, 4 sub-partitions.
#   256 threads, 32 regs: 1024 per warp, 16 warps per sub-partition, 64 warps = 8 blocks of 8: 100%.
expect "256 threads, 32 regs" "64/64 warps (100.0%), limited by regs/warps" "$($py $t --occupancy 256 32 0)"
#   256 threads, 64 regs: 2048 per warp, 8 per sub-partition, 32 warps = 4 blocks: 50%.
expect "256 threads, 64 regs" "32/64 warps (50.0%), limited by regs" "$($py $t --occupancy 256 64 0)"
#   128 threads, 168 regs: 5376 per warp, 3 per sub-partition, 12 warps = 3 blocks of 4: 18.75%.
expect "128 threads, 168 regs" "12/64 warps (18.8%), limited by regs" "$($py $t --occupancy 128 168 0)"
#   128 threads, 32 regs, 50,000 B: (50,000 + 1,024 reserved) rounded to 128 B = 51,072; 233,472 / 51,072 = 4 blocks.
expect "shared-memory limited" "16/64 warps (25.0%), limited by smem" "$($py $t --occupancy 128 32 50000)"
#   32 threads, 16 regs: 32 blocks per SM at most, 32 warps.
expect "block-count limited" "32/64 warps (50.0%), limited by blocks" "$($py $t --occupancy 32 16 0)"
# Bad input: a clear error and a non-zero exit.
if out=$($py $t --occupancy 128 300 0 2>&1); then expect "300 registers refused" "exit != 0" "exit 0"
else expect "300 registers refused" "ptxas_table: 300 registers per thread: must be 0..255" "$out"; fi

# The captured log: names demangled, the launch read from the source (128 threads from
# __launch_bounds__(kAttnThreads); 22,656 B = 4·(16·64 + 32·65 + 32·64 + 16·32) at hd 64).
table=$($py $t --log tests/reference/ptxas_sm90.log --source common/kernels/kernels_cuda.cu)
row() { grep -E "^$1 " <<<"$table" | tr -s ' '; }
expect "attention_forward row" "attention_forward_kernel<bf16, 2, 4> 64 0 0 0 128 22656 32/64 50% regs" \
  "$(row 'attention_forward_kernel<bf16, 2, 4>')"
expect "attention_dkv row" "attention_dkv_kernel<bf16, 2, 2> 56 0 0 0 128 22784 36/64 56% regs/smem" \
  "$(row 'attention_dkv_kernel<bf16, 2, 2>')"
expect "adamw row" "adamw_kernel<bf16> 37 0 0 0 256 0 48/64 75% regs" "$(row 'adamw_kernel<bf16>')"
expect "static smem row" "sum_squares_partial_kernel 29 0 0 256 256 0 64/64 100% regs/warps" \
  "$(row 'sum_squares_partial_kernel')"
expect "rows" "5" "$(grep -c '/64' <<<"$table")"

# A constructed log: spill bytes are the kernel's own line, not a device function's after it.
log=$(mktemp); trap 'rm -f "$log"' EXIT
cat >"$log" <<'LOG'
ptxas info    : Compiling entry function '_ZN2ts4cuda10add_kernelIfEEvPT_PKS2_S5_l' for 'sm_90'
ptxas info    : Function properties for _ZN2ts4cuda10add_kernelIfEEvPT_PKS2_S5_l
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 2048 bytes smem
ptxas info    : Function properties for helper
    0 bytes stack frame, 99 bytes spill stores, 99 bytes spill loads
LOG
expect "spills" "add_kernel<float> 255 12 16 2048 256 0 8/64 12% regs" \
  "$($py $t --log "$log" --source common/kernels/kernels_cuda.cu | grep '^add_kernel' | tr -s ' ')"

nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
if [ -n "$nvcc" ]; then
  # A real compile: make ptxas's path on the smallest device source of the project.
  # Every __global__ function of the source (read here, not by the script) must have a row with an
  # occupancy; templates add a row per instantiation, so there are at least as many rows.
  table=$($py $t --nvcc "$nvcc" --cflags "-Icommon -I/usr/include/x86_64-linux-gnu/mpich -DTS_CUDA --expt-relaxed-constexpr" \
          common/model/moe.cu)
  names=$(perl -0ne 'while (/__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(/g) { print "$1\n" }' \
          common/model/moe.cu | sort -u)
  missing=0
  for n in $names; do echo "$table" | grep -E "^(\w+::)*$n[< ].*/64" -q || missing=$((missing + 1)); done
  rows=$(echo "$table" | grep -c '/64')
  expect "nvcc: each of moe.cu's kernels has a row" "0 missing, rows >= $(echo "$names" | wc -l)" \
    "$missing missing, rows >= $([ "$rows" -ge "$(echo "$names" | wc -l)" ] && echo "$(echo "$names" | wc -l)" || echo "$rows")"
  nv="with nvcc"
else
  echo "SKIPPED the nvcc part: no nvcc on this machine (the parser ran on the captured log)"
  nv="nvcc part SKIPPED (no nvcc)"
fi
[ $fail = 0 ] && echo "ptxas table: occupancy rules, parser and launch configurations checked, $nv"
exit $fail
