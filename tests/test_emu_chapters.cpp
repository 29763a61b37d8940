// ranks: 1
// Every chapter on --device cuda under the emulated GPU against the same run on --device cpu
// (make CUDA=emu): the CUDA kernels, cuBLAS, cuBLASLt and NCCL calls run for real, in the
// emulator, and must reproduce the CPU reference by the criterion every technique meets
// (tests/test_util.h; notes/00 derives why it holds for CUDA against the CPU too: both sides only
// sum in other orders). Meshes at 2 and 4 ranks with an emulated GPU each (NCCL's path), and at 2
// ranks sharing one (TS_EMU_GPUS=1: the staged MPI path); fp32, bf16 and FP8 tensorwise.
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant --steps 3 --batch 8 ";
const std::string kOwnGpus = "TS_EMU_GPUS=8", kSharedGpu = "TS_EMU_GPUS=1";

struct Case {
  std::string bin;
  int np;
  std::string args;
  std::string env;  // kOwnGpus or kSharedGpu
  std::string transport;  // what the CUDA run's communicators must use ("" at one rank)
};

void check_case(const Case& c) {
  const tst::CachedRun& cpu = tst::cached_run(c.bin, c.np, kTiny + c.args + " --device cpu", 600, c.env);
  const tst::CachedRun& gpu = tst::cached_run(c.bin, c.np, kTiny + c.args + " --device cuda", 600, c.env);
  INFO(c.bin << " np " << c.np << " " << c.args << " " << c.env << "\n" << gpu.output);
  if (!c.transport.empty()) CHECK(gpu.output.find(c.transport) != std::string::npos);
  // The CUDA run rounds its bf16 and FP8 values independently of the CPU's once a reordered fp32
  // sum crosses a rounding boundary: the same situation, and bounds, as a mesh against 01.
  const bool bf16 = c.args.find("--dtype bf16") != std::string::npos, fp8 = c.args.find("--dtype fp8") != std::string::npos;
  const std::string recipe = c.args.find("blockwise") != std::string::npos ? "blockwise" : "tensorwise";
  const tst::Bounds b = bf16 ? tst::bf16_bounds(8 * 32) : fp8 ? tst::fp8_bounds(recipe, 8 * 32) : tst::kFp32Bounds;
  tst::check_equivalent(gpu, cpu, b);
  // TS_EMU_REPORT=FILE: each case's worst measure against its bound (notes/00 quotes the largest).
  if (const char* f = getenv("TS_EMU_REPORT")) {
    std::ofstream o(f, std::ios::app);
    o << tst::worst_ratio(tst::compare(gpu, cpu), b) << "  " << c.bin << " np " << c.np << " " << c.args << " " << c.env << "\n";
  }
}

}  // namespace

TEST_CASE("emulated GPU: 01 on CUDA reproduces 01 on the CPU, fp32 and bf16", "[emu][cuda][01]") {
  check_case({"01_single_gpu", 1, "", kOwnGpus, ""});
  check_case({"01_single_gpu", 1, "--dtype bf16", kOwnGpus, ""});
}

TEST_CASE("emulated GPU: 02 data parallel on NCCL (a GPU per rank) and staged (two ranks on one)", "[emu][cuda][02]") {
  check_case({"02_data_parallel", 2, "--dp 2", kOwnGpus, "nccl"});
  check_case({"02_data_parallel", 2, "--dp 2", kSharedGpu, "mpi-staged"});
  check_case({"02_data_parallel", 4, "--dp 4 --micro-batch 1", kOwnGpus, "nccl"});
  check_case({"02_data_parallel", 2, "--dp 2 --dtype bf16", kOwnGpus, "nccl"});  // NCCL's bf16 sums
}

