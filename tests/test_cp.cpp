// ranks: 1
// 06_context_parallel against 01 end to end: losses and final weights in fp32 at cp 2 and 4, ring
// attention with zigzag and contiguous blocks and Ulysses, with gradient accumulation and full
// recompute; bf16 runs by the bf16 bounds; per-rank memory, bytes and attention work against the formulas
// (recounted here); a cp 4 checkpoint resuming in 01; the trace; bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant ";
const int kSteps = 6;

using Run = tst::CachedRun;
const Run& run(const std::string& bin, int np, const std::string& args) { return tst::cached_run(bin, np, kTiny + args); }

std::string steps_args(int batch, int micro) { return tst::steps_args(kSteps, batch, micro); }
const Run& single(const std::string& args) { return run("01_single_gpu", 1, args); }
// Ulysses shards kv heads over cp: at cp 4 the model gets 4 kv heads (01 runs the same shape).
std::string shape(const std::string& mode, int C) { return mode == "ulysses" && C == 4 ? " --kv-heads 4 " : " "; }
const Run& context(int C, const std::string& mode, int zigzag, const std::string& args) {
  return run("06_context_parallel", C,
             "--cp " + std::to_string(C) + " --cp-mode " + mode + " --zigzag " + std::to_string(zigzag) +
                 shape(mode, C) + args);
}
double mem(const Run& r, const char* cat, const char* which) {
  return r.log.summary.at("memory").at(cat).at(which).as_double();
}
double comm(const Run& r, const char* group, const char* op, const char* which) {
  return r.log.summary.at("comm").at(group).at(op).at(which).as_double();
}
std::vector<double> work(const Run& r, const char* which) {
  std::vector<double> v;
  for (const ts::Json& x : r.log.summary.at("attention_work").at(which).as_array()) v.push_back(x.as_double());
  return v;
}

}  // namespace

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent).

TEST_CASE("cp 2 and 4 × ring (zigzag, contiguous) and Ulysses × accumulation 1 and 2 reproduce 01 (fp32)",
          "[06][e2e][equiv]") {
  struct Mode {
    std::string mode;
    int zigzag;
  };
  for (int C : {2, 4})
    for (const Mode& m : {Mode{"ring", 1}, Mode{"ring", 0}, Mode{"ulysses", 1}})
      for (int accum : {1, 2}) {
        const Run& ref = single(steps_args(8, 8 / accum) + shape(m.mode, C));
        const Run& t = context(C, m.mode, m.zigzag, steps_args(8, 8 / accum));
        INFO("cp " << C << " " << m.mode << " zigzag " << m.zigzag << " accumulation " << accum);
        REQUIRE(t.log.steps.size() == size_t(kSteps));
        tst::check_equivalent(t, ref);
      }
}

TEST_CASE("full recompute reruns the ring and the all-to-alls and still reproduces 01", "[06][e2e][equiv]") {
  for (const char* mode : {"ring", "ulysses"}) {
    const int C = std::string(mode) == "ring" ? 4 : 2;
    const Run& ref = single(steps_args(8, 4) + " --recompute full");
    const Run& t = context(C, mode, 1, steps_args(8, 4) + " --recompute full");
    INFO(mode);
    tst::check_equivalent(t, ref);
    CHECK(mem(t, "activations", "measured") == mem(t, "activations", "predicted"));
    const char* op = std::string(mode) == "ring" ? "send" : "all_to_all";
    CHECK(comm(t, "cp", op, "bytes") == Approx(comm(t, "cp", op, "predicted")).epsilon(1e-12));
  }
}

// bf16 activations: ring attention rounds each block's partial output before the merge, so the
// runs agree by the bf16 bounds (test_util.h), not fp32's.
TEST_CASE("bf16: ring cp 2 (plain and zigzag) reproduces 01 bf16 by the bf16 bounds", "[06][e2e][bf16]") {
  const Run& ref = single(steps_args(8, 4) + " --dtype bf16");
  for (int zigzag : {0, 1}) {
    const Run& t = context(2, "ring", zigzag, steps_args(8, 4) + " --dtype bf16");
    INFO("zigzag " << zigzag);
    tst::check_equivalent(t, ref, tst::bf16_bounds(8 * 32));
    CHECK(t.log.losses().back() < t.log.losses().front() - 0.3);
  }
}

