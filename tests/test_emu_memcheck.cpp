// ranks: 1
// initcheck and memcheck as reports (common/emu/shadow.h; notes/emulated_gpu.md): the memcheck
// build ($(BUILD)/memcheck/, `make CUDA=emu SANITIZE=memory`, which make test builds under the
// emulated GPU) compiles the kernels' code with g++'s kernel-address instrumentation, so every
// load and store of a kernel consults the emulator's shadow. The kernel twins and one chapter per
// technique run there with no report; each seeded defect (tests/bugs/memcheck_*.cpp, in 01) is
// reported with the kernel and the source line that made the access, and the run fails.
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant --steps 2 --batch 8 ";
const std::string kOwnGpus = "TS_EMU_GPUS=8";

size_t reports(const std::string& out) {
  size_t n = 0;
  for (size_t p = out.find("emulated GPU:"); p != std::string::npos; p = out.find("emulated GPU:", p + 1)) n++;
  return n;
}

// The line of `file` that holds `text`, first after the line that holds `after`: where a report
// must point, found in the source rather than written down.
int line_of(const std::string& file, const std::string& after, const std::string& text) {
  std::ifstream f(file);
  std::string s;
  bool past = after.empty();
  for (int n = 1; std::getline(f, s); n++) {
    past = past || s.find(after) != std::string::npos;
    if (past && s.find(text) != std::string::npos) return n;
  }
  return -1;
}

}  // namespace

TEST_CASE("memcheck build: the kernel twins run with no initcheck or memcheck report", "[emu][cuda]") {
  for (const char* t : {"test_kernels", "test_flash", "test_fp8", "test_moe", "test_attention_merge"}) {
    const tst::Result r = tst::run_bin(std::string("memcheck/tests/") + t, "'[cuda]'", 1, 300);
    INFO(t << "\n" << r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("All tests passed") != std::string::npos);
    CHECK(reports(r.output) == 0);
  }
}

// One run per technique (the shapes of test_emu_chapters), with NCCL between the ranks: clean, and
// 01's losses are the default build's bits (the instrumentation changes no arithmetic).
TEST_CASE("memcheck build: one chapter per technique runs with no report", "[emu][cuda]") {
  struct Run {
    const char* bin;
    int np;
    std::string args;
  };
  const std::vector<Run> runs = {
      {"01_single_gpu", 1, ""},
      {"01_single_gpu", 1, "--dtype bf16 --dim 128 --heads 2 --kv-heads 2"},  // attention v2: tensor cores, Chunk tiles
      {"02_data_parallel", 2, "--dp 2"},
      {"03_zero", 2, "--dp 2 --zero 3"},
      {"04_tensor_parallel", 2, "--tp 2 --sequence-parallel"},
      {"05_pipeline_parallel", 2, "--pp 2 --layers 4 --micro-batch 2 --schedule 1f1b"},
      {"06_context_parallel", 2, "--cp 2 --cp-mode ring --zigzag 1"},
      {"07_expert_parallel", 2, "--experts 4 --ffn 64 --top-k 2 --dp 2 --ep 2"},
      {"08_5d_mesh", 4, "--dp 2 --tp 2 --zero 3 --prefetch 1"}};
  for (const Run& x : runs) {
    const tst::Result r = tst::run_bin(std::string("memcheck/") + x.bin, kTiny + x.args + " --device cuda", x.np, 300, kOwnGpus);
    INFO(x.bin << " " << x.args << "\n" << r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("final loss") != std::string::npos);
    CHECK(reports(r.output) == 0);
  }
  const std::string args = kTiny + "--device cuda";
  const tst::Result checked = tst::run_bin("memcheck/01_single_gpu", args, 1, 300, kOwnGpus);
  const tst::Result plain = tst::run_bin("01_single_gpu", args, 1, 300, kOwnGpus);
  const auto loss = [](const std::string& out) { return out.substr(out.find("final loss"), 30); };
  REQUIRE(checked.output.find("final loss") != std::string::npos);
  REQUIRE(plain.output.find("final loss") != std::string::npos);
  CHECK(loss(checked.output) == loss(plain.output));
}

// The seeded defects: each report names the kernel, its launch site, block and thread, the kind of
// defect, the allocation or array, and the source line of the access.
TEST_CASE("memcheck build: seeded defects are reported with their kernel and line, and the run fails", "[emu][cuda]") {
  struct Bug {
    const char* name;
    std::string kernel, kind, where, line;
  };
  const std::string cuda = "common/kernels/kernels_cuda.cu", overrun = "tests/bugs/memcheck_shared_overrun.cpp",
                    tile = "tests/bugs/memcheck_misaligned_tile.cpp", partial = "tests/bugs/memcheck_extra_partial.cpp";
  const std::vector<Bug> bugs = {
      {"memcheck_short_index", "kernel embedding_forward_kernel (launched at " + cuda + ":",
       "initcheck: a read of memory that nothing wrote: read of 4 bytes", "byte 1020 of the 1024-byte device allocation",
       cuda + ":" + std::to_string(line_of(cuda, "embedding_forward_kernel(", "int64_t(tokens[n])")) +
           " (void ts::cuda::embedding_forward_kernel<float>)"},
      {"memcheck_device_overrun", "kernel embedding_forward_kernel (launched at " + cuda + ":",
       "memcheck: an access outside its allocation or shared array: write of 4 bytes",
       "0 bytes past the end of the 65280-byte device allocation",
       cuda + ":" + std::to_string(line_of(cuda, "embedding_forward_kernel(", "out[i] = row >= 0")) +
           " (void ts::cuda::embedding_forward_kernel<float>)"},
      {"memcheck_extra_partial", "kernel row_max_kernel (launched at " + partial + ":",
       "initcheck: a read of memory that nothing wrote: read of 4 bytes", "byte 32 of the 128-byte shared array sh",
       partial + ":" + std::to_string(line_of(partial, "", "lane <= nwarps ? sh[lane]")) + " (row_max_kernel)"},
      {"memcheck_shared_overrun", "kernel row_sums_kernel (launched at " + overrun + ":",
       "memcheck: an access outside its allocation or shared array: write of 4 bytes",
       "0 bytes past the end of the 32-byte shared array partial",
       overrun + ":" + std::to_string(line_of(overrun, "", "partial[warp] = v")) + " (row_sums_kernel)"},
      {"memcheck_misaligned_tile", "kernel pair_tile_kernel (launched at " + tile + ":",
       "memcheck: a misaligned access (a 2-, 4-, 8- or 16-byte access must be aligned to its size): write of 4 bytes",
       "byte 66 of the 528-byte shared array tile",
       tile + ":" + std::to_string(line_of(tile, "", "*reinterpret_cast<uint32_t*>(tile")) + " (pair_tile_kernel)"}};
  for (const Bug& b : bugs) {
    const tst::Result r = tst::run_bin(std::string("memcheck/tests/bugs/01_single_gpu+") + b.name, kTiny + "--device cuda", 1,
                                       120, kOwnGpus);
    INFO(b.name << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.output.find(std::string("runs the deliberate bug ") + b.name) != std::string::npos);
    CHECK(reports(r.output) >= 1);
    for (const std::string& s : {b.kernel, b.kind, b.where, ", at " + b.line}) CHECK(r.output.find(s) != std::string::npos);
  }
}
#endif
