// ranks: 1
// 03_zero: ZeRO-1/2/3 against 01 end to end — losses and final weights in fp32 (with clipping
// and gradient accumulation), bf16 runs by the bf16 bounds, per-rank memory and communication against the
// playbook's formulas (checked here independently of the binary's own predictions), resuming a
// stage-3 checkpoint under stage 1 on another dp, and bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "model/model.h"
#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant ";
const int kSteps = 6;

// The tiny preset's units, counted from its shapes (dim 64, 2 layers, 4 heads / 2 kv heads of
// 16, ffn 160, vocab 256): embedding 256·64; a layer 2 norms + q, o 64·64 + k, v 32·64 + gate,
// up, down 160·64; the head: final norm + lm_head 256·64.
const int64_t kEmb = 256 * 64, kLayer = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64, kHead = 64 + 256 * 64;
const int64_t kPsi = kEmb + 2 * kLayer + kHead;  // 119104

using Run = tst::CachedRun;
const Run& run(const std::string& bin, int np, const std::string& args) { return tst::cached_run(bin, np, kTiny + args, 120); }

// 01 on the same global batch, and stage `stage` of 03 at dp `dp` with `accum` micro-batches.
const Run& single(const std::string& args) { return run("01_single_gpu", 1, args); }
const Run& zero(int stage, int dp, const std::string& args) {
  return run("03_zero", dp, "--dp " + std::to_string(dp) + " --zero " + std::to_string(stage) + " " + args);
}
std::string batch_args(int batch, int dp, int accum) {
  return "--steps " + std::to_string(kSteps) + " --batch " + std::to_string(batch) + " --micro-batch " +
         std::to_string(batch / dp / accum);
}

double mem(const Run& r, const char* cat, const char* which) {
  return r.log.summary.at("memory").at(cat).at(which).as_double();
}
double comm(const Run& r, const char* op, const char* which) {
  return r.log.summary.at("comm").at("dp").at(op).at(which).as_double();
}

}  // namespace

// ----- equivalence with 01 in fp32 ---------------------------------------------------------------------

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent).

TEST_CASE("the tiny model's unit sizes and Ψ, counted independently, match the table", "[03]") {
  ts::ModelConfig c{64, 2, 4, 2, 160, 256, 32};
  ts::ParamTable t = ts::Model::make_table(c);
  CHECK(kPsi == 119104);
  CHECK(t.total == kPsi);
  REQUIRE(t.num_units() == 4);
  CHECK(t.unit_begin[1] - t.unit_begin[0] == kEmb);
  CHECK(t.unit_begin[2] - t.unit_begin[1] == kLayer);
  CHECK(t.unit_begin[4] - t.unit_begin[3] == kHead);
  // dp 2 and 4 divide every unit (no padding); dp 3 pads each unit to a multiple of 3.
  CHECK(ts::Model::make_table(c, 4).total == kPsi);
  CHECK(ts::Model::make_table(c, 3).total == kPsi + 5);  // 16384→+2, 43136→+1 (×2), 16448→+1
}

TEST_CASE("ZeRO-1/2/3 at dp 2 and 4, accumulation 1 and 2, reproduce 01's losses and weights (fp32, clipped)",
          "[03][e2e][equiv]") {
  const Run& ref = single(batch_args(8, 1, 1));
  // Clipping is active: the tiny model's first gradient norms (~1.6) exceed the default --clip 1.0.
  CHECK(ref.log.steps[0].at("grad_norm").as_double() > 1.2);
  for (int stage : {1, 2, 3})
    for (int dp : {2, 4})
      for (int accum : {1, 2}) {
        const Run& z = zero(stage, dp, batch_args(8, dp, accum));
        INFO("stage " << stage << " dp " << dp << " accumulation " << accum);
        REQUIRE(z.log.steps.size() == size_t(kSteps));
        CHECK(z.log.steps[0].at("grad_norm").as_double() > 1.2);
        // Grad norms come from the sharded sum of squares plus one all-reduce: the same number.
        tst::check_equivalent(z, ref);
      }
}

