// ranks: 1
// The fake world (common/comm/fake_world.h) and the shape-only device (common/tensor/shape_only.h):
// rank R of an N-rank job, run alone with --device shape --fake-world N --fake-rank R, measures
// the same peak per memory category as rank R of the real mpirun job, byte for byte, for every
// chapter (a pipeline's first stage and its last), and counts the same bytes per collective; bad
// input is one clear error.
#include <catch2/catch.hpp>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --kv-heads 4 --layers 4 --steps 2 --batch 8 --quiet ";
const char* kCategories[] = {"params", "grads", "optimizer", "activations", "comm", "workspace"};

struct Case {
  std::string bin;
  int np;
  std::string flags;
};
// Every chapter at a small mesh; 08 with dp × tp × pp, ZeRO-1 and SP (rank 7: the last stage).
const Case kCases[] = {
    {"01_single_gpu", 1, ""},
    {"02_data_parallel", 2, "--dp 2"},
    {"03_zero", 2, "--dp 2 --zero 3"},
    {"04_tensor_parallel", 2, "--tp 2 --sequence-parallel"},
    {"05_pipeline_parallel", 2, "--pp 2 --micro-batch 1"},
    {"05_pipeline_parallel", 2, "--pp 2 --schedule interleaved --virtual-stages 2 --micro-batch 1"},
    {"06_context_parallel", 2, "--cp 2"},
    {"08_5d_mesh", 8, "--dp 2 --tp 2 --pp 2 --micro-batch 1 --zero 1 --sequence-parallel"},
};

tst::Log run_logged(const std::string& bin, int np, const std::string& args) {
  tst::TempDir d;
  const std::string log = d.file("log.jsonl");
  tst::Result r = tst::run_bin(bin, args + " --log-json " + log, np, 180);
  INFO(bin << " " << args << "\n" << r.output);
  REQUIRE(r.status == 0);
  return tst::read_log(log);
}

// Rank r's peak of `cat`: the summary's table (rank 0's, or a fake world's rank) or the real job's
// "ranks" list.
int64_t peak(const ts::Json& memory, int r, const char* cat, bool from_ranks) {
  if (from_ranks) return int64_t(memory.at("ranks")[size_t(r)].at(cat).as_double());
  return int64_t(memory.at(cat).at("measured").as_double());
}

}  // namespace

TEST_CASE("a fake world's rank measures the real job's rank's memory, byte for byte, in every chapter") {
  for (const Case& c : kCases) {
    const tst::Log real = run_logged(c.bin, c.np, kTiny + c.flags);
    for (int r : {0, c.np - 1}) {
      const std::string fake_args = kTiny + c.flags + " --device shape --fake-world " + std::to_string(c.np) +
                                    " --fake-rank " + std::to_string(r);
      const tst::Log fake = run_logged(c.bin, 1, fake_args);
      INFO(c.bin << " " << c.flags << ", rank " << r << " of " << c.np);
      for (const char* cat : kCategories) {
        INFO(cat);
        CHECK(peak(fake.summary.at("memory"), r, cat, false) == peak(real.summary.at("memory"), r, cat, c.np > 1));
      }
      CHECK(fake.summary.at("memory").at("params").at("measured").as_double() > 0);
      // No losses from tensors without values.
      REQUIRE(!fake.steps.empty());
      CHECK(!fake.steps[0].contains("loss"));
    }
    // Bytes per collective: rank 0's groups and ops, counted as the real job counts them.
    if (c.np > 1) {
      const tst::Log fake = run_logged(c.bin, 1, kTiny + c.flags + " --device shape --fake-world " + std::to_string(c.np));
      const ts::Json& rc = real.summary.at("comm");
      const ts::Json& fc = fake.summary.at("comm");
      for (const auto& [group, ops] : rc.items())
        for (const auto& [op, stats] : ops.items()) {
          INFO(c.bin << " " << group << " " << op);
          CHECK(fc.at(group).at(op).at("bytes").as_double() == stats.at("bytes").as_double());
        }
    }
  }
}

// 07: an expert's rows are decided by the router's values, which a shape-only run has not; it
// routes every token to consecutive experts (balanced loads, model/moe.cu), the loads the
// prediction assumes. The model states equal the real job's; the activations the prediction.
TEST_CASE("a fake world's expert-parallel rank: model states as the real job's, activations as predicted (balanced)") {
  const std::string flags = "--dp 2 --ep 2 --experts 4 --ffn 64";
  const tst::Log real = run_logged("07_expert_parallel", 2, kTiny + flags);
  for (int r : {0, 1}) {
    const tst::Log fake = run_logged("07_expert_parallel", 1,
                                     kTiny + flags + " --device shape --fake-world 2 --fake-rank " + std::to_string(r));
    const ts::Json& m = fake.summary.at("memory");
    INFO("rank " << r);
    for (const char* cat : {"params", "grads", "optimizer"})
      CHECK(peak(m, r, cat, false) == peak(real.summary.at("memory"), r, cat, true));
    CHECK(m.at("activations").at("measured").as_double() == m.at("activations").at("predicted").as_double());
    const ts::Json& ep = fake.summary.at("comm").at("ep").at("all_to_all");
    CHECK(ep.at("bytes").as_double() == ep.at("predicted").as_double());
  }
}

