// ranks: 1
// What a newcomer meets in the first minutes: the launch mistakes the binaries explain, a shape too
// big for the machine, the checkpoint's config.json, and the numbers each line reports.
#include <catch2/catch.hpp>

#include "formats/json.h"
#include "training/config_flags.h"
#include "training/report.h"
#include "model/model.h"
#include "test_util.h"
#include "training/train.h"

namespace {

const std::string kTiny = "--preset tiny --lr-schedule constant ";

bool has(const std::string& out, const std::string& s) { return out.find(s) != std::string::npos; }

// A tiny run on one rank that must succeed.
tst::Result run_ok(const std::string& bin, const std::string& args) {
  tst::Result r = tst::run_bin(bin, kTiny + args, 1, 60);
  INFO(bin << " " << args << "\n" << r.output);
  REQUIRE(r.status == 0);
  return r;
}

}  // namespace

TEST_CASE("launch: ranks without the mesh flag name the flag this binary has", "[newcomer][launch]") {
  struct Case {
    std::string bin, args, says, never;
  } cases[] = {
      {"02_data_parallel", "", "--dp 1 needs 1 ranks but the job has 2: add --dp 2 (or launch with mpirun -np 1)", "--tp"},
      {"03_zero", "--zero 2", "add --dp 2", "--tp"},
      {"04_tensor_parallel", "", "--tp 1 needs 1 ranks but the job has 2: add --tp 2", "--dp"},
      {"02_data_parallel", "--dp 4", "--dp 4 needs 4 ranks but the job has 2: set --dp 2 (or launch with mpirun -np 4)", "--tp"},
      {"01_single_gpu", "", "01_single_gpu runs on one rank (got 2)", "--dp"},
  };
  for (const Case& c : cases) {
    tst::Result r = tst::run_bin(c.bin, kTiny + "--steps 1 " + c.args, 2, 60);
    INFO(c.bin << " " << c.args << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.status != 124);
    CHECK(has(r.output, c.says));
    CHECK(!has(r.output, c.never));
  }
}

TEST_CASE("memory: a shape the machine cannot hold stops before allocating, with the comparison", "[newcomer][memory]") {
  // 64 sequences of 8b's 4096 tokens in one micro-batch: ~18 TiB of activations, more than any node.
  tst::Result r = tst::run_bin("01_single_gpu", "--preset 8b --batch 64 --steps 1", 1, 60);
  INFO(r.output);
  CHECK(r.status == 2);  // a config_error, not the allocator or the OOM killer
  CHECK(has(r.output, "error: predicted "));
  CHECK(has(r.output, "per rank (params 29.92 GiB, grads 29.92 GiB, optimizer 59.83 GiB, activations "));
  CHECK(has(r.output, "available (MemAvailable in /proc/meminfo)"));
  CHECK(!has(r.output, "step 0"));
  // The same shape under --dry-run is a plan, not an error.
  tst::Result dry = tst::run_bin("01_single_gpu", "--preset 8b --batch 64 --dry-run", 1, 60);
  INFO(dry.output);
  CHECK(dry.status == 0);
}

TEST_CASE("config.json: positions for generation past the training length, eps as written", "[newcomer][ckpt]") {
  CHECK(ts::shortest_decimal(1e-5f) == 1e-5);
  CHECK(ts::shortest_decimal(0.1f) == 0.1);
  CHECK(ts::shortest_decimal(500000.f) == 500000.0);
  CHECK(ts::Json(ts::shortest_decimal(1e-5f)).dump() == "1e-05");
  tst::TempDir d;
  run_ok("01_single_gpu", "--steps 0 --save " + d.file("ck"));
  const std::string text = ts::read_text_file(d.file("ck/config.json"));
  INFO(text);
  CHECK(has(text, "\"rms_norm_eps\": 1e-05,"));
  ts::Json cfg = ts::Json::parse(text);
  CHECK(cfg.at("max_position_embeddings").as_int() == 2048);  // max(seq 32, 2048)
  CHECK(cfg.at("rope_theta").as_double() == 10000.0);
}

