// ranks: 1
// 02_data_parallel end to end: the same losses and weights as 01 at the same global batch (every
// dp degree, both modes, with and without accumulation, buckets from tiny to whole-model) and in
// bf16 by the bf16 bounds, the all-reduce bytes and calls against the formula, overlap and the
// trace, MFU per device, a checkpoint that changes dp on resume, and bad input. Each run is
// started once and shared between checks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "model/model.h"
#include "training/config_flags.h"
#include "test_util.h"
#include "training/train.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant ";
constexpr int kSteps = 6, kBatch = 16;

// Parameters of the tiny preset (dim 64, 2 layers, 4 heads / 2 kv, ffn 160, vocab 256):
// embedding 256·64 + 2·(q 64·64 + k,v 2·32·64 + o 64·64 + gate,up,down 3·160·64 + 2 norms·64)
// + final norm 64 + lm_head 256·64 = 16384 + 2·43136 + 64 + 16384.
constexpr int64_t kPsi = 119104;
constexpr int kTensors = 21;  // embed, 2 × 9 per layer, final norm, lm_head

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent). Its gradient norms
// matter here: AdamW is blind to a constant gradient scale (m/√v, and clipping rescales to the
// same norm), so a wrong averaging factor (a sum instead of a mean) would leave losses and weights
// intact; the norm before clipping exposes it.

// Runs a binary once per (binary, ranks, flags) and keeps the result, so test cases share runs
// whatever order (or subset) Catch2 runs them in.
using Run = tst::CachedRun;
const Run& run(const std::string& bin, const std::string& args, int np) { return tst::cached_run(bin, np, kTiny + args); }

const Run& ref01() { return run("01_single_gpu", "--steps 6 --batch 16", 1); }

// 02 at `dp` ranks on the global batch kBatch, `acc` micro-batches per rank per step.
const Run& dp_run(int dp, const std::string& mode, const std::string& bucket_mb, int acc) {
  const int mb = kBatch / dp / acc;
  return run("02_data_parallel",
             "--steps " + std::to_string(kSteps) + " --batch " + std::to_string(kBatch) + " --dp " + std::to_string(dp) +
                 " --micro-batch " + std::to_string(mb) + " --dp-mode " + mode + " --bucket-mb " + bucket_mb,
             dp);
}

void check_matches_01(const Run& r) {
  CHECK(tst::read_tensors(r.ckpt + "/model.safetensors").size() == size_t(kTensors));
  tst::check_equivalent(r, ref01());
}

// Buckets cut by 02: ceil(Ψ / floor(MiB · 2^20 / 4)) ranges of the flat fp32 gradient buffer.
long expected_buckets(double mb) {
  const int64_t size = std::max<int64_t>(1, int64_t(mb * 1024 * 1024 / 4));
  return long((kPsi + size - 1) / size);
}

const ts::Json& allreduce(const Run& r) { return r.log.summary.at("comm").at("dp").at("all_reduce"); }

}  // namespace

// ----- equivalence with 01 ------------------------------------------------------------------------

// 0.001 MiB = 262 floats, smaller than every weight matrix (455 buckets); 0.1 MiB = 5 buckets;
// 25 MiB is larger than the whole model (0.45 MiB): one bucket.
TEST_CASE("dp 2, 4, 8 × naive/bucketed × accumulation 1, 2 reproduce 01's losses and weights", "[02][e2e]") {
  const int dp = GENERATE(2, 4, 8);
  const int acc = GENERATE(1, 2);
  for (const char* mode : {"naive:25", "bucketed:0.001", "bucketed:0.1", "bucketed:25"}) {
    const std::string m(mode);
    const std::string name = m.substr(0, m.find(':')), mb = m.substr(m.find(':') + 1);
    INFO("dp " << dp << ", accumulation " << acc << ", " << name << " bucket-mb " << mb);
    check_matches_01(dp_run(dp, name, mb, acc));
  }
}

