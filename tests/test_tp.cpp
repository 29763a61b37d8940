// ranks: 1
// 04_tensor_parallel against 01 end to end: losses and final weights in fp32 at tp 2 and 4, with
// and without sequence parallelism, with gradient accumulation, full recompute and clipping;
// bf16 runs by the bf16 bounds; per-rank memory and bytes against the formulas (recounted here); checkpoints
// crossing between 01 and 04 at other tp; bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "test_util.h"

namespace {

// kv heads 4 so that tp 4 gives every rank a whole kv head (the tiny preset has 2).
const std::string kTiny = "--preset tiny --kv-heads 4 --quiet --lr-schedule constant ";
const int kSteps = 6;

using Run = tst::CachedRun;
const Run& run(const std::string& bin, int np, const std::string& args) { return tst::cached_run(bin, np, kTiny + args); }

std::string steps_args(int batch, int micro) { return tst::steps_args(kSteps, batch, micro); }
const Run& single(const std::string& args) { return run("01_single_gpu", 1, args); }
const Run& tensor(int tp, bool sp, const std::string& args) {
  return run("04_tensor_parallel", tp, "--tp " + std::to_string(tp) + (sp ? " --sequence-parallel " : " ") + args);
}
double mem(const Run& r, const char* cat, const char* which) {
  return r.log.summary.at("memory").at(cat).at(which).as_double();
}
double comm(const Run& r, const char* op, const char* which) {
  return r.log.summary.at("comm").at("tp").at(op).at(which).as_double();
}
bool r_has(const Run& r, const char* op) { return r.log.summary.at("comm").at("tp").contains(op); }

}  // namespace

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent): losses and gradient
// norms per step, step 1's gradients per tensor, the final weights against the whole update.
TEST_CASE("tp 2 and 4 × sequence parallel off/on × accumulation 1 and 2 reproduce 01 (fp32, clipped)",
          "[04][e2e][equiv]") {
  const Run& ref = single(steps_args(8, 8));
  CHECK(ref.log.steps[0].at("grad_norm").as_double() > 1.2);  // clipping at 1.0 is active
  for (int tp : {2, 4})
    for (bool sp : {false, true})
      for (int accum : {1, 2}) {
        const Run& t = tensor(tp, sp, steps_args(8, 8 / accum));
        INFO("tp " << tp << " sp " << sp << " accumulation " << accum);
        REQUIRE(t.log.steps.size() == size_t(kSteps));
        // The gradient norm in it counts each rank's blocks once and the replicated norm weights once.
        tst::check_equivalent(t, ref);
      }
}

TEST_CASE("full recompute under tp 2 + sequence parallel, and tp 4 with recompute selective, reproduce 01",
          "[04][e2e][equiv]") {
  for (const char* rc : {"--recompute full", "--recompute selective"}) {
    const Run& ref = single(steps_args(8, 4) + " " + rc);
    const Run& t = tensor(std::string(rc) == "--recompute full" ? 2 : 4, true, steps_args(8, 4) + " " + rc);
    INFO(rc);
    tst::check_equivalent(t, ref);
  }
}

// bf16 activations and weights (fp32 masters and gradients): a row-parallel layer's partial sums
// meet in another order before the output is rounded to bf16, so from step 1 on the runs agree
// by the bf16 bounds (test_util.h), not fp32's.
TEST_CASE("bf16: tp 2, with and without sequence parallel, reproduces 01 bf16 by the bf16 bounds",
          "[04][e2e][bf16]") {
  const Run& ref = single(steps_args(8, 4) + " --dtype bf16");
  for (bool sp : {false, true}) {
    const Run& t = tensor(2, sp, steps_args(8, 4) + " --dtype bf16");
    INFO("sequence parallel " << sp);
    tst::check_equivalent(t, ref, tst::bf16_bounds(8 * 32));
    CHECK(t.log.losses().back() < t.log.losses().front() - 0.3);
  }
}

