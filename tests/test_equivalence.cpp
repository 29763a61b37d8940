// ranks: 1
// The equivalence criterion itself (tests/test_util.h, derived in notes/00_architecture.md):
// AdamW's per-step bound and the initial weights it relies on; three real bugs, each linked into a
// variant of its technique binary (tests/bugs/), each failing it (and the bf16 criterion) by a wide
// margin while the same run without the bug passes; and the thread count, which must not change a
// single bit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --kv-heads 4 --quiet --lr-schedule constant ";
using Run = tst::CachedRun;
const Run& run(const std::string& bin, int np, const std::string& args) {
  return tst::cached_run(bin, np, kTiny + args, 180);
}
const Run& single(int batch, int micro) { return run("01_single_gpu", 1, tst::steps_args(6, batch, micro)); }

using tst::worst_ratio;
// The worst measure over its bf16 bound (256-token steps).
double worst_ratio_bf16(const tst::Equivalence& e) { return worst_ratio(e, tst::bf16_bounds(256)); }

}  // namespace

TEST_CASE("AdamW's per-step bound: 1 at step 1, reached by a worst-case history, never exceeded", "[equiv]") {
  CHECK(tst::adam_step_bound(0.9, 0.95, 1) == Approx(1.0).epsilon(1e-15));
  // By hand at t = 2: 0.1/0.19 · √(0.0975/0.05) · √(1 + 0.81/0.95) = 1.000442...
  CHECK(tst::adam_step_bound(0.9, 0.95, 2) == Approx(0.1 / 0.19 * std::sqrt(1.95) * std::sqrt(1 + 0.81 / 0.95)));
  // Random gradient histories stay below it, and the Cauchy–Schwarz equality case g_k ∝ (β1/β2)^(t−k)
  // reaches it.
  const double b1 = 0.9, b2 = 0.95;
  std::mt19937 gen(7);
  std::normal_distribution<double> nd;
  for (int t = 1; t <= 12; t++) {
    auto ratio = [&](const std::vector<double>& g) {
      double m = 0, v = 0;
      for (double x : g) m = b1 * m + (1 - b1) * x, v = b2 * v + (1 - b2) * x * x;
      return std::fabs(m / (1 - std::pow(b1, t))) / std::sqrt(v / (1 - std::pow(b2, t)));
    };
    double worst = 0;
    for (int k = 0; k < 2000; k++) {
      std::vector<double> g(static_cast<size_t>(t));
      for (double& x : g) x = nd(gen) * std::exp(2 * nd(gen));
      worst = std::max(worst, ratio(g));
    }
    std::vector<double> extreme(static_cast<size_t>(t));
    for (int k = 0; k < t; k++) extreme[size_t(k)] = std::pow(b1 / b2, t - 1 - k);
    INFO("t " << t);
    CHECK(worst <= tst::adam_step_bound(b1, b2, t) * (1 + 1e-12));
    CHECK(ratio(extreme) == Approx(tst::adam_step_bound(b1, b2, t)).epsilon(1e-12));
  }
}

// The criterion measures the update from the initial weights: they must be the model's. After one
// AdamW step an element with a gradient (|g| ≫ ε; exp_avg ≠ 0) has moved by lr·(±1 + wd·w0), so
// |w1 − w0| ≈ lr; embedding rows of tokens absent from the batch only decay.
TEST_CASE("initial_weights are the weights a run starts from", "[equiv]") {
  const Run& r = single(8, 8);
  const double lr = r.log.steps[0].at("lr").as_double();
  const auto m = tst::read_tensors(r.first + "/optimizer.safetensors");
  std::map<std::string, std::vector<float>> exp_avg;
  for (auto& [name, v] : m)
    if (name.rfind("exp_avg.", 0) == 0) exp_avg[name.substr(8)] = v;
  for (auto& [name, w1] : tst::read_tensors(r.first + "/model.safetensors")) {
    if (name.find("norm") != std::string::npos) continue;
    const std::vector<float> w0 = tst::initial_weights(name, w1.size(), 1337);
    const std::vector<float>& g = exp_avg.at(name);
    std::vector<double> moved;
    for (size_t i = 0; i < w1.size(); i++)
      if (g[i] != 0) moved.push_back(std::fabs(double(w1[i]) - w0[i]));
    INFO(name);
    REQUIRE(moved.size() >= 1000);
    std::nth_element(moved.begin(), moved.begin() + long(moved.size() / 2), moved.end());
    CHECK(moved[moved.size() / 2] == Approx(lr).epsilon(1e-3));
  }
}

