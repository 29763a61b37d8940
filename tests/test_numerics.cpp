// ranks: 1
// The numerics a run watches (numerics.h): a NaN written into layer k's backward is reported as
// layer k, on one device and across the mesh; a poisoned batch is caught as a spike and the demo
// run raises none; --on-spike skip leaves weights and optimizer state bit-identical to the step
// before; --on-spike rewind reloads the last checkpoint and skips the batches since, equal bit
// for bit to an operator's resume with --skip-batches; the per-unit statistics add up to the
// run's gradient norm and do not depend on the mesh; bad flags are refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <sstream>

#include "test_util.h"

using namespace ts;

namespace {

// A constant learning rate: runs of different lengths take the same steps.
const std::string kTiny = "--preset tiny --lr-schedule constant --quiet ";

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

std::string bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Both checkpoint files, byte for byte (their safetensors headers hold names and shapes only).
void check_same_state(const std::string& a, const std::string& b) {
  for (const char* f : {"/model.safetensors", "/optimizer.safetensors"}) {
    INFO(a << f << " vs " << b << f);
    const std::string x = bytes_of(a + f), y = bytes_of(b + f);
    REQUIRE(!x.empty());
    CHECK(x == y);
  }
}

std::vector<Json> events(const tst::Log& l) { return l.events; }

tst::Result run_logged(const std::string& bin, int np, const std::string& args, const std::string& log) {
  tst::Result r = tst::run_bin(bin, kTiny + args + " --log-json " + log, np, 240);
  INFO(bin << " " << args << "\n" << r.output);
  return r;
}

}  // namespace

TEST_CASE("a NaN injected into layer k's backward is reported as layer k, on every mesh", "[numerics][nonfinite]") {
  struct Case {
    std::string bin;
    int np;
    std::string mesh;
    int layer;
  };
  for (const Case& c : {Case{"01_single_gpu", 1, "", 1}, Case{"01_single_gpu", 1, "", 0},
                        Case{"02_data_parallel", 2, "--dp 2", 1}, Case{"04_tensor_parallel", 2, "--tp 2", 0},
                        Case{"05_pipeline_parallel", 2, "--pp 2", 0}, Case{"05_pipeline_parallel", 2, "--pp 2", 1}}) {
    const std::string args = kTiny + c.mesh + " --steps 5 --batch 8 --micro-batch 4 --inject-nan 3:" +
                             std::to_string(c.layer);
    tst::Result r = tst::run_bin(c.bin, args, c.np, 120);
    INFO(c.bin << " " << args << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.status != 124);
    CHECK(has(r.output, "step 3 diverged"));
    CHECK(has(r.output, "the update was not applied"));
    CHECK(has(r.output, "the first non-finite value is rank "));
    CHECK(has(r.output, "the gradient w.r.t. the input of layer " + std::to_string(c.layer) + " (unit " +
                            std::to_string(c.layer + 1) + "), in backward"));
    CHECK(!has(r.output, "step 4/"));
  }
}

TEST_CASE("a poisoned batch is a spike; the demo run has none", "[numerics][spike]") {
  const std::string log = tst::scratch("spike.jsonl");
  tst::Result r = run_logged("01_single_gpu", 1, "--steps 12 --spike-window 8 --poison-batch 10", log);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "spike at step 10: grad norm"));
  const std::vector<Json> ev = events(tst::read_log(log));
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].at("step").as_int() == 10);
  CHECK(ev[0].at("grad_norm_spike").as_bool());
  CHECK(ev[0].at("grad_norm").as_double() > 100 * ev[0].at("grad_norm_threshold").as_double() / 6);
  CHECK(ev[0].at("action").as_string() == "report");
  // The demo as a user runs it (its own schedule, 6 sigma), tested from step 10 on: the default
  // window of 128 would not be full within its 50 steps.
  const std::string demo = tst::scratch("demo.jsonl");
  tst::Result d = tst::run_bin("01_single_gpu", "--preset tiny --quiet --spike-window 10 --log-json " + demo, 1, 240);
  INFO(d.output);
  REQUIRE(d.status == 0);
  CHECK(!has(d.output, "spike"));
  CHECK(events(tst::read_log(demo)).empty());
  CHECK(tst::read_log(demo).steps.size() == 50);
}