TEST_CASE("ZeRO-3 at dp 3 (padded units) reproduces 01 on a batch of 12", "[03][e2e][equiv]") {
  const Run& ref = single(batch_args(12, 1, 1));
  const Run& z = zero(3, 3, batch_args(12, 3, 1));
  // Every unit is padded to a multiple of 3: 5 padding elements, which belong to no tensor.
  CHECK(z.output.find("padded per unit to 119109 (5 padding)") != std::string::npos);
  tst::check_equivalent(z, ref);
  for (const char* c : {"params", "grads", "optimizer"}) {
    INFO(c);
    CHECK(mem(z, c, "measured") == mem(z, c, "predicted"));
  }
  // The optimizer shard is a third of the padded buffer: 8 bytes (m, v) per element.
  CHECK(mem(z, "optimizer", "measured") == 8.0 * (kPsi + 5) / 3);
}

// ----- bf16 ----------------------------------------------------------------------------------------------

// A reduce-scatter's other order can move a master weight across a bf16 rounding boundary: the
// runs agree by the bf16 bounds (test_util.h).
TEST_CASE("bf16: every stage reproduces 01 bf16 by the bf16 bounds", "[03][e2e][bf16]") {
  const std::string a = "--dtype bf16 --steps 10 --batch 8";
  const Run& ref = single(a);
  for (int stage : {1, 2, 3}) {
    const Run& z = zero(stage, 2, a);
    std::vector<double> l = z.log.losses();
    INFO("stage " << stage);
    REQUIRE(l.size() == 10);
    tst::check_equivalent(z, ref, tst::bf16_bounds(8 * 32));
    CHECK(l.back() < l.front() - 0.3);
    // Mixed precision here keeps fp32 gradients: bf16 weights 2Ψ, fp32 grads 4Ψ, and fp32
    // master + m + v 12Ψ/N; ZeRO-3 gathers bf16 weights, every stage reduce-scatters fp32.
    const double shard = kPsi / 2.0, pair = 2.0 * kLayer, f = 0.5;
    for (const char* c : {"params", "grads", "optimizer"}) {
      INFO(c);
      CHECK(mem(z, c, "measured") == mem(z, c, "predicted"));
    }
    CHECK(mem(z, "optimizer", "measured") == 12 * shard);
    CHECK(mem(z, "grads", "measured") == (stage == 1 ? 4.0 * kPsi : 4 * (shard + pair)));
    CHECK(mem(z, "params", "measured") == (stage < 3 ? 2.0 * kPsi : 2 * (shard + pair)));
    CHECK(comm(z, "reduce_scatter", "bytes") == f * 4 * kPsi);
    CHECK(comm(z, "all_gather", "bytes") == f * 2 * (stage < 3 ? kPsi : kPsi + pair));
  }
}

// ----- memory -----------------------------------------------------------------------------------------

TEST_CASE("memory: per-rank params, grads and optimizer equal the formulas for each stage at dp 2 and 4", "[03][e2e][mem]") {
  const Run& ref = single(batch_args(8, 1, 1));
  for (int stage : {1, 2, 3})
    for (int dp : {2, 4}) {
      const Run& z = zero(stage, dp, batch_args(8, dp, 1));
      INFO("stage " << stage << " dp " << dp);
      for (const char* c : {"params", "grads", "optimizer"}) {
        INFO(c);
        CHECK(mem(z, c, "measured") == mem(z, c, "predicted"));
      }
      // The formulas, independently (fp32, no padding at dp 2/4): a shard is Ψ/N; stages 2/3
      // hold at most two consecutive units' gradients (here the two layers) besides their shard;
      // stage 3 holds its weight shard plus the gathered pair (prefetch on).
      const double shard = double(kPsi) / dp, pair = 2.0 * kLayer;
      CHECK(mem(z, "optimizer", "measured") == 8 * shard);
      CHECK(mem(z, "grads", "measured") == (stage == 1 ? 4.0 * kPsi : 4 * (shard + pair)));
      CHECK(mem(z, "params", "measured") == (stage < 3 ? 4.0 * kPsi : 4 * (shard + pair)));
    }
  // Optimizer states at dp 4 are a quarter of 01's (no padding at dp 4).
  CHECK(4 * mem(zero(1, 4, batch_args(8, 4, 1)), "optimizer", "measured") == mem(ref, "optimizer", "measured"));
  CHECK(mem(ref, "optimizer", "measured") == 8.0 * kPsi);
}

