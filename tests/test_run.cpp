// ranks: 1
// What every run does around its training steps, seen from outside as a user sees it: the threads
// it picks, how it treats its output paths, signals and checkpoints, and what it prints.
#include <catch2/catch.hpp>
#include <sched.h>

#include <regex>

#include "training/checkpoint.h"
#include "training/checkpoint_files.h"
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
  static const std::regex re(R"(threads: (\d+) per rank \((?:([^;()]+); )?(\d+) cores, (\d+) ranks? on this node\))");
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
    // A micro-batch of 8 × 256 or 4 × 256 tokens of dim 128: enough work for every core to share.
    tst::Result r = tst::run_bin(bin, kTiny + "--seq 256 --dim 128 --steps 0" + dp, np, 120, tst::kOwnThreads);
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

TEST_CASE("threads: a micro-batch too small to share runs on one thread, unless told otherwise", "[run][threads]") {
  // tiny's micro-batch of 8 × 32 = 256 tokens of dim 64: waking a second thread costs more than
  // its share.
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, tst::kOwnThreads);
  INFO(r.output);
  REQUIRE(r.status == 0);
  ThreadLine t = thread_line(r.output);
  CHECK(t.threads == 1);
  if (affinity_cores() > 1) CHECK(t.source == "a micro-batch of 256 tokens × dim 64 is too small to share");
  tst::Result flag = tst::run_bin("01_single_gpu", kTiny + "--steps 0 --threads 2", 1, 120, tst::kOwnThreads);
  INFO(flag.output);
  CHECK(thread_line(flag.output).threads == 2);
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

// The default: a short spin (10000 pauses), then sleep; a policy the environment names is kept.
TEST_CASE("threads: idle OpenMP threads spin briefly, then sleep, unless the environment says otherwise", "[run][threads]") {
  const std::string dflt = tst::kOwnThreads + " -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_DISPLAY_ENV=verbose";
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, dflt);
  INFO(r.output);
  CHECK(last_spincount(r.output) == "10000");
  tst::Result p = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, "-u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive OMP_DISPLAY_ENV=verbose");
  INFO(p.output);
  CHECK(last_spincount(p.output) == "0");
  tst::Result a = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, "-u GOMP_SPINCOUNT OMP_WAIT_POLICY=active OMP_DISPLAY_ENV=verbose");
  INFO(a.output);
  CHECK(last_spincount(a.output) != "0");
  CHECK(last_spincount(a.output) != "10000");
  CHECK(!last_spincount(a.output).empty());
}

// The sgemm core a run names on its threads: line, and what /proc/cpuinfo says this CPU is.
std::string sgemm_core_of(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"(sgemm core (\S+)( \([^)]*\))?)");
  return std::regex_search(out, m, re) ? m.str(0) : "";
}

TEST_CASE("sgemm core: Zen 4 takes Haswell's kernels, elsewhere OpenBLAS's choice stands; OPENBLAS_CORETYPE wins",
          "[run][threads]") {
  std::ifstream f("/proc/cpuinfo");
  std::string line, vendor, family, flags;
  auto value = [&] { return line.substr(line.find(':') + 2); };
  while (std::getline(f, line) && flags.empty()) {
    if (line.rfind("vendor_id", 0) == 0) vendor = value();
    else if (line.rfind("cpu family", 0) == 0) family = value();
    else if (line.rfind("flags", 0) == 0) flags = " " + value() + " ";
  }
  const bool zen4 = vendor == "AuthenticAMD" && family == "25" && flags.find(" avx512f ") != std::string::npos;
  const tst::Result own = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, "-u OPENBLAS_CORETYPE");
  const std::string core = sgemm_core_of(own.output);
  INFO(vendor << " family " << family << (zen4 ? " (Zen 4)" : "") << "\n" << own.output);
  REQUIRE(own.status == 0);
  if (zen4) {
    CHECK(core.rfind("sgemm core Haswell", 0) == 0);
  } else {
    CHECK(core.find("Zen 4") == std::string::npos);
    CHECK(core.find("OPENBLAS_CORETYPE") == std::string::npos);
  }
  // A core the user names is kept (Sandybridge's AVX kernels run on every x86-64 CPU with AVX).
  const tst::Result forced = tst::run_bin("01_single_gpu", kTiny + "--steps 0", 1, 120, "OPENBLAS_CORETYPE=Sandybridge");
  INFO(forced.output);
  CHECK(sgemm_core_of(forced.output) == "sgemm core Sandybridge (OPENBLAS_CORETYPE)");
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

// ----- a run is never lost at its end ---------------------------------------------------------

static bool has(const std::string& out, const std::string& s) { return out.find(s) != std::string::npos; }