// bf16 weights and activations with fp32 gradients: a sum split over ranks or micro-batches can
// land on the other side of a bf16 rounding boundary, so the runs agree by the bf16 bounds
// (test_util.h), not fp32's.
TEST_CASE("bf16: dp 2 and dp 4 with accumulation reproduce 01 bf16 by the bf16 bounds", "[02][e2e][bf16]") {
  const Run& ref = run("01_single_gpu", "--steps 8 --batch 8 --dtype bf16", 1);
  for (auto [dp, mb] : {std::pair{2, 4}, std::pair{4, 1}}) {
    const Run& d = run("02_data_parallel", "--steps 8 --batch 8 --dtype bf16 --dp " + std::to_string(dp) +
                                               " --micro-batch " + std::to_string(mb), dp);
    INFO("dp " << dp << ", micro-batch " << mb);
    tst::check_equivalent(d, ref, tst::bf16_bounds(8 * 32));
    CHECK(d.log.losses().back() < d.log.losses().front() - 0.3);
  }
}

// ----- communication ------------------------------------------------------------------------------

TEST_CASE("all-reduce bytes per step equal 2(N-1)/N·4Ψ exactly; calls = tensors (naive) or buckets", "[02][comm]") {
  for (int dp : {2, 4})
    for (const char* mode : {"naive:25", "bucketed:0.001", "bucketed:0.1", "bucketed:25"}) {
      const std::string m(mode);
      const std::string name = m.substr(0, m.find(':')), mb = m.substr(m.find(':') + 1);
      INFO("dp " << dp << " " << mode);
      const Run& r = dp_run(dp, name, mb, 1);
      const ts::Json& ar = allreduce(r);
      const double formula = 2.0 * (dp - 1) / dp * 4.0 * double(kPsi);  // ring: reduce-scatter + all-gather
      CHECK(ar.at("bytes").as_double() == formula);
      CHECK(ar.at("predicted").as_double() == formula);
      CHECK(ar.at("payload_bytes").as_double() == 4.0 * double(kPsi));  // the whole gradient, once
      const long calls = expected_buckets(std::stod(mb));
      if (name == "naive") {
        CHECK(ar.at("calls").as_double() == kTensors);
        CHECK(tst::read_tensors(r.ckpt + "/model.safetensors").size() == size_t(kTensors));
      } else {
        CHECK(ar.at("calls").as_double() == calls);
        CHECK(r.output.find(std::to_string(calls) + " gradient buckets") != std::string::npos);
      }
    }
  CHECK(expected_buckets(0.001) == 455);
  CHECK(expected_buckets(25) == 1);
}

// The step-time line (notes/08): measured is the median of the steps after the warm-up one; with a
// calibration beside the binaries (make bench writes one) the predicted terms add up to the total.
TEST_CASE("every run reports its step time: the median after warm-up, next to the prediction", "[02][time]") {
  for (int dp : {2, 4}) {
    INFO("dp " << dp);
    const Run& r = dp_run(dp, "bucketed", "25", 1);
    const ts::Json& t = r.log.summary.at("step_time");
    std::vector<double> rest;
    for (size_t i = 1; i < r.log.steps.size(); i++) rest.push_back(r.log.steps[i].at("step_ms").as_double() / 1e3);
    REQUIRE(rest.size() == kSteps - 1);
    std::sort(rest.begin(), rest.end());
    CHECK(t.at("measured_s").as_double() == Approx(rest[rest.size() / 2]).epsilon(1e-9));
    CHECK(r.output.find("step time: ") != std::string::npos);
    if (!t.contains("predicted_s")) {
      CHECK(r.output.find("not predicted: no calibration of this machine") != std::string::npos);
      continue;
    }
    CHECK(t.at("compute_s").as_double() + t.at("dp_exposed_s").as_double() == Approx(t.at("predicted_s").as_double()));
    CHECK(t.at("dp_exposed_s").as_double() <= t.at("dp_s").as_double());
  }
}

