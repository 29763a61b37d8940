#!/usr/bin/env bash
# What of the CUDA code the emulated GPU executed: kernels, launch sites, and the cuBLAS, cuBLASLt
# and NCCL calls the project makes, each out of how many the sources hold. FILE is what the
# binaries wrote with TS_EMU_COVERAGE=FILE (common/emu/runtime.cu: one line per thing that ran,
# "kernel NAME FILE:LINE", "cublas CALL", "nccl CALL"); tests/run_tests.sh passes it after the suite.
# Prints the three lines, then every kernel, site and call that never ran (none is the goal).
set -euo pipefail
cd "$(dirname "$0")/.."
cov=${1:?usage: scripts/emu_coverage.sh COVERAGE_FILE}
[ -s "$cov" ] || { echo "emulated GPU coverage: $cov is empty: nothing ran on the emulated GPU"; exit 1; }
src=$(ls common/*/*.cu 0[1-8]_*.cu | grep -v '^common/emu/')
# Kernels: every __global__ function's name (the qualifiers may run over two lines).
defined=$(perl -0ne 'while (/__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(/g) { print "$1\n" }' $src | sort -u)
ran=$(sed -n 's/^kernel \([A-Za-z_:0-9]*\).*/\1/p' "$cov" | sed 's/.*:://' | sort -u)
# Launch sites: each TS_LAUNCH outside a macro definition, and each use of a launch macro (moe.cu).
sites=$( (grep -n 'TS_LAUNCH(' $src | grep -v '#define\|\\$' | cut -d: -f1,2; grep -n 'MOE_LAUNCH(' $src | grep -v '#define' | cut -d: -f1,2) | sort -u)
ran_sites=$(sed -n 's/^kernel .* \([^ ]*:[0-9]*\)$/\1/p' "$cov" | sort -u)
calls() { grep -oh "\b$1[A-Z][A-Za-z]*(" $src | tr -d '(' | sort -u; }
blas=$(calls cublas); nccl=$(calls nccl)
ran_blas=$(sed -n 's/^cublas //p' "$cov" | sort -u); ran_nccl=$(sed -n 's/^nccl //p' "$cov" | sort -u)
count() { [ -z "$1" ] && echo 0 || echo "$1" | wc -l; }
covered() { comm -12 <(echo "$1") <(echo "$2"); }
missing() { comm -23 <(echo "$1") <(echo "$2"); }
echo "emulated GPU ran $(count "$(covered "$defined" "$ran")") of $(count "$defined") kernels," \
  "$(count "$(covered "$sites" "$ran_sites")") of $(count "$sites") launch sites," \
  "$(count "$(covered "$blas" "$ran_blas")") of $(count "$blas") cuBLAS/cuBLASLt calls," \
  "$(count "$(covered "$nccl" "$ran_nccl")") of $(count "$nccl") NCCL calls"
for what in "kernel:$(missing "$defined" "$ran")" "launch site:$(missing "$sites" "$ran_sites")" \
            "cuBLAS call:$(missing "$blas" "$ran_blas")" "NCCL call:$(missing "$nccl" "$ran_nccl")"; do
  kind=${what%%:*}; list=${what#*:}
  [ -n "$list" ] && echo "$list" | sed "s/^/  never ran ($kind): /"
done
exit 0
