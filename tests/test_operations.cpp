// ranks: 1
// When a run goes wrong at scale: the flight recorder (every rank's recent collectives, dumped on
// a timeout, an error or SIGUSR1, and scripts/flight_analyze.py's verdict across the ranks), and
// checkpoints that neither stall training (--async-save) nor leave debris when a save fails.
#include <catch2/catch.hpp>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "training/checkpoint.h"
#include "test_util.h"

using namespace ts;

namespace {

const std::string kTiny = "--preset tiny --lr-schedule constant --quiet ";

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

struct Timed {
  tst::Result r;
  double secs;
};
Timed timed(const std::string& cmd, int bound_s) {
  auto t0 = std::chrono::steady_clock::now();
  Timed t{tst::run(cmd, bound_s), 0};
  t.secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

// The analyzer's report of a flight directory: its first line, and all of it.
struct Verdict {
  int status;
  std::string first, all;
};
Verdict analyze(const std::string& dir) {
  tst::Result r = tst::run("python3 scripts/flight_analyze.py " + dir, 60);
  return {r.status, r.output.substr(0, r.output.find('\n')), r.output};
}

bool exists(const std::string& p) { return std::filesystem::exists(p); }

}  // namespace

// ----- the flight recorder --------------------------------------------------------------------

TEST_CASE("a rank stopped inside a collective: every live rank's record, and the analyzer names the rank and the call",
          "[flight]") {
  struct Site {
    std::string bin, args, stop_in, names;
    int np;
  };
  const Site sites[] = {
      {"02_data_parallel", "--dp 4", "all_reduce #3 on group 'dp'", "all_reduce #3 on group 'dp'", 4},
      {"04_tensor_parallel", "--tp 2", "all_reduce #5 on group 'tp'", "all_reduce #5 on group 'tp'", 2},
      // 05's first message: the stage-0 rank's send of its activations, received by the stopped one
      {"05_pipeline_parallel", "--pp 2", "recv #1 on group 'pp'", "send_recv #1 on group 'pp'", 2},
  };
  for (const Site& s : sites) {
    tst::TempDir d;
    const std::string dir = d.file("flight");
    // The binary with the injected fault tests/bugs/stop_in.cpp linked in (the Makefile's INJECTED_FAULTS).
    const std::string bin = "tests/bugs/" + s.bin + "+stop_in";
    Timed t = timed(tst::bin_command(bin, kTiny + s.args + " --steps 4 --timeout 3 --flight-dir " + dir, s.np,
                                     "TS_STOP_IN=\"" + s.stop_in + "\""),
                    60);
    INFO(s.bin << " (" << t.secs << " s)\n" << t.r.output);
    CHECK(t.r.status != 0);
    CHECK(t.r.status != 124);
    CHECK(t.secs < 3 + 12);  // the deadline, the grace for the others' records, the abort
    const int stopped = s.np - 1;
    for (int r = 0; r < s.np; r++) CHECK(exists(dir + "/rank_" + std::to_string(r) + ".json") == (r != stopped));
    CHECK(has(t.r.output, "scripts/flight_analyze.py " + dir));
    const Verdict v = analyze(dir);
    INFO(v.all);
    CHECK(v.status == 1);
    CHECK(has(v.first, s.names));
    CHECK(has(v.first, "rank " + std::to_string(stopped) + " never"));
    CHECK(has(v.first, "no flight record from rank " + std::to_string(stopped)));
    // The record itself: this rank's last entry is the call it waited in, not completed.
    const Json rec = Json::parse(read_text_file(dir + "/rank_0.json"));
    CHECK(rec.at("world").as_int() == s.np);
    CHECK(has(rec.at("reason").as_string(), "watchdog"));
    const Json& last = rec.at("entries").as_array().back();
    CHECK(has(last.at("what").as_string(), s.names));
    CHECK(last.at("state").as_string() == "started");
  }
}

TEST_CASE("a rank that skips a collective: the analyzer names the call in its place", "[flight]") {
  tst::TempDir d;
  const std::string dir = d.file("flight");
  Timed t = timed(tst::bin_command("tests/bugs/02_data_parallel+skip_collective",
                                   kTiny + "--dp 2 --steps 3 --timeout 3 --flight-dir " + dir, 2),
                  60);
  INFO(t.r.output);
  CHECK(t.r.status != 0);
  CHECK(has(t.r.output, "runs the deliberate bug skip_collective"));
  const Verdict v = analyze(dir);
  INFO(v.all);
  CHECK(v.status == 1);
  // Rank 1 skipped step 1's gradient all-reduce: its third collective on 'dp' is the loss's.
  CHECK(has(v.first, "mismatch: collective 3 on 'dp' (members [0, 1]) is another call in this place"));
  CHECK(has(v.first, "rank 0: all_reduce #3 on group 'dp'"));
  CHECK(has(v.first, "rank 1: all_reduce (the step's loss) on group 'dp'"));
}

TEST_CASE("SIGUSR1 writes every rank's record without stopping the run; a short all-reduce shows in it", "[flight]") {
  tst::TempDir d;
  const std::string dir = d.file("flight"), log = d.file("run.jsonl");
  const std::string bin = "tests/bugs/02_data_parallel+short_collective";
  std::string pattern = tst::build_dir() + "/" + bin;  // as a regular expression: '+' is any character
  for (char& c : pattern)
    if (c == '+') c = '.';
  // The signal goes to the ranks themselves (argv[0] is the binary's path; mpirun's is not).
  const std::string cmd = "sh -c '" + tst::bin_command(bin, kTiny + "--dp 2 --steps 3000 --flight-recorder 100000 "
                                                       "--flight-dir " + dir + " --log-json " + log, 2) +
                          " & sleep 3; pkill -USR1 -f \"^" + pattern + "\"; wait'";
  Timed t = timed(cmd, 120);
  INFO(t.r.output);
  CHECK(t.r.status == 0);
  CHECK(has(t.r.output, "flight recorder: SIGUSR1: rank 0 wrote " + dir + "/rank_0.json"));
  CHECK(has(t.r.output, "flight recorder: SIGUSR1: rank 1 wrote " + dir + "/rank_1.json"));
  CHECK(tst::read_log(log).steps.size() == 3000);  // the run went on to its end
  const Verdict v = analyze(dir);
  INFO(v.all);
  CHECK(v.status == 1);
  // MPI ran the short all-reduce without a word; the records show the sizes differ.
  CHECK(has(v.first, "mismatch: collective 3 on 'dp' (members [0, 1]) is the same op with another size"));
  CHECK(has(v.first, "rank 0: all_reduce #3 on group 'dp' (2 ranks, collective: no tag) [all_reduce f32 x 119104"));
  CHECK(has(v.first, "rank 1: all_reduce #3 on group 'dp' (2 ranks, collective: no tag) [all_reduce f32 x 59552"));
}

TEST_CASE("--flight-recorder 0 records nothing and writes nothing; the default directory sits beside --save",
          "[flight]") {
  const std::string kStoppable = "tests/bugs/02_data_parallel+stop_in";  // TS_STOP_IN: tests/bugs/stop_in.cpp
  tst::TempDir d;
  Timed off = timed(tst::bin_command(kStoppable, kTiny + "--dp 2 --steps 2 --timeout 2 --flight-recorder 0 "
                                     "--save " + d.file("ck"), 2, "TS_STOP_IN=\"all_reduce #1 on group 'dp'\""), 60);
  INFO(off.r.output);
  CHECK(off.r.status != 0);
  CHECK(has(off.r.output, "watchdog: rank 0 waited 2.0 s for all_reduce #1 on group 'dp'"));
  CHECK_FALSE(has(off.r.output, "flight recorder"));
  CHECK_FALSE(exists(d.file("ck.flight")));
  Timed on = timed(tst::bin_command(kStoppable, kTiny + "--dp 2 --steps 2 --timeout 2 --save " + d.file("ck"), 2,
                                    "TS_STOP_IN=\"all_reduce #1 on group 'dp'\""), 60);
  INFO(on.r.output);
  CHECK(exists(d.file("ck.flight/rank_0.json")));
  CHECK_FALSE(exists(d.file("ck.flight/rank_1.json")));
}

TEST_CASE("the analyzer on a directory without records says so and exits 2", "[flight]") {
  tst::TempDir d;
  const Verdict v = analyze(d.path);
  CHECK(v.status == 2);
  CHECK(has(v.first, "no flight records (rank_<r>.json) in " + d.path));
}

// ----- checkpoints that do not stall training and leave nothing behind -------------------------

namespace {

// Every file of every step_ checkpoint under dir, by name relative to dir.
std::map<std::string, std::string> tree_bytes(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[e.path().string().substr(dir.size())] = read_text_file(e.path().string());
  return files;
}

}  // namespace

TEST_CASE("--async-save writes the same bytes as a synchronous save, every checkpoint of the run", "[ckpt][async]") {
  tst::TempDir d;
  const std::string ck = d.file("ck"), args = kTiny + "--dp 2 --steps 6 --save-every 2 --keep-last 10 --save " + ck;
  std::map<std::string, std::string> sync, async;
  for (const char* how : {"", " --async-save"}) {
    std::filesystem::remove_all(ck);
    tst::Result r = tst::run_bin("02_data_parallel", args + how, 2, 120);
    INFO(how << "\n" << r.output);
    REQUIRE(r.status == 0);
    CHECK(has(r.output, *how ? "saves (asynchronous" : "saves (synchronous"));
    (*how ? async : sync) = tree_bytes(ck);
  }
  CHECK(sync.size() == 12);  // step_000002, 4 and 6, four files each
  CHECK(sync.count("/step_000004/optimizer.safetensors") == 1);
  CHECK(async == sync);
}

TEST_CASE("--async-save's staging buffer is in the memory table next to 12 B x Ψ_opt", "[ckpt][async]") {
  tst::TempDir d;
  const std::string log = d.file("log.jsonl");
  tst::Result r = tst::run_bin("03_zero", kTiny + "--dp 2 --zero 1 --steps 2 --async-save --save " + d.file("ck") +
                                              " --log-json " + log, 2, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  const Json m = tst::read_log(log).summary.at("memory").at("checkpoint_staging");
  // ZeRO-1 at dp 2: rank 0 writes half the model's weights and moments.
  CHECK(m.at("measured").as_int() == m.at("predicted").as_int());
  CHECK(m.at("measured").as_int() > 0);
  CHECK(has(r.output, "ckpt staging"));
}

TEST_CASE("--async-save under --save-every 1, killed at any moment, leaves a whole checkpoint that loads",
          "[ckpt][async]") {
  const double delays[] = {0.6, 1.1, 1.5, 2.0, 2.6};
  for (double delay : delays) {
    tst::TempDir d;
    const std::string ck = d.file("ck");
    const std::string cmd = "sh -c '" + tst::bin_command("02_data_parallel", kTiny + "--dp 2 --steps 100000 --save-every 1 "
                                                         "--async-save --save " + ck, 2) +
                            " & p=$!; sleep " + std::to_string(delay) + "; pkill -KILL -f \"^" + tst::build_dir() +
                            "/02_data_parallel .*--save " + ck + "\"; wait $p'";
    tst::Result killed = tst::run(cmd, 60);
    INFO("killed after " << delay << " s\n" << killed.output);
    CHECK(killed.status != 0);
    // What is there is one whole checkpoint: a resume verifies the seal and every digest first.
    REQUIRE(exists(ck + "/trainer.json"));
    const long step = long(Json::parse(read_text_file(ck + "/trainer.json")).at("step").as_int());
    bool unfinished = false;  // killed mid-save (else between two saves)
    for (const auto& e : std::filesystem::directory_iterator(d.path))
      unfinished |= e.path().filename().string().find(".tmp.") != std::string::npos;
    tst::Result resumed = tst::run_bin("02_data_parallel", kTiny + "--dp 2 --resume " + ck + " --steps " +
                                       std::to_string(step + 1) + " --save " + ck, 2, 60);
    INFO(resumed.output);
    CHECK(resumed.status == 0);
    CHECK(has(resumed.output, "removed " + ck + ".tmp.") == unfinished);  // the killed job's unfinished save
    for (const auto& e : std::filesystem::directory_iterator(d.path))
      CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
  }
}

TEST_CASE("a save into a full filesystem fails in one line, leaves no temporary files, and the last checkpoint loads",
          "[ckpt]") {
  tst::TempDir d;
  const std::string mnt = d.file("small");
  std::filesystem::create_directories(mnt);
  // 2.5 MiB: the first checkpoint (1.4 MiB of weights and moments) fits, a second beside it does not.
  const int mounted = mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=2560k");
  if (mounted != 0) FAIL("cannot mount a small tmpfs at " << mnt << " (this test needs root): " << strerror(errno));
  const std::string ck = mnt + "/ck";
  tst::Result first = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + ck, 1, 60);
  INFO(first.output);
  CHECK(first.status == 0);
  tst::Result full = tst::run_bin("01_single_gpu", kTiny + "--resume " + ck + " --steps 4 --save " + ck, 1, 60);
  INFO(full.output);
  CHECK(full.status != 0);
  size_t lines = 0;
  for (size_t at = 0; (at = full.output.find("error", at)) != std::string::npos; at++) lines++;
  CHECK(lines == 1);
  CHECK(has(full.output, "No space left on device"));
  CHECK(has(full.output, "removed the unfinished save " + ck + ".tmp."));
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(mnt)) left.push_back(e.path().filename().string());
  CHECK(left == std::vector<std::string>{"ck"});  // no ck.tmp.<pid>, no ck.lock
  tst::Result again = tst::run_bin("01_single_gpu", kTiny + "--resume " + ck + " --steps 3", 1, 60);
  INFO(again.output);
  CHECK(again.status == 0);
  umount2(mnt.c_str(), MNT_DETACH);
}