TEST_CASE("gradient accumulation communicates once per step: accumulation 4 = accumulation 1", "[02][comm]") {
  for (const char* mode : {"naive", "bucketed"}) {
    INFO(mode);
    const ts::Json& a1 = allreduce(dp_run(4, mode, "0.1", 1));  // micro-batch 4
    const ts::Json& a4 = allreduce(dp_run(4, mode, "0.1", 4));  // micro-batch 1, four per step
    CHECK(a4.at("calls").as_double() == a1.at("calls").as_double());
    CHECK(a4.at("bytes").as_double() == a1.at("bytes").as_double());
    CHECK(a4.at("calls").as_double() == (std::string(mode) == "naive" ? kTensors : expected_buckets(0.1)));
  }
  check_matches_01(dp_run(4, "bucketed", "0.1", 4));
}

// ----- overlap ------------------------------------------------------------------------------------

TEST_CASE("hidden fraction: in (0, 1] when bucketed, exactly 0 when naive", "[02][overlap]") {
  for (int dp : {2, 4}) {
    INFO("dp " << dp);
    for (const char* mb : {"0.001", "0.1", "25"}) {
      // The first bucket starts before finish() waits, so some communication time is always
      // behind compute, however little.
      const double h = dp_run(dp, "bucketed", mb, 1).log.summary.at("comm_hidden_fraction").as_double();
      INFO("bucket-mb " << mb << " hidden " << h);
      CHECK(h > 0);
      CHECK(h <= 1);
    }
    CHECK(dp_run(dp, "naive", "25", 1).log.summary.at("comm_hidden_fraction").as_double() == 0);
  }
}