TEST_CASE("step lines: GFLOP/s without a peak, MFU with --peak-tflops", "[newcomer][log]") {
  tst::TempDir d;
  tst::Result cpu = run_ok("01_single_gpu", "--steps 2 --log-json " + d.file("a.jsonl"));
  INFO(cpu.output);
  CHECK(has(cpu.output, " GFLOP/s | "));
  CHECK(!has(cpu.output, "MFU"));
  ts::ModelConfig tiny;
  REQUIRE(ts::apply_preset("tiny", tiny));
  for (const ts::Json& s : tst::read_log(d.file("a.jsonl")).steps) {
    const double expected = ts::flops_per_token(tiny) * s.at("tokens_per_s").as_double();
    CHECK(s.at("flops_per_s").as_double() == Approx(expected).epsilon(1e-12));
  }
  tst::Result peak = run_ok("01_single_gpu", "--steps 2 --peak-tflops 1");
  INFO(peak.output);
  CHECK(has(peak.output, "| MFU "));
  CHECK(!has(peak.output, "GFLOP/s"));
}

TEST_CASE("02 at dp 1 has nothing to hide; the memory table says why two rows have no prediction", "[newcomer][log]") {
  tst::TempDir d;
  tst::Result r = run_ok("02_data_parallel", "--steps 2 --log-json " + d.file("a.jsonl"));
  INFO(r.output);
  CHECK(has(r.output, "communication hidden behind backward: nothing to hide at dp 1 (0 bytes sent)"));
  CHECK(!tst::read_log(d.file("a.jsonl")).summary.contains("comm_hidden_fraction"));
  CHECK(has(r.output, "(no prediction for comm: host staging of CUDA tensors sent over MPI"));
  CHECK(has(r.output, "workspace:"));
}

TEST_CASE("--config: a JSON file of flags, the command line overriding; a checkpoint's trainer.json repeats its run",
          "[newcomer][config]") {
  tst::TempDir d;
  tst::write_bytes(d.file("run.json"), R"({"preset": "tiny", "dim": 32, "heads": 2, "kv_heads": 1, "steps": 2,
                                           "lr-schedule": "constant", "lr": 0.002, "quiet": true, "dp": 2})");
  const std::string spelled = "--preset tiny --dim 32 --heads 2 --kv-heads 1 --lr-schedule constant --lr 0.002 --quiet --dp 2";
  tst::Result a = tst::run_bin("02_data_parallel", "--config " + d.file("run.json") + " --steps 3 --save " +
                                                       d.file("ck") + " --log-json " + d.file("a.jsonl"), 2, 60);
  INFO(a.output);
  REQUIRE(a.status == 0);
  tst::Result b = tst::run_bin("02_data_parallel", spelled + " --steps 3 --log-json " + d.file("b.jsonl"), 2, 60);
  INFO(b.output);
  REQUIRE(b.status == 0);
  CHECK(has(b.output, "mesh: 2 ranks = dp 2 x pp 1 x cp 1 x tp 1; cpu tensors travel by mpi"));
  const std::vector<double> losses = tst::read_log(d.file("b.jsonl")).losses();
  CHECK(losses.size() == 3);  // --steps 3 on the command line beat the file's 2
  CHECK(tst::read_log(d.file("a.jsonl")).losses() == losses);

  // The checkpoint recorded every flag: its trainer.json alone gives the same run.
  ts::Json flags = ts::Json::parse(ts::read_text_file(d.file("ck/trainer.json"))).at("flags");
  CHECK(flags.at("dim").as_string() == "32");
  CHECK(flags.at("dp").as_string() == "2");
  tst::Result c = tst::run_bin("02_data_parallel", "--config " + d.file("ck/trainer.json") + " --save " +
                                                       d.file("ck2") + " --log-json " + d.file("c.jsonl"), 2, 60);
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK(tst::read_log(d.file("c.jsonl")).losses() == losses);

  tst::write_bytes(d.file("bad.json"), R"({"steps": 2, "dpp": 2})");
  tst::Result bad = tst::run_bin("02_data_parallel", "--config " + d.file("bad.json"), 1, 60);
  INFO(bad.output);
  CHECK(bad.status == 2);
  CHECK(has(bad.output, "error: unknown flag --dpp in --config " + d.file("bad.json")));
}