// Memory: the tp rank's blocks are Ψ/t of every split tensor plus the whole norm weights.
TEST_CASE("memory and bytes per rank equal the formulas at tp 2 and 4, with and without sequence parallelism",
          "[04][e2e][mem][comm]") {
  // The tiny model with kv heads 4: D 64, L 2, heads 4 of 16, F 160, V 256, seq 32.
  const double D = 64, L = 2, F = 160, V = 256, KV = 64, T = 32;
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      const Run& t = tensor(tp, sp, steps_args(8, 4));
      INFO("tp " << tp << " sp " << sp);
      const double psi = (2 * V * D + L * (2 * D * D + 2 * KV * D + 3 * F * D)) / tp + (2 * L + 1) * D;
      CHECK(mem(t, "params", "measured") == 4 * psi);
      CHECK(mem(t, "grads", "measured") == 4 * psi);
      CHECK(mem(t, "optimizer", "measured") == 8 * psi);
      CHECK(mem(t, "activations", "measured") == mem(t, "activations", "predicted"));
      // Per step: 2 micro-batches of K = 4·32 tokens × 64 × 4 bytes; ring all-reduce 2(t−1)/t·K,
      // all-gather and reduce-scatter (t−1)/t·K.
      const double f = (tp - 1.0) / tp, K = 4 * T * D * 4, mbs = 2, loss = 2 * f * (4 * T) * 4 * 3;
      if (!sp) {
        CHECK(comm(t, "all_reduce", "bytes") == Approx(mbs * (2 * f * K * (2 + 4 * L) + loss)).epsilon(1e-12));
        CHECK(comm(t, "all_reduce", "calls") == mbs * (2 + 4 * L + 2));
      } else {
        CHECK(comm(t, "all_gather", "bytes") == Approx(mbs * f * K * (6 * L + 2)).epsilon(1e-12));
        CHECK(comm(t, "reduce_scatter", "bytes") == Approx(mbs * f * K * (4 * L + 2)).epsilon(1e-12));
        CHECK(comm(t, "all_reduce", "bytes") == Approx(mbs * loss + 2 * f * (2 * L + 1) * D * 4).epsilon(1e-12));
      }
      for (const char* op : {"all_reduce", "all_gather", "reduce_scatter"})
        if (r_has(t, op)) CHECK(comm(t, op, "bytes") == Approx(comm(t, op, "predicted")).epsilon(1e-12));
    }
  // Sequence parallelism stores 1/tp of the norm-region activations: less than plain TP.
  CHECK(mem(tensor(2, true, steps_args(8, 4)), "activations", "measured") <
        mem(tensor(2, false, steps_args(8, 4)), "activations", "measured"));
}

TEST_CASE("a tp 2 checkpoint resumes in 01 on its curve, and a 01 checkpoint at tp 4", "[04][e2e][ckpt]") {
  const Run& ref = single(steps_args(8, 8));
  tst::check_resume("01_single_gpu", 1, kTiny + "--steps 6 --batch 8", tensor(2, true, "--steps 3 --batch 8").ckpt, ref,
                    3);
  tst::check_resume("04_tensor_parallel", 4, kTiny + "--tp 4 --steps 6 --batch 8", single("--steps 3 --batch 8").ckpt,
                    ref, 3);
}

TEST_CASE("--dry-run predicts Llama-3-8B at tp 8 on one rank", "[04]") {
  tst::Result r = tst::run_bin("04_tensor_parallel", "--dry-run --preset 8b --tp 8 --micro-batch 1 --dtype bf16", 1, 60);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("4 of 32 heads, 1 of 8 kv heads") != std::string::npos);
  CHECK(r.output.find("per-rank all_reduce per step") != std::string::npos);
}

TEST_CASE("bad input: a one-line message, a non-zero exit on every rank, no hang", "[04][errors]") {
  tst::check_errors("04_tensor_parallel", kTiny + "--steps 2 ", {
      {2, "--tp 2 --heads 2 --kv-heads 1 --dim 64", "--kv-heads 1 is not divisible by --tp 2"},
      {4, "--tp 4 --heads 2 --kv-heads 2", "--heads 2 is not divisible by --tp 4"},
      {2, "--tp 2 --ffn 161", "--ffn 161 is not divisible by --tp 2"},
      {2, "--tp 2 --vocab 255", "--vocab 255 is not divisible by --tp 2"},
      {2, "--tp 2 --sequence-parallel --seq 33 --micro-batch 1 --batch 1", "tokens per micro-batch"},
      {2, "--tp 4", "needs 4 ranks but the job has 2"},
  });
}

// A programming error, not a flag: 04 always hands the model its split table. A test-only variant
// (tests/bugs/no_split_table.cpp) drops it, and the model must refuse to build rather than train
// tp copies of whole tensors.
TEST_CASE("a tp shard spec without a split table: a fatal on every rank before any step", "[04][errors]") {
  tst::check_errors("tests/bugs/04_tensor_parallel+no_split_table", kTiny + "--steps 2 ",
                    {{2, "--tp 2", "a tp 2 shard spec without a split table"}});
  const tst::Result r = tst::run_bin("tests/bugs/04_tensor_parallel+no_split_table", kTiny + "--steps 2 --tp 2", 2, 60);
  CHECK(r.output.find("deliberate bug no_split_table") != std::string::npos);
  CHECK(r.output.find("| loss ") == std::string::npos);  // no step line: it stopped before training
}
