// ranks: 1
// 07b_overlap_a2a.cu (07 --overlap-a2a) against 07 and 01: the same arithmetic in another order of
// waiting, so bit for bit 07 without the flag and by the fp32 criterion 01, at (dp, ep) ∈ {(2, 2),
// (4, 2), (4, 4)} with 2 and 4 micro-batches per rank, under full recompute, with OpenBLAS's
// SkylakeX kernels, and on the emulated GPU (NCCL's grouped send/recv on the ep group's stream); the
// trace shows an all-to-all in flight while a layer of the other micro-batch starts; 08 at dp × tp ×
// ep; a seeded bug (a combine read before its all-to-all completes) fails the criterion; bad input.
#include <catch2/catch.hpp>

#include <fstream>
#include <iterator>

#include "formats/json.h"
#include "test_util.h"

namespace {

const std::string kMoe = "--preset tiny --experts 4 --top-k 2 --ffn 64 --quiet --lr-schedule constant ";
using Run = tst::CachedRun;
std::string mesh(int dp, int ep, int micro) {
  return "--dp " + std::to_string(dp) + " --ep " + std::to_string(ep) + " " + tst::steps_args(4, 8, micro) + " ";
}
const Run& expert(int dp, int ep, int micro, bool overlap, const std::string& rest = "", const std::string& env = "") {
  return tst::cached_run("07_expert_parallel", dp, kMoe + mesh(dp, ep, micro) + (overlap ? "--overlap-a2a " : "") + rest,
                         300, env);
}
const Run& single(const std::string& rest = "") { return tst::cached_run("01_single_gpu", 1, kMoe + tst::steps_args(4, 8, 8) + " " + rest); }
bool bitwise(const Run& a, const Run& b) {
  return a.log.losses() == b.log.losses() &&
         tst::max_abs_diff_files(a.ckpt + "/model.safetensors", b.ckpt + "/model.safetensors") == 0.0;
}

}  // namespace

// Each parameter's gradient gets the pair's first micro-batch's share before the second's, as in
// 07's one-after-another order, and every sum is the same: bit for bit.
TEST_CASE("--overlap-a2a reproduces 07 bit for bit and 01 (fp32) at ep 2 and 4, with dp and accumulation",
          "[07b][e2e][equiv]") {
  const Run& ref = single();
  for (auto [dp, ep, micro] : {std::tuple<int, int, int>{2, 2, 2}, {2, 2, 1}, {4, 2, 1}, {4, 4, 1}}) {
    INFO("dp " << dp << " ep " << ep << " micro-batch " << micro);
    const Run& r = expert(dp, ep, micro, true);
    tst::check_equivalent(r, ref);
    CHECK(bitwise(r, expert(dp, ep, micro, false)));
  }
  // Full recompute reruns each forward's all-to-alls inside the backward, handing over there too.
  const std::string full = "--recompute full";
  tst::check_equivalent(expert(4, 4, 1, true, full), single(full));
}

TEST_CASE("--overlap-a2a with OpenBLAS's SkylakeX kernels reproduces 01", "[07b][e2e][equiv]") {
  const std::string env = "OPENBLAS_CORETYPE=SkylakeX";
  tst::check_equivalent(expert(4, 2, 1, true, "", env), tst::cached_run("01_single_gpu", 1, kMoe + tst::steps_args(4, 8, 8), 180, env));
}

// A pair's activations are alive at once: the prediction holds both micro-batches' whole, twice
// one's, an upper bound; the measured peak comes when the second finishes its forward, by which time
// the first has freed a little of its backward's (here 82,176 of 1,327,616 bytes: 6%). Where routing
// moves no rows unevenly (2 experts, top-2: every token to both), in 07 and 08.
TEST_CASE("--overlap-a2a: activations measured within the pair's predicted", "[07b][e2e][mem]") {
  const std::string two = "--experts 2 --top-k 2 --dp 2 --ep 2 --micro-batch 2 --steps 2";
  const auto activations = [&](const char* bin, const std::string& more) -> const ts::Json& {
    return tst::cached_run(bin, 2, kMoe + two + more).log.summary.at("memory").at("activations");
  };
  const double one = activations("07_expert_parallel", "").at("predicted").as_double();
  CHECK(activations("07_expert_parallel", "").at("measured").as_double() == one);
  for (const char* bin : {"07_expert_parallel", "08_5d_mesh"}) {
    const ts::Json& m = activations(bin, " --overlap-a2a");
    INFO(bin);
    CHECK(m.at("predicted").as_double() == 2 * one);
    CHECK(m.at("measured").as_double() <= m.at("predicted").as_double());
    CHECK(m.at("measured").as_double() >= 0.9 * m.at("predicted").as_double());
  }
}

// 08 runs the same schedule on its mesh where no pipeline orders the micro-batches: dp 2 × tp 2 ×
// ep 2 (each tp rank its own ep group's all-to-alls, handed over in the same order on every rank).
TEST_CASE("08 --overlap-a2a at dp 2 × tp 2 × ep 2 and dp 4 × ep 4 reproduces 01", "[07b][08][e2e][equiv]") {
  for (auto [dp, tp, ep] : {std::tuple<int, int, int>{2, 2, 2}, {4, 1, 4}}) {
    INFO("dp " << dp << " tp " << tp << " ep " << ep);
    tst::check_equivalent(tst::cached_run("08_5d_mesh", dp * tp, kMoe + mesh(dp, ep, 1) + "--tp " + std::to_string(tp) +
                                                                       " --kv-heads 4 --overlap-a2a"),
                          single("--kv-heads 4"));
  }
}