TEST_CASE("--save over a checkpoint this run did not resume from is refused unless --overwrite", "[newcomer][ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  run_ok("01_single_gpu", "--steps 2 --save " + ck);
  auto step_of = [&] { return ts::Json::parse(ts::read_text_file(ck + "/trainer.json")).at("step").as_int(); };
  // Another run (here on two ranks) must not replace it silently: one line, every rank stops.
  tst::Result r = tst::run_bin("02_data_parallel", kTiny + "--dp 2 --steps 1 --save " + ck, 2, 60);
  INFO(r.output);
  CHECK(r.status == 2);
  CHECK(has(r.output, "error: rank 0: --save " + ck + " holds a checkpoint that this run did not resume from: --resume " + ck +
                          " to continue it, or add --overwrite to replace it"));
  CHECK(step_of() == 2);
  // Continuing it saves over it; --overwrite replaces it deliberately.
  run_ok("01_single_gpu", "--steps 3 --resume " + ck + " --save " + ck);
  CHECK(step_of() == 3);
  run_ok("01_single_gpu", "--steps 1 --overwrite --save " + ck);
  CHECK(step_of() == 1);
}

TEST_CASE("--preset: the error and --help list the same names", "[newcomer][flags]") {
  const std::string names = "tiny, small, 124m, 1b, 3b, 8b, 70b, 80b, 405b, 8x7b, deepseek-v3";
  tst::Result bad = tst::run_bin("01_single_gpu", "--preset 2b", 1, 60);
  INFO(bad.output);
  CHECK(bad.status == 2);
  CHECK(has(bad.output, "unknown --preset '2b' (" + names + ")"));
  tst::Result help = tst::run_bin("01_single_gpu", "--help", 1, 60);
  CHECK(has(help.output, "model shape: " + names));
}

// --help lists the program's own flags first, then the shared ones under their headings, each
// flag under its own.
TEST_CASE("--help: the chapter's flags first, then the shared ones in groups", "[newcomer]") {
  tst::Result help = tst::run_bin("02_data_parallel", "--help", 1, 60);
  INFO(help.output);
  REQUIRE(help.status == 0);
  const std::string& o = help.output;
  auto at = [&](const std::string& s) { return o.find(s); };
  const char* headings[] = {"\nmodel flags:", "\noptimizer flags:", "\ndata flags:", "\nrun and checkpoint flags:",
                            "\noperations flags:"};
  REQUIRE(at("  --dp <1>") != std::string::npos);
  size_t last = at("  --bucket-mb <25>");
  REQUIRE(last != std::string::npos);
  for (const char* h : headings) {
    INFO(h);
    REQUIRE(at(h) != std::string::npos);
    CHECK(at(h) > last);
    last = at(h);
  }
  // A flag of each group between its heading and the next.
  CHECK(at("  --preset <tiny>") > at("\nmodel flags:"));
  CHECK(at("  --preset <tiny>") < at("\noptimizer flags:"));
  CHECK(at("  --lr <") > at("\noptimizer flags:"));
  CHECK(at("  --lr <") < at("\ndata flags:"));
  CHECK(at("  --batch <") > at("\ndata flags:"));
  CHECK(at("  --save <") > at("\nrun and checkpoint flags:"));
  CHECK(at("  --calibration <") > at("\noperations flags:"));
  CHECK(at("  --threads <") > at("\noperations flags:"));
}

TEST_CASE("a dense checkpoint resumed as a mixture of experts, and the reverse, say so in plain words", "[newcomer][ckpt]") {
  tst::TempDir d;
  run_ok("01_single_gpu", "--steps 1 --save " + d.file("dense"));
  run_ok("01_single_gpu", "--steps 1 --experts 4 --top-k 2 --save " + d.file("moe"));
  tst::Result a = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --experts 4 --resume " + d.file("dense"), 1, 60);
  INFO(a.output);
  CHECK(a.status == 2);
  CHECK(has(a.output, "this checkpoint is dense; it has no experts (resume it without --experts)"));
  tst::Result b = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --resume " + d.file("moe"), 1, 60);
  INFO(b.output);
  CHECK(b.status == 2);
  CHECK(has(b.output, "this checkpoint is a mixture of experts; resume it with --experts 4 --top-k 2"));
  CHECK(!has(a.output + b.output, "missing key"));
}

