// ranks: 1
// What every run does around its training steps, seen from outside as a user sees it: the threads
// it picks, how it treats its output paths, signals and checkpoints, and what it prints.
#include <catch2/catch.hpp>
#include <sched.h>

#include <regex>

#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant ";

struct ThreadLine {
  int threads = -1, cores = -1, ranks = -1;
  std::string source;
};

// "threads: 2 per rank (OMP_NUM_THREADS; 4 cores, 2 ranks on this node)..."
ThreadLine thread_line(const std::string& out) {
  std::smatch m;
  ThreadLine t;
  static const std::regex re(R"(threads: (\d+) per rank \((?:([A-Za-z_-]+); )?(\d+) cores, (\d+) ranks? on this node\))");
  if (std::regex_search(out, m, re)) t = {std::stoi(m[1]), std::stoi(m[3]), std::stoi(m[4]), m[2]};
  return t;
}

int affinity_cores() {
  cpu_set_t s;
  sched_getaffinity(0, sizeof s, &s);
  return CPU_COUNT(&s);
}

}  // namespace

TEST_CASE("threads: without OMP_NUM_THREADS each rank takes its share of the node's cores", "[run][threads]") {
  for (int np : {1, 2}) {
    const std::string bin = np == 1 ? "01_single_gpu" : "02_data_parallel";
    const std::string dp = np == 1 ? "" : " --dp " + std::to_string(np);
    tst::Result r = tst::run_bin(bin, kTiny + "--steps 0" + dp, np, 120, tst::kOwnThreads);
    INFO(r.output);
    REQUIRE(r.status == 0);
    ThreadLine t = thread_line(r.output);
    CHECK(t.ranks == np);
    CHECK(t.source.empty());
    CHECK(t.cores >= 1);
    CHECK(t.cores <= affinity_cores());
    CHECK(t.threads == std::max(1, t.cores / np));
  }
}

TEST_CASE("threads: OMP_NUM_THREADS is honoured and --threads overrides it", "[run][threads]") {
  tst::Result env = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, tst::kOwnThreads + " OMP_NUM_THREADS=3");
  INFO(env.output);
  ThreadLine t = thread_line(env.output);
  CHECK(t.threads == 3);
  CHECK(t.source == "OMP_NUM_THREADS");
  tst::Result flag = tst::run_bin("01_single_gpu", kTiny + "--steps 0 --threads 2", 1, 120, "OMP_NUM_THREADS=3");
  INFO(flag.output);
  t = thread_line(flag.output);
  CHECK(t.threads == 2);
  CHECK(t.source == "--threads");
}

// libgomp prints its settings at start-up with OMP_DISPLAY_ENV=verbose; the last block is the one
// the training process runs with.
static std::string last_spincount(const std::string& out) {
  std::string v;
  static const std::regex re(R"(GOMP_SPINCOUNT = '(\d+)')");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) v = (*it)[1];
  return v;
}

TEST_CASE("threads: idle OpenMP threads sleep instead of spinning, unless OMP_WAIT_POLICY says otherwise", "[run][threads]") {
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, tst::kOwnThreads + " OMP_DISPLAY_ENV=verbose");
  INFO(r.output);
  CHECK(last_spincount(r.output) == "0");
  tst::Result a = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, "OMP_WAIT_POLICY=active OMP_DISPLAY_ENV=verbose");
  INFO(a.output);
  CHECK(last_spincount(a.output) != "0");
  CHECK(!last_spincount(a.output).empty());
}

TEST_CASE("threads: 1 and 2 threads give bitwise-equal losses and weights", "[run][threads]") {
  // ffn 400 and 384 tokens per step put sgemm's inner dimension past one OpenBLAS block, where a
  // threaded OpenBLAS would round differently.
  tst::TempDir d;
  for (int t : {1, 2}) {
    const std::string n = std::to_string(t);
    tst::Result r = tst::run_bin("01_single_gpu",
                                 kTiny + "--ffn 400 --seq 96 --batch 4 --steps 3 --threads " + n + " --log-json " +
                                     d.file(n + ".jsonl") + " --save " + d.file("ck" + n),
                                 1, 120, tst::kOwnThreads);
    INFO(r.output);
    REQUIRE(r.status == 0);
  }
  CHECK(tst::read_log(d.file("1.jsonl")).losses() == tst::read_log(d.file("2.jsonl")).losses());
  CHECK(tst::max_abs_diff_files(d.file("ck1/model.safetensors"), d.file("ck2/model.safetensors")) == 0.0);
}
