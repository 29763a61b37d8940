#!/usr/bin/env bash
# Every blocking MPI call of the programs goes through the watched wrappers of common/comm/comm.cu
# (watched_allreduce, watched_blocking, the Comm collectives, ...), so a rank that stalls inside
# one ends the job within --timeout instead of hanging it. This check fails on a raw blocking MPI
# call anywhere else in the programs' sources: the technique files, common/ and bench/. (The
# tests' own harness, catch_main.cpp and a few helpers that compare ranks, is not a program a user
# runs; the driver's timeout bounds it.)
set -u
cd "$(dirname "$0")/.."
# The blocking calls: collectives, communicator constructors, point-to-point, waits, start and end.
# (Their non-blocking forms MPI_I... do not match; MPI_Comm_rank/size, MPI_Comm_free and the
# MPI_Initialized/MPI_Finalized queries are local.)
blocking='MPI_(Allreduce|Reduce|Bcast|Barrier|Gatherv?|Allgatherv?|Scatterv?|Alltoall[vw]?|Reduce_scatter(_block)?|Scan|Exscan|Comm_split(_type)?|Comm_dup|Comm_create(_group)?|Intercomm_create|Send|Ssend|Bsend|Rsend|Recv|Sendrecv(_replace)?|Wait(all|any|some)?|Probe|Init(_thread)?|Finalize)[[:space:]]*\('
# Allowed, each for its reason:
#   common/comm/comm.cu           the wrappers themselves
#   bench/bench_kernels.cu   one process with no peers: its MPI_Init/MPI_Finalize cannot wait for anyone
#   common/comm/fake_world.cu     the fake world's MPI_Comm_split (passed on, or refused for a fake
#                                 group) and its PMPI_Comm_dup of MPI_COMM_SELF, which has no peer
#   common/comm/algorithms.cu     the two-level collectives' MPI_Comm_split_type, called inside
#                                 watched_blocking (the line before it)
allowed='^(common/comm/comm\.cu|bench/bench_kernels\.cu|common/comm/fake_world\.cu):|^common/comm/algorithms\.cu:[0-9]+:.*(watched_blocking\(|MPI_CHECK\(MPI_Comm_split_type)'
files=$(ls 0[1-8]_*.cu common/*/*.cu common/*/*.h bench/*.cu | grep -v '^common/emu/')
hits=$(grep -nE "$blocking" $files | grep -vE "$allowed")
if [ -n "$hits" ]; then
  echo "raw blocking MPI calls outside common/comm/comm.cu (use its watched wrappers):"
  echo "$hits"
  exit 1
fi
echo "no raw blocking MPI call outside common/comm/comm.cu in $(echo "$files" | wc -l) files"
