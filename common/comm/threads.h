// threads.h — how many CPU threads each rank runs: the node's cores shared among the ranks on
// it, never more threads than cores unless asked for, and idle OpenMP threads that spin only
// briefly before they sleep.
#pragma once
#include <string>

namespace ts {

// Before MPI_Init, unless the environment already says: idle OpenMP threads spin briefly, then
// sleep (OMP_WAIT_POLICY=passive with GOMP_SPINCOUNT=10000, which libgomp lets override it), and
// UCX (MPICH's transport) prints no backtrace of its own when a peer dies under it (the job's
// one-line error and mpirun's report of the lost rank are what a reader needs, last). libgomp
// and UCX read these once, when they are loaded, so setting them means re-executing the process
// with them (argv unchanged, same pid, before any MPI state exists).
// OpenBLAS reads OPENBLAS_CORETYPE the same way: when it has detected a core much older than this
// CPU, the re-executed process runs the kernels the CPU's instruction set supports instead.
void prepare_process_env(char** argv);
// "sgemm core SkylakeX" and where that choice came from; a warning line when this CPU supports a
// faster core than the one running ("" otherwise).
std::string sgemm_core_note();
std::string sgemm_core_warning();

struct ThreadChoice {
  int threads = 1;       // OpenMP threads per rank (the CPU kernels)
  int blas_threads = 1;  // OpenBLAS threads per rank (sgemm)
  int cores = 1;         // cores this node's ranks may run on
  int local_ranks = 1;   // ranks of the job on this node
  std::string source;    // "--threads", "OMP_NUM_THREADS", why a small micro-batch got 1, or "" (the cores)
};
// Collective over MPI_COMM_WORLD. OpenMP: requested > 0 (--threads) wins, then OMP_NUM_THREADS,
// else max(1, cores / local ranks), or 1 when a micro-batch's residual stream (tokens × dim) has
// fewer than kThreadedElements elements: each parallel region then holds a few microseconds of
// work, less than waking a sleeping thread costs (tiny's default 256 × 64 runs faster on one
// thread; the demo's 1024 × 64 runs about as fast on two, now that matmuls split by panels).
// OpenBLAS: OPENBLAS_NUM_THREADS, else 1 — its sgemm splits the inner dimension into
// blocks that depend on its thread count, so more threads change the sums' rounding, while the
// CPU kernels (matmul panels included) give the same bits at any thread count.
constexpr int64_t kThreadedElements = 32768;
ThreadChoice setup_threads(int requested, int64_t microbatch_tokens, int64_t dim);
// What the last setup_threads chose (a default ThreadChoice before it ran): a measurement that
// assumes each rank has its cores (05's bubble) says when ranks outnumber them.
const ThreadChoice& thread_choice();
// "2 per rank (4 cores, 2 ranks on this node); OpenBLAS 1", plus where an explicit count came
// from and whether it oversubscribes the cores.
std::string describe(const ThreadChoice& t);

}  // namespace ts