TEST_CASE("output paths: a path that cannot be written stops every rank before the first step", "[run][outputs]") {
  tst::TempDir d;
  struct Case {
    std::string args, message;
  } cases[] = {
      {"--save /nonexistent_ts/ck", "--save /nonexistent_ts/ck: cannot write checkpoints: directory /nonexistent_ts does not exist"},
      {"--trace /nonexistent_ts/t.json", "--trace /nonexistent_ts/t.json: cannot be created"},
      {"--log-json " + d.path, "--log-json " + d.path + ": is a directory"},
      {"--save " + d.file("f") + "/ck", "is not a directory"},
  };
  tst::write_bytes(d.file("f"), "a file, not a directory");
  for (const Case& c : cases) {
    tst::Result r = tst::run_bin("02_data_parallel", kTiny + "--dp 2 --steps 1000000 " + c.args, 2, 60);
    INFO(r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, c.message));
    CHECK(has(r.output, "checked before the first step"));
    CHECK(!has(r.output, "step "));
  }
}

// Starts a long run, waits until its JSON log holds `steps` lines, sends SIGTERM to the launcher
// (mpirun passes it to every rank) and returns what it printed and its exit status.
static tst::Result run_and_terminate(const std::string& cmd, const std::string& log, int steps) {
  const std::string script = "( " + cmd + " ) > " + log + ".out 2>&1 & pid=$!; i=0; "
                             "while [ \"$(cat " + log + " 2>/dev/null | wc -l)\" -lt " + std::to_string(steps) +
                             " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
                             "kill -TERM $pid; wait $pid; rc=$?; cat " + log + ".out; exit $rc";
  return tst::run("sh -c '" + script + "'", 120);
}

TEST_CASE("SIGTERM: every rank finishes the step, saves, exits 0; resuming equals never stopping", "[run][signals]") {
  tst::TempDir d;
  const std::string base = kTiny + "--dp 2 --batch 4 ";
  tst::Result r = run_and_terminate(
      tst::bin_command("02_data_parallel", base + "--steps 1000000 --save " + d.file("ck") + " --log-json " + d.file("a.jsonl"), 2),
      d.file("a.jsonl"), 3);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "SIGTERM: stopped after"));
  tst::Log a = tst::read_log(d.file("a.jsonl"));
  const long done = long(a.steps.size());
  CHECK(done >= 3);
  CHECK(a.summary.at("stopped_by").as_string() == "SIGTERM");
  CHECK(a.summary.at("steps_done").as_int() == done);
  CHECK(ts::Json::parse(ts::read_text_file(d.file("ck/trainer.json"))).at("step").as_int() == done);

  const std::string total = " --steps " + std::to_string(done + 2);
  tst::Result b = tst::run_bin("02_data_parallel", base + total + " --resume " + d.file("ck") + " --save " + d.file("ck"), 2);
  INFO(b.output);
  REQUIRE(b.status == 0);
  tst::Result c = tst::run_bin("02_data_parallel", base + total + " --save " + d.file("straight"), 2);
  REQUIRE(c.status == 0);
  CHECK(tst::max_abs_diff_files(d.file("ck/model.safetensors"), d.file("straight/model.safetensors")) == 0.0);
}

TEST_CASE("--keep-last N keeps the newest N step_ checkpoints; --resume DIR takes the newest complete one", "[run][ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 9 --save-every 2 --keep-last 2 --save " + ck);
  INFO(r.output);
  REQUIRE(r.status == 0);
  auto names = [&] {
    std::vector<std::string> v;
    for (auto& [step, path] : ts::step_checkpoints(ck)) v.push_back(path.substr(ck.size() + 1));
    return v;
  };
  CHECK(names() == std::vector<std::string>{"step_000008", "step_000009"});
  std::filesystem::create_directory(ck + "/step_000099.tmp");  // an unfinished save is not a checkpoint
  CHECK(ts::resolve_checkpoint(ck) == ck + "/step_000009");
  tst::Result b = tst::run_bin("01_single_gpu", kTiny + "--steps 12 --save-every 2 --keep-last 2 --resume " + ck +
                                                    " --save " + ck + " --log-json " + d.file("b.jsonl"));
  INFO(b.output);
  REQUIRE(b.status == 0);
  CHECK(tst::read_log(d.file("b.jsonl")).steps.front().at("step").as_int() == 9);
  CHECK(names() == std::vector<std::string>{"step_000010", "step_000012"});
  // A single checkpoint and a directory of step_ checkpoints never overwrite one another.
  tst::Result mix = tst::run_bin("01_single_gpu", kTiny + "--steps 1 --save " + ck);
  CHECK(mix.status == 2);
  CHECK(has(mix.output, "holds step_ checkpoints written with --keep-last"));
  tst::Result none = tst::run_bin("01_single_gpu", kTiny + "--steps 1 --resume " + d.path);
  CHECK(none.status == 2);
  CHECK(has(none.output, "neither a checkpoint"));
}