TEST_CASE("a fake world at a real shape: Llama 3 70B, rank 255 of 256 (tp 8, pp 4: the last stage), as predicted") {
  const tst::Log fake = run_logged("08_5d_mesh", 1,
                                   "--preset 70b --tp 8 --pp 4 --dp 8 --sequence-parallel --dtype bf16 --batch 64 "
                                   "--micro-batch 1 --steps 2 --quiet --device shape --fake-world 256 --fake-rank 255");
  for (const char* cat : {"params", "grads", "optimizer", "activations"}) {
    INFO(cat);
    const ts::Json& m = fake.summary.at("memory").at(cat);
    CHECK(m.at("measured").as_double() == m.at("predicted").as_double());
    CHECK(m.at("measured").as_double() > 1e9);
  }
}

// The split backward at the real shapes: Llama 3 405B on Table 4's tp 8 × pp 16 × dp 64 with SP
// (each deferred W on tp blocks, f's gathered inputs snapshotted) and DeepSeek-V3 on pp 16 × ep 64
// (a MoE layer's deferred set), the first and last stage, under ZB-H1: as predicted, to the byte.
TEST_CASE("a fake world at a real shape under ZB-H1: 405B (tp 8 + SP) and DeepSeek-V3 (ep 64), first and last stage") {
  const std::pair<std::string, int> runs[] = {
      {"--preset 405b --tp 8 --pp 16 --dp 64 --sequence-parallel --zero 1 --batch 1024 --fake-world 8192", 8191},
      {"--preset deepseek-v3 --pp 16 --dp 128 --ep 64 --batch 2048 --fake-world 2048", 2047}};
  for (const auto& [mesh, last] : runs)
    for (int r : {0, last}) {
      const tst::Log fake = run_logged("08_5d_mesh", 1, mesh + " --micro-batch 1 --dtype bf16 --steps 2 --quiet "
                                                        "--device shape --schedule zb-h1 --fake-rank " + std::to_string(r));
      INFO(mesh << ", rank " << r);
      const ts::Json& m = fake.summary.at("memory").at("activations");
      CHECK(m.at("measured").as_double() == m.at("predicted").as_double());
      CHECK(m.at("measured").as_double() > 3e10);
    }
}

// --memory-timeline: each category's largest bytes in use over the events is its peak in the
// summary, the largest sum the total peak; the phases name units forward and backward and the
// optimizer. For a real run and for a fake world's last pipeline stage.
TEST_CASE("the memory timeline holds every category's peak, in phases") {
  const std::pair<std::string, std::string> runs[] = {
      {"01_single_gpu", "--device cpu --micro-batch 4"},
      {"08_5d_mesh", "--dp 2 --tp 2 --pp 2 --micro-batch 1 --zero 1 --device shape --fake-world 8 --fake-rank 7"}};
  for (const auto& [bin, flags] : runs) {
    tst::TempDir d;
    const tst::Log log = run_logged(bin, 1, kTiny + flags + " --memory-timeline " + d.file("t.csv"));
    std::ifstream f(d.file("t.csv"));
    std::string line;
    std::getline(f, line);
    REQUIRE(line == "event,step,phase,device,tag,delta,params,grads,optimizer,activations,comm,workspace");
    std::vector<int64_t> most(6, 0);
    int64_t most_total = 0;
    std::set<std::string> phases;
    while (std::getline(f, line)) {
      std::vector<std::string> v;
      std::stringstream ss(line);
      for (std::string x; std::getline(ss, x, ',');) v.push_back(x);
      REQUIRE(v.size() == 12);
      phases.insert(v[2]);
      int64_t total = 0;
      for (int c = 0; c < 6; c++) most[c] = std::max(most[c], int64_t(std::stoll(v[6 + c]))), total += std::stoll(v[6 + c]);
      most_total = std::max(most_total, total);
    }
    INFO(bin << " " << flags);
    for (int c = 0; c < 6; c++) CHECK(most[c] == peak(log.summary.at("memory"), 0, kCategories[c], false));
    CHECK(most_total == int64_t(log.summary.at("memory").at("total_peak").as_double()));
    // Unit 4 (the last layer) is on every rank: 01's, and the last stage of 08's pipeline.
    for (const char* p : {"forward unit 4", "backward unit 4", "optimizer", "step start"}) CHECK(phases.count(p) == 1);
  }
}

TEST_CASE("fake world and shape-only device: bad input is one clear error") {
  tst::check_errors("08_5d_mesh", kTiny, {
      {1, "--dp 2 --tp 2 --device shape --fake-world 4 --fake-rank 4", "--fake-rank 4 is outside the fake world of 4 ranks"},
      {1, "--dp 2 --tp 2 --device shape --fake-world 6", "--fake-world 6: the mesh dp=2 x pp=1 x cp=1 x tp=2 has 4 ranks"},
      {1, "--dp 2 --device cpu --fake-world 2", "add --device shape"},
      {1, "--device shape --fake-rank 1", "--fake-rank 1 needs --fake-world N"},
      {1, "--device shape --save /tmp/ts_fake_world_never", "--save needs tensors with values"},
      {1, "--device shape --eval-every 1", "--eval-every needs tensors with values"},
      {2, "--dp 2 --device shape", "--device shape runs in one process"},
  });
}