TEST_CASE("ZeRO-3: peak weights drop without prefetch, both below ZeRO-2's full copy; same losses", "[03][e2e][mem]") {
  const Run& on = zero(3, 4, batch_args(8, 4, 1));
  const Run& off = zero(3, 4, batch_args(8, 4, 1) + " --prefetch 0");
  const Run& s2 = zero(2, 4, batch_args(8, 4, 1));
  const double p_on = mem(on, "params", "measured"), p_off = mem(off, "params", "measured");
  CHECK(p_off < p_on);
  CHECK(p_on < mem(s2, "params", "measured"));
  // Without prefetch: the shard plus the largest unit (a layer).
  CHECK(p_off == 4 * (kPsi / 4.0 + kLayer));
  CHECK(p_off == mem(off, "params", "predicted"));
  // Prefetch changes when weights arrive, not what is computed.
  CHECK(off.log.losses() == on.log.losses());
}

// ----- communication -----------------------------------------------------------------------------------

TEST_CASE("communication: counted bytes per step equal the formulas for each stage", "[03][e2e][comm]") {
  for (int stage : {1, 2, 3})
    for (int dp : {2, 4})
      for (int accum : {1, 2}) {
        const Run& z = zero(stage, dp, batch_args(8, dp, accum));
        INFO("stage " << stage << " dp " << dp << " accumulation " << accum);
        const double rs = comm(z, "reduce_scatter", "bytes"), ag = comm(z, "all_gather", "bytes");
        CHECK(rs == comm(z, "reduce_scatter", "predicted"));
        CHECK(ag == comm(z, "all_gather", "predicted"));
        // The formulas, independently: ring reduce-scatter / all-gather send (N-1)/N·K per rank.
        const double f = double(dp - 1) / dp, K = 4.0 * kPsi;
        CHECK(rs == f * K * (stage == 1 ? 1 : accum));  // stage 1 reduces once, 2/3 every micro-batch
        if (stage < 3) {
          CHECK(ag == f * K);  // the updated weights, once
        } else {
          // Stage 3 gathers every unit for forward and the layers again for backward, per
          // micro-batch: ≈ 3Ψ together with the reduce-scatter, against DP's 2Ψ all-reduce.
          const double per_mb = (rs + ag) / accum, three_psi = 3 * f * K, dp_allreduce = 2 * f * K;
          CHECK(std::fabs(per_mb - three_psi) <= 0.2 * three_psi);
          CHECK(per_mb > 1.3 * dp_allreduce);
          CHECK(ag == f * 4 * (kPsi + 2 * kLayer) * accum);
        }
      }
}

// ----- checkpoints ------------------------------------------------------------------------------------

// Resumes `from`'s checkpoint (taken after step 3) under stage 1 at dp 2 for steps 3..5.
static void check_resume(const Run& from, const Run& ref, const std::string& batch) {
  tst::check_resume("03_zero", 2, kTiny + "--dp 2 --zero 1 --steps 6 " + batch, from.ckpt, ref, 3);
}

TEST_CASE("a checkpoint saved by ZeRO-3 at dp 4 resumes under ZeRO-1 at dp 2 on 01's curve", "[03][e2e][ckpt]") {
  check_resume(zero(3, 4, "--steps 3 --batch 8"), single(batch_args(8, 1, 1)), "--batch 8");
  // And from padded units (dp 3): the padding is never written, the HF tensors are exact.
  check_resume(zero(3, 3, "--steps 3 --batch 12"), single(batch_args(12, 1, 1)), "--batch 12");
}

// ----- HSDP (03a_hsdp.cu): ZeRO inside shard groups, replicated across them ------------------------