TEST_CASE("resume: trainer.json records the schedule; a cosine curve is never bent silently", "[run][ckpt]") {
  tst::TempDir d;
  const std::string cos = "--preset tiny --quiet --lr-schedule cosine --warmup-steps 2 --min-lr 1e-4 ";
  REQUIRE(tst::run_bin("01_single_gpu", cos + "--steps 10 --save-every 5 --keep-last 2 --save " + d.file("ck")).status == 0);
  ts::Json tj = ts::Json::parse(ts::read_text_file(d.file("ck/step_000005/trainer.json")));
  CHECK(tj.at("lr_schedule").as_string() == "cosine");
  CHECK(tj.at("steps").as_int() == 10);
  CHECK(tj.at("lr").as_double() == 3e-3);
  CHECK(tj.at("warmup_steps").as_int() == 2);
  CHECK(tj.at("min_lr").as_double() == 1e-4);
  const std::string from5 = " --resume " + d.file("ck/step_000005");
  // The same schedule continues; a longer one is refused, naming both, unless --reschedule.
  CHECK(tst::run_bin("01_single_gpu", cos + "--steps 10" + from5).status == 0);
  tst::Result longer = tst::run_bin("01_single_gpu", cos + "--steps 20" + from5);
  INFO(longer.output);
  CHECK(longer.status == 2);
  CHECK(has(longer.output, "--lr-schedule cosine --steps 10 --lr 0.003 --warmup-steps 2 --min-lr 0.0001"));
  CHECK(has(longer.output, "--lr-schedule cosine --steps 20 --lr 0.003 --warmup-steps 2 --min-lr 0.0001"));
  CHECK(has(longer.output, "changes the learning rate from step 5 on"));
  tst::Result re = tst::run_bin("01_single_gpu", cos + "--steps 20 --reschedule" + from5);
  INFO(re.output);
  CHECK(re.status == 0);
  CHECK(has(re.output, "--reschedule: this run changes the learning rate from step 5 on"));
  // A constant rate has no curve to bend: extending the run is fine.
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 4 --save " + d.file("c")).status == 0);
  CHECK(tst::run_bin("01_single_gpu", kTiny + "--steps 8 --resume " + d.file("c")).status == 0);
}

// ----- progress ---------------------------------------------------------------------------------

// The steps of the printed "step 120/4000 | … | ETA 5s" lines (total checked against `total`).
static std::vector<long> printed_steps(const std::string& out, long total) {
  std::vector<long> v;
  static const std::regex re(R"((^|\n)step +(\d+)/(\d+) \| loss [^\n]*\| (ETA|took) \d+[smh])");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) {
    if (std::stol((*it)[3]) == total) v.push_back(std::stol((*it)[2]));
  }
  return v;
}

TEST_CASE("progress: about 50 step lines by default, always the first and last, all steps in the JSON log", "[run][progress]") {
  tst::TempDir d;
  const std::string plain = "--preset tiny --lr-schedule constant ";
  tst::Result r = tst::run_bin("01_single_gpu", plain + "--steps 200 --log-json " + d.file("a.jsonl"));
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::vector<long> s = printed_steps(r.output, 200);
  REQUIRE(!s.empty());
  CHECK(s.front() == 0);
  CHECK(s.back() == 199);
  CHECK(s.size() >= 45);
  CHECK(s.size() <= 55);
  CHECK(tst::read_log(d.file("a.jsonl")).steps.size() == 200);
  // An explicit cadence, and a resumed run starts its lines at its own first step.
  tst::Result e = tst::run_bin("01_single_gpu", plain + "--steps 20 --log-every 7 --save " + d.file("ck"));
  CHECK(printed_steps(e.output, 20) == std::vector<long>{0, 7, 14, 19});
  tst::Result f = tst::run_bin("01_single_gpu", plain + "--steps 30 --log-every 7 --resume " + d.file("ck"));
  CHECK(printed_steps(f.output, 30) == std::vector<long>{20, 21, 28, 29});
}

TEST_CASE("progress: --quiet prints no step lines, only one every --progress-seconds", "[run][progress]") {
  tst::Result q = tst::run_bin("01_single_gpu", kTiny + "--steps 5");
  CHECK(printed_steps(q.output, 5).empty());
  tst::Result p = tst::run_bin("01_single_gpu", kTiny + "--steps 300 --progress-seconds 0.1");
  INFO(p.output);
  std::vector<long> s = printed_steps(p.output, 300);
  CHECK(!s.empty());
  CHECK(s.size() < 150);
}