TEST_CASE("--on-spike skip leaves weights and optimizer state as the step before left them", "[numerics][skip]") {
  struct Case {
    std::string bin;
    int np;
    std::string mesh;
  };
  for (const Case& c : {Case{"01_single_gpu", 1, ""}, Case{"02_data_parallel", 2, "--dp 2"},
                        Case{"03_zero", 2, "--dp 2 --zero 3"}, Case{"05_pipeline_parallel", 2, "--pp 2"}}) {
    const std::string base = c.mesh + " --batch 8 --micro-batch 4 --spike-window 4 ";
    const std::string a = tst::scratch(c.bin + "_before"), b = tst::scratch(c.bin + "_skipped");
    const std::string log = tst::scratch(c.bin + "_skip.jsonl");
    REQUIRE(run_logged(c.bin, c.np, base + "--steps 6 --save " + a, tst::scratch("x.jsonl")).status == 0);
    tst::Result r = run_logged(c.bin, c.np, base + "--steps 7 --poison-batch 6 --on-spike skip --save " + b, log);
    REQUIRE(r.status == 0);
    CHECK(has(r.output, "spike at step 6"));
    CHECK(has(r.output, "update skipped"));
    check_same_state(a, b);
    const std::vector<Json> ev = events(tst::read_log(log));
    REQUIRE(ev.size() == 1);
    CHECK(ev[0].at("action").as_string() == "skip");
  }
}

TEST_CASE("--on-spike rewind reloads the checkpoint and skips the batches since", "[numerics][rewind]") {
  struct Case {
    std::string bin;
    int np;
    std::string mesh;
  };
  for (const Case& c : {Case{"01_single_gpu", 1, ""}, Case{"03_zero", 2, "--dp 2 --zero 3"}}) {
    const std::string base = c.mesh + " --batch 8 --micro-batch 4 --spike-window 4 --steps 12 ";
    const std::string rw = tst::scratch(c.bin + "_rewound"), log = tst::scratch(c.bin + "_rewind.jsonl");
    // A spike at step 9; checkpoints at steps 4 and 8: back to 8, batches 8 and 9 skipped.
    tst::Result r =
        run_logged(c.bin, c.np, base + "--poison-batch 9 --on-spike rewind --save-every 4 --save " + rw, log);
    REQUIRE(r.status == 0);
    CHECK(has(r.output, "spike at step 9"));
    CHECK(has(r.output, "rewind: weights and optimizer state of step 8 loaded from " + rw + "; batches 8..9 skipped"));
    const tst::Log l = tst::read_log(log);
    const std::vector<Json> ev = events(l);
    REQUIRE(ev.size() == 2);
    CHECK(ev[1].at("event").as_string() == "rewind");
    CHECK(ev[1].at("to_step").as_int() == 8);
    CHECK(ev[1].at("skipped_batches").dump() == "[[8,2]]");
    CHECK(l.summary.at("steps_done").as_int() == 12);
    // The operator's remedy by hand: resume the step-8 checkpoint, skip two batches from step 8.
    const std::string hand = tst::scratch(c.bin + "_by_hand");
    REQUIRE(run_logged(c.bin, c.np, base + "--save-every 8 --keep-last 3 --save " + hand, tst::scratch("y.jsonl"))
                .status == 0);
    const std::string resumed = tst::scratch(c.bin + "_resumed");
    REQUIRE(run_logged(c.bin, c.np, base + "--resume " + tst::step_checkpoint(hand, 8) + " --skip-batches 8:2 --save " +
                                        resumed, tst::scratch("z.jsonl"))
                .status == 0);
    check_same_state(rw, resumed);
    // The skips travel in trainer.json: a resume of the rewound run's checkpoint keeps them.
    CHECK(has(bytes_of(rw + "/trainer.json"), "\"skipped_batches\""));
  }
}