// Each seeded bug against the same mesh without it: the variant BIN+BUG of the binary (the Makefile's
// SEEDED_BUGS) says when its bug fires. The margins are printed (WARN) for the notes.
struct Bug {
  const char* name;
  std::string bin;
  int np;
  std::string args;
  int batch, micro;
};
const Bug kBugs[] = {
    {"drop_microbatch", "02_data_parallel", 2, "--dp 2 ", 8, 2},  // two micro-batches per rank, the first lost
    {"swap_fg", "04_tensor_parallel", 2, "--tp 2 ", 8, 8},        // f and g exchanged in layer 0's MLP backward
    {"stale_shard", "03_zero", 2, "--dp 2 --zero 1 ", 8, 4},      // the last rank never updates layer 0's shard
};

TEST_CASE("three seeded bugs fail the criterion by a wide margin; the same runs without them pass", "[equiv][e2e]") {
  for (const Bug& b : kBugs) {
    const Run& ref = single(b.batch, b.batch);
    const std::string args = b.args + tst::steps_args(6, b.batch, b.micro);
    const tst::Equivalence good = tst::compare(run(b.bin, b.np, args), ref);
    const Run& buggy = run("tests/bugs/" + b.bin + "+" + b.name, b.np, args);
    const tst::Equivalence bad = tst::compare(buggy, ref);
    INFO(b.name << "\n  without: " << good << "\n  with: " << bad);
    WARN(b.name << ": worst measure/bound " << worst_ratio(bad) << " with the bug, " << worst_ratio(good)
                << " without; step-1 grad " << bad.grad_rel << ", update " << bad.update_rel << ", loss "
                << bad.loss_rel);
    CHECK(buggy.output.find(std::string("deliberate bug ") + b.name) != std::string::npos);
    CHECK(tst::equivalent(good));
    CHECK_FALSE(tst::equivalent(bad));
    CHECK(worst_ratio(bad) >= 30);
  }
}

// The bf16 bounds are wider than fp32's by the ratio of the two formats' rounding: they must still
// catch each bug, and pass the same runs without it.
TEST_CASE("the three seeded bugs fail the bf16 criterion too; the same runs without them pass it", "[equiv][e2e][bf16]") {
  for (const Bug& b : kBugs) {
    const std::string args = b.args + tst::steps_args(6, b.batch, b.micro) + " --dtype bf16";
    const Run& ref = run("01_single_gpu", 1, tst::steps_args(6, b.batch, b.batch) + " --dtype bf16");
    const tst::Equivalence good = tst::compare(run(b.bin, b.np, args), ref);
    const tst::Equivalence bad = tst::compare(run("tests/bugs/" + b.bin + "+" + b.name, b.np, args), ref);
    INFO(b.name << "\n  without: " << good << "\n  with: " << bad);
    WARN(b.name << " (bf16): worst measure/bound " << worst_ratio_bf16(bad) << " with the bug, "
                << worst_ratio_bf16(good) << " without");
    CHECK(worst_ratio_bf16(good) <= 1);
    CHECK(worst_ratio_bf16(bad) >= 10);
  }
}

// OpenMP threads split work by rows and never split a sum; a matmul is cut into panels chosen from
// its shape, each one single-threaded sgemm, and attention into work units that one thread owns:
// the thread count must not change a bit of the losses or the weights. The shape makes every kind
// of split real: 640 tokens give matmuls of 4 row panels, the MLP's 288-wide weight gradients take
// 2 panels (rows for gate and up, columns for down), and batch 4 × 2 kv heads give attention 8
// (sequence, kv head) units, each with seq 160's causal blocks (8 query rows forward, 32 backward).
// In bf16 the matmuls take this CPU's bf16 path (kernels_bf16.h: AMX, AVX512-BF16 or widening),
// whose blocks of C are chosen from the shape too.
TEST_CASE("01 gives the same bits at 1, 2 and 4 threads, in fp32 and in bf16", "[equiv][threads]") {
  for (const char* dtype : {"fp32", "bf16"}) {
    const std::string args = "--steps 3 --seq 160 --ffn 288 --batch 4 --micro-batch 4 --dtype " + std::string(dtype) + " ";
    const Run& one = run("01_single_gpu", 1, args + "--threads 1");
    for (int t : {2, 4}) {
      const Run& many = run("01_single_gpu", 1, args + "--threads " + std::to_string(t));
      INFO(dtype << ", " << t << " threads");
      CHECK(many.log.losses() == one.log.losses());
      CHECK(tst::max_abs_diff_files(many.ckpt + "/model.safetensors", one.ckpt + "/model.safetensors") == 0.0);
      CHECK(tst::max_abs_diff_files(many.ckpt + "/optimizer.safetensors", one.ckpt + "/optimizer.safetensors") == 0.0);
    }
  }
}
