// ranks: 1
// Races by happens-before: the emulated GPU's ThreadSanitizer build (make CUDA=emu SANITIZE=thread
// BUILD=build-tsan; common/emu/tsan.h, notes/emulated_gpu.md "Races") runs the kernel twins and a
// small run of every chapter on --device cuda without a report, and reports each seeded race — a
// removed __syncthreads, an ownership slip that makes two threads += one gradient row, a removed
// event wait on the communication stream — naming the kernel and the source line, and the run
// fails (exit status 66, the build's TSan setting). This binary is built in the emulated GPU's
// build and drives the TSan build's binaries (TS_TSAN_BUILD, default build-tsan), which make test
// builds first.
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <unistd.h>

#include <string>
#include <vector>

#include "test_util.h"

namespace {

std::string tsan_dir() {
  const char* d = getenv("TS_TSAN_BUILD");
  return d && *d ? d : "build-tsan";
}

// One OpenMP and one OpenBLAS thread: neither library is instrumented, so their own threads'
// ordering is invisible to TSan (run() sets OMP_NUM_THREADS=1 already). UCX_MEM_EVENTS=no: UCX's
// madvise hook faults under TSan when a thread exits (common/emu/tsan.cu).
tst::Result run_tsan(const std::string& bin, const std::string& args, int np = 1, int timeout_s = 300) {
  const std::string exe = tsan_dir() + "/" + bin;
  INFO("the TSan build: make CUDA=emu SANITIZE=thread BUILD=" << tsan_dir() << " " << exe);
  REQUIRE(access(exe.c_str(), X_OK) == 0);
  const std::string env = "env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u PMI_PORT -u PMI_ID -u PMI_HOSTNAME -u MPI_LOCALRANKID "
                          "-u MPI_LOCALNRANKS -u PMIX_RANK -u PMI_SPAWNED -u PMI_APPNUM -u TS_EMU_COVERAGE "
                          "OPENBLAS_NUM_THREADS=1 UCX_MEM_EVENTS=no TS_EMU_GPUS=8 ";
  return tst::run(env + (np > 1 ? "mpirun -np " + std::to_string(np) + " " : "") + exe + " " + args, timeout_s);
}

bool has(const tst::Result& r, const std::string& s) { return r.output.find(s) != std::string::npos; }
// A seeded bug's run: it announced itself and TSan reported a race.
void race_reported(const tst::Result& r, const std::string& bug) {
  CHECK(has(r, "runs the deliberate bug " + bug));
  CHECK(has(r, "WARNING: ThreadSanitizer: data race"));
}

const std::string kSmall = "--preset tiny --quiet --steps 1 --batch 2 --seq 16 --device cuda ";

}  // namespace

TEST_CASE("TSan build: the kernel twins run without a race report", "[emu][cuda][tsan]") {
  // The attention twin's many shapes take minutes under TSan; the chapters' runs below cover its kernels.
  const tst::Result r = run_tsan("tests/test_kernels", "\"[cuda]\" \"~cuda twin: attention\"", 1, 600);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(!has(r, "ThreadSanitizer"));
  CHECK(has(r, "All tests passed"));
}

TEST_CASE("TSan build: a small run of every chapter on the emulated GPU has no race report", "[emu][cuda][tsan]") {
  struct Run {
    std::string bin, args;
    int np;
  };
  const std::vector<Run> runs = {
      {"01_single_gpu", "", 1},
      {"02_data_parallel", "--dp 2", 2},
      {"03_zero", "--dp 2 --zero 3", 2},
      {"04_tensor_parallel", "--tp 2 --sequence-parallel", 2},
      {"05_pipeline_parallel", "--pp 2 --micro-batch 1 --schedule 1f1b", 2},
      {"06_context_parallel", "--cp 2 --cp-mode ring --zigzag 1", 2},
      {"07_expert_parallel", "--experts 4 --ffn 64 --top-k 2 --dp 2 --ep 2", 2},
      {"08_5d_mesh", "--dp 1 --tp 2 --zero 3 --prefetch 1", 2},
  };
  for (const Run& c : runs) {
    const tst::Result r = run_tsan(c.bin, kSmall + c.args, c.np, 600);
    INFO(c.bin << " " << c.args << "\n" << r.output);
    CHECK(r.status == 0);
    CHECK(!has(r, "ThreadSanitizer"));
  }
}

TEST_CASE("TSan build: seeded races are reported with their kernel and line, and the run fails", "[emu][cuda][tsan]") {
  SECTION("a removed __syncthreads in block_sum") {
    const tst::Result r = run_tsan("tests/bugs/01_single_gpu+emu_missing_barrier", kSmall);
    INFO(r.output);
    CHECK(r.status == 66);
    race_reported(r, "emu_missing_barrier");
    CHECK(has(r, "ts::cuda::block_sum<double>(double, double*) common/kernels/kernels_cuda.cu:"));
    CHECK(has(r, "cross_entropy_kernel"));  // the kernel whose block_sum lost its barrier, in both stacks
  }
  SECTION("two blocks += one row of the embedding's gradient") {
    const tst::Result r = run_tsan("tests/bugs/01_single_gpu+emu_ownership_slip", kSmall);
    INFO(r.output);
    CHECK(r.status == 66);
    race_reported(r, "emu_ownership_slip");
    CHECK(has(r, "embedding_backward_kernel<float>(float*, float const*, int const*, long, long, long, long, long) "
                 "common/kernels/kernels_cuda.cu:"));
    CHECK(has(r, "'embedding_backward_kernel block (0,"));  // the fibers' names: block and thread
  }
  SECTION("a removed wait for the compute stream before comm.cu's NCCL call") {
    const tst::Result r = run_tsan("tests/bugs/02_data_parallel+emu_no_ready_wait", kSmall + "--dp 2", 2);
    INFO(r.output);
    CHECK(r.status != 0);
    race_reported(r, "emu_no_ready_wait");
    // The all-reduce's side, on its communicator's stream, and the compute stream's work it is no
    // longer ordered after (the first such access: the gradients' zeroing, a cudaMemsetAsync).
    CHECK(has(r, "'emulated stream running ncclAllReduce'"));
    CHECK(has(r, "declare_accesses common/emu/nccl.cu:"));
    CHECK(has(r, "'emulated stream running cudaMemsetAsync'"));
  }
}
#endif