TEST_CASE("emulated GPU: 03 ZeRO-1, ZeRO-3 and HSDP on NCCL", "[emu][cuda][03]") {
  check_case({"03_zero", 2, "--dp 2 --zero 1", kOwnGpus, "nccl"});
  check_case({"03_zero", 2, "--dp 2 --zero 3", kOwnGpus, "nccl"});
  check_case({"03_zero", 4, "--dp 4 --zero 3 --dp-shard 2 --micro-batch 1", kOwnGpus, "nccl"});  // HSDP's split groups
}

TEST_CASE("emulated GPU: 04 tensor parallel with sequence parallel, on NCCL and staged", "[emu][cuda][04]") {
  check_case({"04_tensor_parallel", 2, "--tp 2 --sequence-parallel", kOwnGpus, "nccl"});
  check_case({"04_tensor_parallel", 2, "--tp 2 --sequence-parallel", kSharedGpu, "mpi-staged"});
  check_case({"04_tensor_parallel", 2, "--tp 2 --dtype bf16", kOwnGpus, "nccl"});
}

TEST_CASE("emulated GPU: 05 pipelines (1F1B, interleaved, ZB-H1) on NCCL", "[emu][cuda][05]") {
  check_case({"05_pipeline_parallel", 2, "--pp 2 --layers 4 --micro-batch 2 --schedule 1f1b", kOwnGpus, "nccl"});
  check_case({"05_pipeline_parallel", 2, "--pp 2 --layers 4 --micro-batch 2 --schedule interleaved --virtual-stages 2",
              kOwnGpus, "nccl"});
  check_case({"05_pipeline_parallel", 2, "--pp 2 --layers 4 --micro-batch 2 --schedule zb-h1", kOwnGpus, "nccl"});
  check_case({"05_pipeline_parallel", 4, "--pp 4 --layers 8 --micro-batch 2 --schedule interleaved --virtual-stages 2",
              kOwnGpus, "nccl"});
}

TEST_CASE("emulated GPU: 06 ring attention (zigzag) and Ulysses on NCCL", "[emu][cuda][06]") {
  check_case({"06_context_parallel", 2, "--cp 2 --cp-mode ring --zigzag 1", kOwnGpus, "nccl"});
  check_case({"06_context_parallel", 2, "--cp 2 --cp-mode ulysses", kOwnGpus, "nccl"});
}

