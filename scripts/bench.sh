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
  ours=$(OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t "$BUILD/01_single_gpu" $shape --steps 16 --quiet --device cpu \
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

"$(dirname "$0")/bench_plan.sh"  # predict, then measure: each run's predicted step time against its own
