// threads.cu — threads per rank from the cores and the ranks on this node.
#include "comm/threads.h"

#include <cblas.h>
#include <cpuid.h>
#include <mpi.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "tensor/core.h"
#include "comm/comm.h"
#include "comm/watchdog.h"

namespace ts {

// Cores OpenBLAS names when its detection does not know the CPU (Debian's 0.3.21 takes an AVX-512
// Xeon newer than it for a "Prescott" from 2004 and runs sgemm on SSE3: 3-7× slower here).
static bool is_old_core(const std::string& core) {
  for (const char* o : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai", "Northwood", "Banias"})
    if (core == o) return true;
  return false;
}

// AMD's Zen 4 (family 19h with AVX-512) executes a 512-bit instruction as two 256-bit halves: the
// same FMA rate as AVX2, and there OpenBLAS's AVX2 sgemm kernels (Haswell) beat its AVX-512 ones
// (SkylakeX, and Cooperlake, which 0.3.21 detects). Measured on a Zen 4 EPYC: the bench step's
// GEMMs alone 107.6 against 101.6 GFLOP/s, 01's step +3% at one thread and +7% at two.
static bool is_zen4() {
  unsigned a, b, c, d;
  if (!__builtin_cpu_is("amd") || !__builtin_cpu_supports("avx512f") || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned base = (a >> 8) & 0xf, family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
  return family == 0x19;
}

// The fastest sgemm kernel family for this CPU that Debian's OpenBLAS ships: by instruction set,
// except on Zen 4.
static const char* best_core() {
  if (is_zen4()) return "Haswell";
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

// What the start-up line says of sgemm's kernels. TS_OPENBLAS_DETECTED is the mark
// prepare_process_env leaves when it replaced a misdetected core.
std::string sgemm_core_note() {
  const std::string core = openblas_get_corename();
  if (const char* detected = getenv("TS_OPENBLAS_DETECTED"))
    return "sgemm core " + core + " (OpenBLAS detected " + detected +
           (is_old_core(detected) ? ", older than this CPU)" : "; on Zen 4 Haswell's AVX2 kernels are faster)");
  return "sgemm core " + core + (getenv("OPENBLAS_CORETYPE") ? " (OPENBLAS_CORETYPE)" : "");
}

std::string sgemm_core_warning() {
  const std::string core = openblas_get_corename();
  const char* best = best_core();
  // Haswell's AVX2 kernels on an AVX-512 machine run at about half of SkylakeX's rate. Cooperlake
  // and SapphireRapids are SkylakeX's sgemm with bf16 kernels beside it: no slower. On Zen 4 the
  // AVX-512 cores are a few percent slower than Haswell's, too little to warn of.
  const bool avx512_core = core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
  const bool slower = is_old_core(core) || (best && std::string(best) == "SkylakeX" && !avx512_core) ||
                      (is_zen4() && !avx512_core && core != "Haswell" && core != "Zen");
  if (!best || core == best || !slower) return "";
  return "warning: OpenBLAS runs sgemm with its " + core + " kernels; this CPU supports the faster " + best +
         " ones (OPENBLAS_CORETYPE=" + best + ")";
}

void prepare_process_env(char** argv) {
  // A misdetected core is replaced by the one the instruction set supports, and on Zen 4 an AVX-512
  // core by Haswell's, unless the user chose one: rounding differs between kernels, but every result
  // in this project is checked against a bound that holds for any of them (notes/00, "What equal to
  // 01 means").
  const char* best = best_core();
  const std::string detected = openblas_get_corename();
  const bool fix_core =
      !getenv("OPENBLAS_CORETYPE") && best && (is_old_core(detected) || (is_zen4() && detected != best));
  const bool wait_set = getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT");
  if (!fix_core && wait_set && getenv("UCX_HANDLE_ERRORS")) return;
  if (fix_core) {
    setenv("OPENBLAS_CORETYPE", best, 1);
    setenv("TS_OPENBLAS_DETECTED", detected.c_str(), 1);
  }
  // An idle OpenMP thread spins for kSpinCount pauses (some tens of microseconds), then sleeps.
  // The spin covers the gap between one op's parallel region and the next: waking a sleeping
  // thread costs about as much (a futex and, on a virtual machine, an interrupt to another vCPU),
  // and a step runs hundreds of regions (at the bench shape in bf16, passive waiting cost a
  // two-thread step 10%). The sleep gives the cores back during MPI waits and to OpenBLAS's own
  // threads when OPENBLAS_NUM_THREADS asks for them. libgomp's own default spins 30 times longer.
  constexpr const char* kSpinCount = "10000";
  if (!wait_set) setenv("OMP_WAIT_POLICY", "passive", 1), setenv("GOMP_SPINCOUNT", kSpinCount, 1);
  setenv("UCX_HANDLE_ERRORS", "none", 0);
  execv("/proc/self/exe", argv);
  // Without /proc the run continues with spinning threads: slower on a busy machine, same results.
}

// A CPU quota (cgroup v2 cpu.max "quota period", as containers set with --cpus) caps the cores
// below what the affinity mask shows.
static int cgroup_cpu_limit() {
  std::ifstream f("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (!(f >> quota >> period) || quota == "max" || period <= 0) return 0;
  return std::max(1, int(std::ceil(std::atof(quota.c_str()) / period)));
}

// A positive integer from the start of a thread-count variable's value ("4", or OpenMP's nested
// list "4,2"); 0 if unset (null) or invalid.
static int env_threads(const char* value) { return value ? std::max(0, atoi(value)) : 0; }

static ThreadChoice g_choice;
const ThreadChoice& thread_choice() { return g_choice; }

ThreadChoice setup_threads(int requested, int64_t microbatch_tokens, int64_t dim) {
  ThreadChoice& t = g_choice;
  t = ThreadChoice();
  MPI_Comm node = node_comm("the threads per rank");
  MPI_Comm_size(node, &t.local_ranks);
  // The cores of the node's ranks are the union of their affinity masks: ranks bound to their own
  // cores by the launcher share nothing, unbound ranks share all of them.
  cpu_set_t own, all;
  CPU_ZERO(&own);
  const bool have_mask = sched_getaffinity(0, sizeof own, &own) == 0;
  watched_allreduce(&own, &all, int(sizeof own), MPI_BYTE, MPI_BOR, node, "all_reduce (the node's cores)");
  MPI_Comm_free(&node);
  const int own_cores = have_mask ? CPU_COUNT(&own) : int(std::thread::hardware_concurrency());
  t.cores = have_mask ? CPU_COUNT(&all) : own_cores;
  if (int limit = cgroup_cpu_limit(); limit > 0) t.cores = std::min(t.cores, limit);
  t.cores = std::max(1, t.cores);
  if (requested > 0) {
    t.threads = requested;
    t.source = "--threads";
  } else if (env_threads(getenv("OMP_NUM_THREADS")) > 0) {
    t.threads = env_threads(getenv("OMP_NUM_THREADS"));
    t.source = "OMP_NUM_THREADS";
  } else {
    t.threads = std::max(1, std::min(own_cores, t.cores / t.local_ranks));
    if (t.threads > 1 && microbatch_tokens * dim < kThreadedElements) {
      t.threads = 1;
      t.source = "a micro-batch of " + std::to_string(microbatch_tokens) + " tokens × dim " + std::to_string(dim) +
                 " is too small to share";
    }
  }
  t.blas_threads = std::max(1, env_threads(getenv("OPENBLAS_NUM_THREADS")));
  omp_set_num_threads(t.threads);
  openblas_set_num_threads(t.blas_threads);
  return t;
}

std::string describe(const ThreadChoice& t) {
  char buf[320];
  snprintf(buf, sizeof buf, "%d per rank (%s%d cores, %d rank%s on this node)", t.threads,
           t.source.empty() ? "" : (t.source + "; ").c_str(), t.cores, t.local_ranks, t.local_ranks == 1 ? "" : "s");
  std::string s = buf;
  // More ranks than cores is the launch's choice; more threads than a rank's share is this one's.
  const int busiest = std::max(t.threads, t.blas_threads);
  if (busiest > 1 && busiest * t.local_ranks > t.cores)
    s += ", oversubscribed: " + std::to_string(busiest * t.local_ranks) + " threads on " + std::to_string(t.cores) +
         " cores";
  s += "; OpenBLAS " + std::to_string(t.blas_threads);
  if (t.blas_threads > 1) s += " (OPENBLAS_NUM_THREADS: sgemm's rounding depends on it)";
  return s;
}

}  // namespace ts