#ifdef TS_CUDA_EMU
// The emulated GPU, a GPU per rank: the dispatch and combine are NCCL grouped send/recv on the ep
// group's stream, ordered by events; the result is 01's on the CPU.
TEST_CASE("emulated GPU: --overlap-a2a on NCCL at dp 2 × ep 2 and ep 4 reproduces 01", "[07b][emu][cuda]") {
  const std::string own = "TS_EMU_GPUS=8";
  const Run& ref = single("--device cpu");
  for (auto [dp, ep] : {std::pair<int, int>{2, 2}, {4, 4}}) {
    const Run& r = expert(dp, ep, 1, true, "--device cuda", own);
    INFO(r.output);
    CHECK(r.output.find("nccl") != std::string::npos);
    tst::check_equivalent(r, ref);
  }
}
#endif

// A combine's rows read before its all-to-all completes (tests/bugs/early_combine_read.cpp): the
// rows the buffer held before. Where they were never written (the emulated GPU's build poisons new
// memory with NaN) step 0 diverges and the run stops; elsewhere they are stale rows, and the run
// leaves the criterion.
TEST_CASE("seeded bug: a combine read before the all-to-all completes", "[07b][e2e][equiv]") {
  const std::string bug = "tests/bugs/07_expert_parallel+early_combine_read";
  for (auto [dp, ep] : {std::pair<int, int>{2, 2}, {4, 4}}) {
    const std::string args = kMoe + mesh(dp, ep, 1) + "--overlap-a2a-early-combine";
    const tst::Result r = tst::run_bin(bug, args, dp, 120);
    INFO("ep " << ep << "\n" << r.output);
    CHECK(r.output.find("deliberate bug early_combine_read") != std::string::npos);
    if (r.status != 0) {
      CHECK(r.output.find("step 0 diverged") != std::string::npos);
      continue;
    }
    const tst::Equivalence e = tst::compare(tst::cached_run(bug, dp, args), single());
    INFO(e);
    CHECK_FALSE(tst::equivalent(e));
  }
}

// On rank 0: an all-to-all in flight (lane "comm 2", its post to its completion) spans the start of
// a layer's forward or backward (the other micro-batch's, which runs while it travels); without the
// flag the blocking all-to-alls never do.
int overlapped_layers(bool overlap) {
  const std::string path = tst::scratch(overlap ? "a2a_overlap_trace.json" : "a2a_trace.json");
  const tst::Result r = tst::run_bin("07_expert_parallel", kMoe + mesh(2, 2, 1) + (overlap ? "--overlap-a2a " : "") +
                                                              "--trace " + path, 2, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::ifstream f(path);
  const ts::Json t = ts::Json::parse(std::string(std::istreambuf_iterator<char>(f), {}));
  std::vector<std::pair<double, double>> a2a;
  std::vector<double> layers;
  for (const ts::Json& e : t.at("traceEvents").as_array()) {
    if (!e.contains("dur") || e.at("pid").as_double() != 0) continue;
    const std::string name = e.at("name").as_string();
    const double t0 = e.at("ts").as_double();
    if (name.rfind("ep all_to_all_v (", 0) == 0) a2a.push_back({t0, t0 + e.at("dur").as_double()});
    if (name.rfind("fwd layer ", 0) == 0 || name.rfind("bwd layer ", 0) == 0) layers.push_back(t0);
  }
  int n = 0;
  for (double s : layers)
    for (auto [t0, t1] : a2a) n += t0 < s && s < t1;
  return n;
}

TEST_CASE("the trace shows an all-to-all in flight while the other micro-batch's layer starts", "[07b][trace]") {
  CHECK(overlapped_layers(true) > 0);
  CHECK(overlapped_layers(false) == 0);
}

TEST_CASE("bad input: --overlap-a2a refused with one line on every rank", "[07b][errors]") {
  tst::check_errors("07_expert_parallel", kMoe + "--steps 1 --overlap-a2a ", {
      {2, "--dp 2 --ep 1", "--overlap-a2a needs --ep > 1"},
      {2, "--dp 2 --ep 2 --batch 6 --micro-batch 1", "--overlap-a2a pairs micro-batches: each rank's 3"},
      {2, "--dp 2 --ep 2 --batch 8 --micro-batch 4", "--overlap-a2a pairs micro-batches: each rank's 1"},
      {2, "--dp 2 --ep 2 --dispatch two-level", "--overlap-a2a overlaps the flat dispatch"},
  });
  tst::check_errors("08_5d_mesh", kMoe + "--steps 1 --overlap-a2a ", {
      {4, "--dp 2 --ep 2 --pp 2", "--overlap-a2a with --pp 2 is not composed"},
      {2, "--dp 2 --ep 2 --batch 2 --micro-batch 1", "--overlap-a2a pairs micro-batches: each rank's 1"},
  });
}