TEST_CASE("--numerics-every: per-unit norms add up to the gradient norm, whatever the mesh", "[numerics][stats]") {
  const std::string args = "--steps 4 --batch 8 --micro-batch 4 --numerics-every 2 ";
  std::vector<std::vector<double>> rms_of;
  for (auto [bin, np, mesh] : {std::tuple{"01_single_gpu", 1, ""}, std::tuple{"02_data_parallel", 2, "--dp 2"},
                               std::tuple{"04_tensor_parallel", 2, "--tp 2"},
                               std::tuple{"05_pipeline_parallel", 2, "--pp 2"}}) {
    const std::string log = tst::scratch(std::string(bin) + "_stats.jsonl");
    REQUIRE(run_logged(bin, np, std::string(mesh) + " " + args, log).status == 0);
    const tst::Log l = tst::read_log(log);
    REQUIRE(l.steps.size() == 4);
    for (size_t s = 0; s < 4; s++) {
      INFO(bin << " step " << s);
      REQUIRE(l.steps[s].contains("numerics") == (s % 2 == 0));
      if (s % 2) continue;
      const Json& n = l.steps[s].at("numerics");
      REQUIRE(n.at("grad_norm").size() == 4);  // embedding, 2 layers, head
      REQUIRE(n.at("act_rms").size() == 3);    // embedding and each layer's output
      double sq = 0;
      for (size_t u = 0; u < 4; u++) sq += std::pow(n.at("grad_norm")[u].as_double(), 2);
      CHECK(std::sqrt(sq) == Approx(l.steps[s].at("grad_norm").as_double()).epsilon(1e-12));
      std::vector<double> rms;
      for (size_t u = 0; u < 3; u++) rms.push_back(n.at("act_rms")[u].as_double());
      for (size_t u = 0; u < 4; u++) rms.push_back(n.at("grad_norm")[u].as_double());
      if (s == 0) rms_of.push_back(rms);
    }
  }
  // Step 0's statistics come from identical weights: equal to 01's within the fp32 gradient bound.
  for (size_t m = 1; m < rms_of.size(); m++) CHECK(tst::max_rel_diff(rms_of[m], rms_of[0]) < tst::equiv::kGradRel);
}

TEST_CASE("numerics flags: bad values are refused", "[numerics][errors]") {
  tst::check_errors("01_single_gpu", kTiny + "--steps 2 ",
                    {{1, "--on-spike rewind", "--on-spike rewind needs checkpoints to rewind to"},
                     {1, "--on-spike rewind --save /tmp/ts_nowhere", "--on-spike rewind needs checkpoints"},
                     {1, "--on-spike sometimes", "--on-spike must be report, stop, skip or rewind"},
                     {1, "--on-spike skip --spike-window 0", "needs spike detection"},
                     {1, "--skip-batches 3", "--skip-batches wants FROM:COUNT"},
                     {1, "--skip-batches 3:0", "--skip-batches wants FROM:COUNT"},
                     {1, "--skip-batches 3:2,x", "--skip-batches wants FROM:COUNT"},
                     {1, "--inject-nan 1:7", "--inject-nan wants STEP:LAYER with 0 <= LAYER < --layers 2"},
                     {2, "--inject-nan 1", "--inject-nan wants STEP:LAYER"},
                     {1, "--poison-batch -2", "--poison-batch"}});
  // --on-spike stop ends the run on every rank with the spike named.
  tst::Result r = tst::run_bin("02_data_parallel", kTiny + "--dp 2 --steps 8 --spike-window 4 --poison-batch 6 "
                               "--on-spike stop", 2, 120);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.status != 124);
  CHECK(has(r.output, "spike at step 6: grad norm"));
  CHECK(has(r.output, "--on-spike stop ended the run"));
}