// The tiny model: D 64, L 2, heads 4, kv heads 2 (4 for Ulysses at cp 4), hd 16, seq 32.
TEST_CASE("memory, bytes and attention work per rank equal the formulas", "[06][e2e][mem][comm]") {
  const double D = 64, L = 2, F = 160, V = 256, T = 32, hd = 16, mb = 4, mbs = 2;
  const Run& ref = single(steps_args(8, 4));
  for (int C : {2, 4})
    for (const char* mode : {"ring", "ulysses"}) {
      const Run& t = context(C, mode, 1, steps_args(8, 4));
      INFO("cp " << C << " " << mode);
      const double KV = (std::string(mode) == "ulysses" && C == 4 ? 4 : 2) * hd;
      const double psi = 2 * V * D + L * (2 * D * D + 2 * KV * D + 3 * F * D) + (2 * L + 1) * D;
      CHECK(mem(t, "params", "measured") == 4 * psi);  // replicated: the whole model on every rank
      CHECK(mem(t, "optimizer", "measured") == 8 * psi);
      CHECK(mem(t, "activations", "measured") == mem(t, "activations", "predicted"));
      // Every saved tensor is per token: exactly 1/cp of 01's (same shape).
      if (KV == 2 * hd) CHECK(mem(t, "activations", "measured") * C == mem(ref, "activations", "measured"));
      // Per layer and micro-batch, kv = one K block of mb·T/C tokens, a = one q-sized block.
      const double tokens = mb * T / C, kv = tokens * KV * 4, a = tokens * D * 4;
      if (std::string(mode) == "ring") {
        CHECK(comm(t, "cp", "send", "bytes") == Approx(mbs * L * (C - 1) * (2 * kv + 4 * kv)).epsilon(1e-12));
        CHECK(comm(t, "cp", "send", "calls") == mbs * L * (C - 1) * 6);  // K, V; K, V and dK, dV
        CHECK(comm(t, "cp", "send", "bytes") == Approx(comm(t, "cp", "send", "predicted")).epsilon(1e-12));
      } else {
        const double f = (C - 1.0) / C;
        CHECK(comm(t, "cp", "all_to_all", "bytes") == Approx(mbs * L * f * (5 * a + 4 * kv)).epsilon(1e-12));
        CHECK(comm(t, "cp", "all_to_all", "calls") == mbs * L * 9);  // 4 forward, 5 backward
        CHECK(comm(t, "cp", "all_to_all", "bytes") == Approx(comm(t, "cp", "all_to_all", "predicted")).epsilon(1e-12));
      }
      // 02's bucketed reducer: one ring all-reduce of the fp32 gradients per step.
      CHECK(comm(t, "dp_cp", "all_reduce", "bytes") == Approx(2 * (C - 1.0) / C * 4 * psi).epsilon(1e-12));
      // Attention work measured = predicted, and the pairs over all ranks = 01's causal pairs.
      const std::vector<double> pairs = work(t, "pairs"), pred = work(t, "predicted_pairs");
      CHECK(pairs == pred);
      double total = 0;
      for (double p : pairs) total += p;
      CHECK(total == mbs * L * mb * 4 * T * (T + 1) / 2);
    }
}

TEST_CASE("zigzag balances the causal work across ranks, contiguous blocks do not", "[06][e2e][work]") {
  const std::vector<double> zb = work(context(4, "ring", 1, steps_args(8, 4)), "blocks"),
                            zp = work(context(4, "ring", 1, steps_args(8, 4)), "pairs");
  const std::vector<double> cb = work(context(4, "ring", 0, steps_args(8, 4)), "blocks"),
                            cpairs = work(context(4, "ring", 0, steps_args(8, 4)), "pairs");
  const double runs = 2 * 2;  // layers × micro-batches
  // Zigzag: every rank computes all 4 blocks and exactly the same pairs (2 chunk-diagonals + 2(cp−1)+1 full chunk pairs).
  CHECK(*std::max_element(zb.begin(), zb.end()) - *std::min_element(zb.begin(), zb.end()) <= runs);
  CHECK(*std::max_element(zp.begin(), zp.end()) == *std::min_element(zp.begin(), zp.end()));
  // Contiguous: rank r sees r + 1 blocks (the rest are masked and skipped); the last rank does
  // 228/36 = 6.3 times the pairs of the first (3 full blocks and a diagonal against a diagonal).
  for (int r = 0; r < 4; r++) CHECK(cb[size_t(r)] == runs * (r + 1));
  CHECK(cpairs[3] / cpairs[0] == Approx((4.0 * 8 * 8 - 8 * 7 / 2.0) / (8 * 9 / 2.0)));
}

TEST_CASE("a cp 4 checkpoint resumes in 01 on its curve", "[06][e2e][ckpt]") {
  const Run& ref = single(steps_args(8, 8));
  const Run& from = context(4, "ring", 1, "--steps 3 --batch 8");
  tst::check_resume("01_single_gpu", 1, kTiny + "--steps 6 --batch 8", from.ckpt, ref, 3);
}

TEST_CASE("--trace puts the ring's transfers on the comm lane", "[06][e2e][trace]") {
  const std::string trace = tst::scratch("cp_trace.json");
  tst::Result r = tst::run_bin("06_context_parallel", kTiny + "--cp 2 --steps 1 --batch 2 --trace " + trace, 2, 60);
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::ifstream f(trace);
  std::stringstream s;
  s << f.rdbuf();
  CHECK(s.str().find("cp ring K/V (forward)") != std::string::npos);
  CHECK(s.str().find("cp ring dK/dV") != std::string::npos);
}

TEST_CASE("--dry-run predicts a 1M-token sequence of Llama-3-8B at cp 16 on one rank", "[06]") {
  tst::Result r = tst::run_bin("06_context_parallel",
                               "--dry-run --preset 8b --cp 16 --seq 1048576 --batch 1 --dtype bf16 --recompute full", 1, 60);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("65536 of 1048576 tokens per sequence per rank") != std::string::npos);
  CHECK(r.output.find("per-rank cp send per step") != std::string::npos);
}

TEST_CASE("bad input: a one-line message, a non-zero exit on every rank, no hang", "[06][errors]") {
  tst::check_errors("06_context_parallel", kTiny + "--steps 2 ", {
      {2, "--cp 2 --seq 30", "--seq 30 is not divisible by 2·cp = 4"},
      {4, "--cp 4 --zigzag 0 --seq 30", "--seq 30 is not divisible by --cp 4"},
      {4, "--cp 4 --cp-mode ulysses --heads 2 --kv-heads 2", "--heads 2 is not divisible by --cp 4"},
      {4, "--cp 4 --cp-mode ulysses", "--kv-heads 2 is not divisible by --cp 4"},
      {2, "--cp 4", "needs 4 ranks but the job has 2"},
      {2, "--cp 2 --cp-mode tree", "--cp-mode must be ring or ulysses"},
      {2, "--cp 2 --zigzag 2", "--zigzag must be 1 or 0"},
  });
}