TEST_CASE("--trace: one JSON file, every rank, compute and comm lanes, bucket all-reduces during backward",
          "[02][overlap][trace]") {
  const std::string path = tst::scratch("dp_trace.json");
  const int steps = 2, dp = 2;
  tst::Result r = tst::run_bin("02_data_parallel",
                               kTiny + "--dp 2 --batch 8 --steps 2 --bucket-mb 0.001 --trace " + path, dp, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  const ts::Json t = ts::Json::parse(ts::read_text_file(path));
  const ts::Json& ev = t.at("traceEvents");
  REQUIRE(ev.is_array());
  std::set<std::pair<int64_t, int64_t>> lanes;
  std::map<int64_t, int> buckets, overlapping;
  for (const ts::Json& e : ev.as_array()) {
    if (e.at("ph").as_string() != "X") continue;
    lanes.insert({e.at("pid").as_int(), e.at("tid").as_int()});
    if (e.at("tid").as_int() != 1) continue;
    buckets[e.at("pid").as_int()]++;
    // Does this all-reduce's interval intersect a backward layer on the same rank?
    const double s = e.at("ts").as_double(), f = s + e.at("dur").as_double();
    for (const ts::Json& c : ev.as_array())
      if (c.at("ph").as_string() == "X" && c.at("pid") == e.at("pid") && c.at("tid").as_int() == 0 &&
          c.at("name").as_string().rfind("bwd layer", 0) == 0 && c.at("ts").as_double() < f &&
          s < c.at("ts").as_double() + c.at("dur").as_double()) {
        overlapping[e.at("pid").as_int()]++;
        break;
      }
  }
  for (int64_t rank = 0; rank < dp; rank++) {
    INFO("rank " << rank);
    CHECK(lanes.count({rank, 0}) == 1);  // compute
    CHECK(lanes.count({rank, 1}) == 1);  // comm
    CHECK(buckets[rank] == steps * expected_buckets(0.001));  // one event per bucket per step
    CHECK(overlapping[rank] > 0);  // measured: ~650 of 910 on each rank
  }
}

// ----- the step log -------------------------------------------------------------------------------

// tokens/s counts the whole job's tokens; the peak is one device's. At dp 2 a per-device MFU is
// half the job's FLOP rate over one peak (a wrong one reads twice as high).
TEST_CASE("MFU is per device: FLOPs per token × tokens/s over (ranks × peak)", "[02][mfu]") {
  const double peak_tflops = 0.5;
  const Run& r = run("02_data_parallel", "--steps 3 --batch 16 --dp 2 --peak-tflops 0.5", 2);
  ts::ModelConfig tiny;
  REQUIRE(ts::apply_preset("tiny", tiny));
  const double flops = ts::flops_per_token(tiny);
  REQUIRE(r.log.steps.size() == 3);
  for (const ts::Json& s : r.log.steps) {
    const double expected = flops * s.at("tokens_per_s").as_double() / (2 * peak_tflops * 1e12);
    INFO("step " << s.at("step").as_int() << ": mfu " << s.at("mfu").as_double() << ", expected " << expected);
    CHECK(expected > 0);
    CHECK(std::fabs(s.at("mfu").as_double() - expected) <= 1e-9 * expected);  // the same arithmetic
  }
}

// ----- checkpoints across meshes ----------------------------------------------------------------

TEST_CASE("a checkpoint saved at dp 4 resumes at dp 2 and continues 01's curve", "[02][e2e][ckpt]") {
  const Run& half = run("02_data_parallel", "--steps 3 --batch 16 --dp 4", 4);
  const Run& rest = run("02_data_parallel", "--steps 6 --batch 16 --dp 2 --resume " + half.ckpt, 2);
  CHECK(ts::Json::parse(ts::read_text_file(half.ckpt + "/trainer.json")).at("step").as_int() == 3);
  REQUIRE(half.log.steps.size() == 3);
  REQUIRE(rest.log.steps.size() == 3);
  CHECK(rest.log.steps.front().at("step").as_int() == 3);
  const std::vector<double> want = ref01().log.losses();
  CHECK(tst::max_rel_diff(half.log.losses(), std::vector<double>(want.begin(), want.begin() + 3)) <= tst::equiv::kLossRel);
  tst::check_resume("02_data_parallel", 2, kTiny + "--steps 6 --batch 16 --dp 2", half.ckpt, ref01(), 3);
}

// ----- bad input ----------------------------------------------------------------------------------

TEST_CASE("bad input: a clear message from rank 0, a non-zero exit, no hang", "[02][errors]") {
  tst::check_errors("02_data_parallel", kTiny + "--steps 2 ", {
      {4, "--dp 4 --batch 10", "--batch 10 is not divisible by"},
      {4, "--dp 4 --batch 8 --micro-batch 3", "not divisible by dp × micro-batch = 4 × 3"},
      {2, "--dp 4 --batch 8", "needs 4 ranks but the job has 2"},
      {4, "--dp 2 --batch 8", "needs 2 ranks but the job has 4"},
      {2, "--dp 2 --dp-mode ring", "--dp-mode must be naive or bucketed (got 'ring')"},
      {2, "--dp 2 --bucket-mb 0", "--bucket-mb expects a finite number in (0, 1048576], got '0'"},
  });
}

TEST_CASE("bad input: fewer sequences than ranks, or dp 0, is a message, not a crash", "[02][errors]") {
  // The default micro-batch is batch/dp, which is 0 here; the divisibility check must not divide by it.
  struct Case {
    int np;
    std::string args, message;
  } cases[] = {
      {4, "--dp 4 --batch 2", "--batch 2"},
      {1, "--dp 0", "dp"},
      {4, "--dp 4 --batch 0", "--batch"},
  };
  for (const Case& c : cases) {
    tst::Result r = tst::run_bin("02_data_parallel", kTiny + "--steps 2 " + c.args, c.np, 60);
    INFO("mpirun -np " << c.np << " " << c.args << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.status < 128);  // exited, not killed by a signal (SIGFPE)
    CHECK(r.output.find("Floating point exception") == std::string::npos);
    CHECK(r.output.find("error") != std::string::npos);
    CHECK(r.output.find(c.message) != std::string::npos);
  }
}