// At head dim 64 in bf16 (--dim 128 --heads 2) attention takes its second rung, FlashAttention-2 on
// the tensor cores (common/kernels/attention_v2.cu; the first rung, on the CUDA cores, serves the
// other cases here). 01 on it reproduces 01 on the CPU, and so do 06's ring (zigzag) and Ulysses,
// whose partial attentions v2 computes and 06 merges by their log-sum-exp. Each CUDA run records
// the kernels it ran, so the test knows v2 ran.
TEST_CASE("emulated GPU: 01, 06 ring and 06 Ulysses on attention v2 (tensor cores) reproduce 01 on the CPU",
          "[emu][cuda][06]") {
  const std::string v2 = "--dtype bf16 --dim 128 --heads 2 --kv-heads 2 ";
  const tst::CachedRun& ref = tst::cached_run("01_single_gpu", 1, kTiny + v2 + "--device cpu", 600, kOwnGpus);
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"01_single_gpu", ""}, {"06_context_parallel", "--cp 2 --cp-mode ring --zigzag 1 "},
      {"06_context_parallel", "--cp 2 --cp-mode ulysses "}};
  for (size_t n = 0; n < runs.size(); n++) {
    const std::string coverage = tst::scratch("attention_v2_" + std::to_string(n) + ".txt");
    const int np = n == 0 ? 1 : 2;
    const tst::CachedRun& gpu = tst::cached_run(runs[n].first, np, kTiny + v2 + runs[n].second + "--device cuda", 600,
                                                kOwnGpus + " TS_EMU_COVERAGE=" + coverage);
    INFO(runs[n].first << " " << runs[n].second << "\n" << gpu.output);
    std::ifstream f(coverage);
    const std::string ran((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    for (const char* k : {"flash_v2_forward_kernel", "flash_v2_dq_kernel", "flash_v2_dkv_kernel"})
      CHECK(ran.find(k) != std::string::npos);
    tst::check_equivalent(gpu, ref, tst::bf16_bounds(8 * 32));
  }
}

TEST_CASE("emulated GPU: 07 expert parallel on NCCL", "[emu][cuda][07]") {
  check_case({"07_expert_parallel", 2, "--experts 4 --ffn 64 --top-k 2 --dp 2 --ep 2", kOwnGpus, "nccl"});
}

TEST_CASE("emulated GPU: 08 ZeRO-3 with prefetch beside TP and CP, on NCCL", "[emu][cuda][08]") {
  check_case({"08_5d_mesh", 4, "--dp 2 --tp 2 --zero 3 --prefetch 1", kOwnGpus, "nccl"});
  check_case({"08_5d_mesh", 4, "--dp 1 --tp 2 --cp 2", kOwnGpus, "nccl"});
  check_case({"08_5d_mesh", 8, "--dp 2 --tp 2 --cp 2 --zero 3 --prefetch 1", kOwnGpus, "nccl"});
}

TEST_CASE("emulated GPU: FP8 (tensorwise through cuBLASLt, delayed, blockwise) reproduces the CPU's FP8", "[emu][cuda][fp8]") {
  check_case({"01_single_gpu", 1, "--dtype fp8 --fp8-recipe tensorwise", kOwnGpus, ""});
  // At dim 48 the weight gradients' views into the flat buffer are 64-byte aligned, short of the
  // 256 bytes cuBLASLt's preference assumes unless told (fp8_cublaslt.cu: promise_alignment).
  check_case({"01_single_gpu", 1, "--dtype fp8 --fp8-recipe tensorwise --dim 48", kOwnGpus, ""});
  // Delayed scaling's amax history and blockwise's per-tile scales, on the decode path's kernels.
  check_case({"01_single_gpu", 1, "--dtype fp8 --fp8-recipe delayed", kOwnGpus, ""});
  check_case({"01_single_gpu", 1, "--dtype fp8 --fp8-recipe blockwise --fp8-tile 16", kOwnGpus, ""});
  // Hopper's narrow FP8 accumulator, modelled by the same scalar loop on both devices.
  check_case({"01_single_gpu", 1, "--dtype fp8 --fp8-recipe tensorwise --fp8-accum-bits 14 --fp8-promote-every 128",
              kOwnGpus, ""});
}

#endif

#ifdef TS_CUDA_EMU
// A missing barrier or a race between a block's threads gives results that depend on the order
// the threads run in; the emulator can run every block's threads (and a grid's blocks) the other
// way round, and a correct run gives the same bits both ways.
// Every kernel the chapters launch runs here: 01's in fp32, bf16 and FP8 (quantization, amax),
// 04's vocabulary-parallel cross-entropy, 06's attention merge and Ulysses packing, 07's router,
// gather and combine.
namespace {
// Each case run twice, the second time with `env2` added: the same losses and weights, bit for bit.
void check_same_bits(const std::vector<Case>& cases, const std::string& env2) {
  for (const Case& c : cases) {
    INFO(c.bin << " " << c.args << " against " << env2);
    const std::string args = kTiny + c.args + " --device cuda";
    const tst::CachedRun& one = tst::cached_run(c.bin, c.np, args, 600, c.env);
    const tst::CachedRun& two = tst::cached_run(c.bin, c.np, args, 600, c.env + " " + env2);
    CHECK(one.log.losses() == two.log.losses());
    CHECK(tst::max_abs_diff_files(one.ckpt + "/model.safetensors", two.ckpt + "/model.safetensors") == 0);
  }
}
const std::vector<Case> kEveryKernel = {
    {"01_single_gpu", 1, "--dtype fp32", kOwnGpus, ""},
    {"01_single_gpu", 1, "--dtype bf16", kOwnGpus, ""},
    {"01_single_gpu", 1, "--dtype fp8 --fp8-recipe blockwise --fp8-tile 16", kOwnGpus, ""},
    {"04_tensor_parallel", 2, "--tp 2 --sequence-parallel", kOwnGpus, ""},
    {"06_context_parallel", 2, "--cp 2 --cp-mode ring --zigzag 1", kOwnGpus, ""},
    {"06_context_parallel", 2, "--cp 2 --cp-mode ulysses", kOwnGpus, ""},
    {"07_expert_parallel", 2, "--experts 4 --ffn 64 --top-k 2 --dp 2 --ep 2", kOwnGpus, ""},
};
}  // namespace

TEST_CASE("emulated GPU: the chapters on CUDA give the same bits with every block's threads run in reverse",
          "[emu][cuda]") {
  check_same_bits(kEveryKernel, "TS_EMU_ORDER=reverse");
}

// initcheck by two poisons: device memory (fresh and recycled by the caching allocator), shared
// memory and pinned host memory start as 0xFF bytes (NaN; -1 as an int) or, under
// TS_EMU_POISON=big, 0x7F bytes (3.39e38, which fmaxf keeps; 2139062143 as an int). A run that
// reads nothing unwritten cannot tell them apart: the same bits. Every kernel the chapters launch
// (the cases above), attention v2, the staged MPI path and ZeRO-3's gathers.
TEST_CASE("emulated GPU: the chapters read no memory they did not write (the same bits under both poisons)",
          "[emu][cuda]") {
  std::vector<Case> cases = kEveryKernel;
  cases.push_back({"01_single_gpu", 1, "--dtype bf16 --dim 128 --heads 2 --kv-heads 2", kOwnGpus, ""});
  cases.push_back({"02_data_parallel", 2, "--dp 2", kSharedGpu, ""});  // pinned staging through host memory
  cases.push_back({"03_zero", 2, "--dp 2 --zero 3", kOwnGpus, ""});
  check_same_bits(cases, "TS_EMU_POISON=big");
}

// Seeded defects in the project's own code (tests/bugs/emu_*.cpp, linked into a chapter's binary):
// each is caught with a report naming the kernel and its launch site, and the run fails.
TEST_CASE("emulated GPU: seeded defects are reported with their kernel and the run fails", "[emu][cuda][01]") {
  const tst::Result r = tst::run_bin("tests/bugs/01_single_gpu+emu_host_pointer", kTiny + "--device cuda", 1, 120, kOwnGpus);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.output.find("runs the deliberate bug emu_host_pointer") != std::string::npos);
  CHECK(r.output.find("emulated GPU: kernel embedding_backward_kernel (launched at common/kernels/kernels_cuda.cu:") !=
        std::string::npos);
  CHECK(r.output.find("argument 2 is 0x") != std::string::npos);
}