double comm_of(const Run& r, const char* group, const char* op, const char* which) {
  return r.log.summary.at("comm").at(group).at(op).at(which).as_double();
}

TEST_CASE("HSDP: every stage at dp 4 (2 × 2) and dp 8 (2 × 4, 4 × 2) reproduces 01; memory and bytes = formulas",
          "[03][03a][e2e][equiv][mem][comm]") {
  const Run& ref = single(batch_args(8, 1, 1));
  struct C { int stage, dp, shard, accum; };
  for (const C c : {C{1, 4, 2, 1}, C{2, 4, 2, 2}, C{3, 4, 2, 1}, C{3, 4, 2, 2}, C{3, 8, 4, 1}, C{1, 8, 2, 1}}) {
    const Run& h = zero(c.stage, c.dp, batch_args(8, c.dp, c.accum) + " --dp-shard " + std::to_string(c.shard));
    INFO("stage " << c.stage << " dp " << c.dp << " shard " << c.shard << " accumulation " << c.accum << "\n" << h.output);
    REQUIRE(h.log.steps.size() == size_t(kSteps));
    tst::check_equivalent(h, ref);
    // Memory is 03's formula over the shard group: a shard is Ψ/S, not Ψ/dp.
    const double shard = double(kPsi) / c.shard, pair = 2.0 * kLayer;
    for (const char* m : {"params", "grads", "optimizer"}) {
      INFO(m);
      CHECK(mem(h, m, "measured") == mem(h, m, "predicted"));
    }
    CHECK(mem(h, "optimizer", "measured") == 8 * shard);
    CHECK(mem(h, "params", "measured") == (c.stage < 3 ? 4.0 * kPsi : 4 * (shard + pair)));
    // Bytes: (S−1)/S·4Ψ reduce-scattered inside the group, 2(R−1)/R of the 4Ψ/S chunk across replicas.
    const double S = c.shard, R = double(c.dp) / c.shard, reductions = c.stage == 1 ? 1 : c.accum;
    CHECK(comm_of(h, "dp_shard", "reduce_scatter", "bytes") == (S - 1) / S * 4 * kPsi * reductions);
    CHECK(comm_of(h, "dp_replicate", "all_reduce", "bytes") == 2 * (R - 1) / R * 4 * kPsi / S * reductions);
    CHECK(comm_of(h, "dp_replicate", "all_reduce", "bytes") == comm_of(h, "dp_replicate", "all_reduce", "predicted"));
  }
}

TEST_CASE("HSDP: its checkpoints and plain ZeRO-3's are interchangeable", "[03][03a][e2e][ckpt]") {
  const Run& ref = single(batch_args(8, 1, 1));
  // HSDP (2 × 2) saves after step 3, plain ZeRO-1 at dp 2 resumes on 01's curve ...
  check_resume(zero(3, 4, "--steps 3 --batch 8 --dp-shard 2"), ref, "--batch 8");
  // ... and plain ZeRO-3 at dp 4 saves, HSDP resumes.
  tst::check_resume("03_zero", 4, kTiny + "--dp 4 --zero 3 --dp-shard 2 --steps 6 --batch 8", zero(3, 4, "--steps 3 --batch 8").ckpt,
                    ref, 3);
}

// ----- bad input ---------------------------------------------------------------------------------------

TEST_CASE("bad input: a clear message, a non-zero exit, no hang", "[03][errors]") {
  tst::check_errors("03_zero", kTiny + "--steps 2 ", {
      {2, "--dp 2 --zero 4", "--zero must be 1, 2 or 3"},
      {2, "--dp 4 --zero 1", "needs 4 ranks but the job has 2"},
      {2, "--dp 2 --zero 2 --batch 8 --micro-batch 3", "not divisible by dp × micro-batch"},
      {2, "--dp 2 --zero 3 --batch 7", "--batch 7 is not divisible"},
      {4, "--dp 4 --zero 3 --dp-shard 3", "--dp-shard 3 does not divide --dp (4 ranks)"},
      {2, "--dp 2 --zero 3 --dp-shard 1", "--dp-shard 1 shards nothing"},
  });
}