TEST_CASE("05: one micro-batch is singular and comes with a --micro-batch hint; a crowded machine's bubble is labelled",
          "[newcomer][pp]") {
  // The default micro-batch is the whole batch: m = 1, bubble (p − 1)/m = 1.
  tst::Result r = tst::run_bin("05_pipeline_parallel", kTiny + "--pp 2 --steps 1 --threads 64", 2, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "m = 1 micro-batch of 8\n"));
  CHECK(has(r.output, "hint: with m = 1 the stages mostly wait for one another; split the batch with --micro-batch "
                      "(--micro-batch 1 gives m = 8, bubble formula 0.1250)"));
  // 2 ranks × 64 threads outnumber any test machine's cores.
  CHECK(has(r.output, "(bubble measured: 2 ranks × 64 threads share "));
  tst::Result split = tst::run_bin("05_pipeline_parallel", kTiny + "--pp 2 --steps 1 --micro-batch 2", 2, 120);
  INFO(split.output);
  CHECK(has(split.output, "m = 4 micro-batches of 2"));
  CHECK(!has(split.output, "hint:"));
}

TEST_CASE("08 prints the rank-to-group table at start-up", "[newcomer][mesh]") {
  tst::Result r = tst::run_bin("08_5d_mesh", kTiny + "--dp 2 --tp 2 --kv-heads 4 --steps 1", 4, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "rank-to-group table: 4 ranks = dp 2 x pp 1 x cp 1 x tp 2 (ep 1), tp innermost\n"
                      "  rank 0: dp=0 pp=0 cp=0 tp=0 ep=0 | dp {0,2} tp {0,1}\n"
                      "  rank 1: dp=0 pp=0 cp=0 tp=1 ep=0 | dp {1,3} tp {0,1}\n"
                      "  rank 2: dp=1 pp=0 cp=0 tp=0 ep=0 | dp {0,2} tp {2,3}\n"
                      "  rank 3: dp=1 pp=0 cp=0 tp=1 ep=0 | dp {1,3} tp {2,3}\n"));
  CHECK(has(r.output, "in 1 micro-batch of 4"));
}

TEST_CASE("the memory table says what its comm row holds; 06's zigzag error is a whole sentence", "[newcomer][cp]") {
  tst::Result r = tst::run_bin("06_context_parallel", kTiny + "--cp 2 --steps 1", 2, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "(no prediction for comm: the ring's K/V blocks in flight and the dK/dV accumulators that travel "
                      "home,\n   and host staging of CUDA tensors sent over MPI when ranks share a GPU; nor for workspace:"));
  tst::Result bad = tst::run_bin("06_context_parallel", kTiny + "--cp 2 --seq 34 --steps 1", 2, 60);
  INFO(bad.output);
  CHECK(bad.status == 2);
  CHECK(has(bad.output, "--seq 34 is not divisible by 2·cp = 4 (zigzag cuts each sequence into 2·cp chunks; --zigzag 0 "
                        "needs only a multiple of cp)"));
}

TEST_CASE("07 predicts its all-to-all for balanced routing and prints the routing's imbalance", "[newcomer][ep]") {
  tst::TempDir d;
  tst::Result r = tst::run_bin("07_expert_parallel", kTiny + "--dp 2 --ep 2 --experts 4 --top-k 2 --steps 2 --log-json " +
                                                     d.file("r.jsonl"), 2, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  // Per rank and step, balanced: micro-batches × L × (4 · (ep−1)/ep · N·K rows of D fp32 + the counts).
  const double N = 4 * 32, L = 2, D = 64, bytes = L * (4 * 0.5 * N * 2 * D * 4 + 1 * 2 * 4);
  const ts::Json& a2a = tst::read_log(d.file("r.jsonl")).summary.at("comm").at("ep").at("all_to_all");
  CHECK(a2a.at("predicted").as_double() == Approx(bytes).epsilon(1e-12));
  CHECK(a2a.at("bytes").as_double() == a2a.at("from_routing").as_double());
  char want[160];
  snprintf(want, sizeof want, "ep routing imbalance (this run's counts, rank 0): all_to_all %s per step = %.4f × the balanced %s;",
           ts::human_bytes(a2a.at("bytes").as_double()).c_str(), a2a.at("bytes").as_double() / bytes,
           ts::human_bytes(bytes).c_str());
  CHECK(has(r.output, want));
  CHECK(has(r.output, "  its experts received up to "));
}