// The device's memory is a setting (TS_EMU_MEMORY_GB), so both out-of-memory paths run: a run
// whose prediction does not fit stops before it starts; one whose prediction fits but whose
// unpredicted workspace does not dies in the allocator, with the breakdown by category.
TEST_CASE("emulated GPU: out of device memory, predicted and unpredicted", "[emu][cuda][01]") {
  const std::string args = kTiny + "--device cuda";
  tst::Result tiny = tst::run_bin("01_single_gpu", args, 1, 120, "TS_EMU_MEMORY_GB=0.001");
  INFO(tiny.output);
  CHECK(tiny.status != 0);
  CHECK(tiny.output.find("this rank's GPU has") != std::string::npos);
  CHECK(tiny.output.find("cudaMemGetInfo") != std::string::npos);
  // The tiny preset predicts 4.02 MiB and peaks at 4.30 MiB with its workspace: 4.19 MiB fits
  // the one and not the other.
  tst::Result tight = tst::run_bin("01_single_gpu", args, 1, 120, "TS_EMU_MEMORY_GB=0.004");
  INFO(tight.output);
  CHECK(tight.status != 0);
  CHECK(tight.output.find("out of CUDA memory allocating") != std::string::npos);
  CHECK(tight.output.find("activations") != std::string::npos);
}
#endif
