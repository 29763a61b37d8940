// ranks: 1
// What an operator's probes find: a rank stopped inside a metric all-reduce or a save, an error
// only one rank sees, two jobs saving to one directory, a diverging run, and input that used to
// crash, block or be accepted though wrong. Each job is bounded, so a hang fails instead of
// blocking, and each asserts the time the job took and the message it ended with.
#include <catch2/catch.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <functional>
#include <thread>

#include "training/checkpoint.h"
#include "training/checkpoint_files.h"
#include "test_util.h"

using namespace ts;

namespace {

const std::string kTiny = "--preset tiny --lr-schedule constant --quiet ";

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// How many times the output says "error": a bad input gets one line.
size_t error_lines(const std::string& out) {
  size_t n = 0;
  for (size_t at = 0; (at = out.find("error", at)) != std::string::npos; at++) n++;
  return n;
}

struct Timed {
  tst::Result r;
  double secs;
};
Timed timed(const std::string& bin, const std::string& args, int np, int bound_s, const std::string& env = "") {
  auto t0 = std::chrono::steady_clock::now();
  Timed t{tst::run_bin(bin, args, np, bound_s, env), 0};
  t.secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

std::string slurp(const std::string& path) { return read_text_file(path); }

// The technique binary with the injected fault tests/bugs/stop_in.cpp linked in (the Makefile's
// INJECTED_FAULTS): TS_STOP_IN=TEXT / TS_KILL_IN=TEXT stop or kill its last rank in the first
// collective whose label contains TEXT.
std::string stoppable(const std::string& bin) { return "tests/bugs/" + bin + "+stop_in"; }

// Replaces `from` by `to` (same length, so a safetensors header keeps its size) once.
void patch(const std::string& path, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  std::string b = slurp(path);
  const size_t at = b.find(from);
  REQUIRE(at != std::string::npos);
  b.replace(at, from.size(), to);
  tst::write_bytes(path, b);
}

// trainer.json with one member replaced (or removed when `value` is null), as an older or a
// hand-edited checkpoint would have it.
void set_trainer(const std::string& dir, const std::string& key, const Json& value) {
  Json t = Json::parse(slurp(dir + "/trainer.json")), out = Json::object();
  for (auto& [k, v] : t.items())
    if (k != key) out[k] = v;
  if (!value.is_null()) out[key] = value;
  tst::write_bytes(dir + "/trainer.json", out.dump(2));
}

// What a tool that rewrites a checkpoint file and trainer.json consistently leaves: every listed
// file's digest and the seal recomputed, so only the tensor checks stand between it and a run.
void reseal(const std::string& dir) {
  Json t = Json::parse(slurp(dir + "/trainer.json")), files = Json::object(), out = Json::object();
  for (auto& [f, digest] : t.at("files").items()) files[f] = file_digest(dir + "/" + f);
  for (auto& [k, v] : t.items())
    if (k != "seal") out[k] = k == "files" ? files : v;
  out["seal"] = trainer_seal(out);
  tst::write_bytes(dir + "/trainer.json", out.dump(2));
}

void copy_dir(const std::string& from, const std::string& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

}  // namespace

// ----- hangs the watchdog now sees ----------------------------------------------------------------

TEST_CASE("a rank stopped in the loss or gradient-norm all-reduce ends the job within --timeout", "[fault]") {
  for (const char* op : {"the step's loss", "the gradient norm"}) {
    Timed t = timed(stoppable("03_zero"), kTiny + "--dp 2 --zero 1 --steps 4 --timeout 3", 2, 40,
                    std::string("TS_STOP_IN=\"") + op + "\"");
    INFO(op << " (" << t.secs << " s)\n" << t.r.output);
    CHECK(t.r.status != 0);
    CHECK(t.r.status != 124);
    CHECK(t.secs < 3 + 10);
    CHECK(has(t.r.output, std::string("watchdog: rank 0 waited 3.0 s for all_reduce (") + op + ") on group 'dp'"));
    CHECK(has(t.r.output, "at step 0"));
  }
}

TEST_CASE("a rank killed in a collective ends the job at once, with no transport backtrace", "[fault]") {
  Timed t = timed(stoppable("02_data_parallel"), kTiny + "--dp 4 --steps 4", 4, 40, "TS_KILL_IN=\"the step's loss\"");
  INFO(t.secs << " s\n" << t.r.output);
  CHECK(t.r.status != 0);
  CHECK(t.r.status != 124);
  CHECK(t.secs < 10);
  CHECK(has(t.r.output, "TS_KILL_IN: rank 3 is killed in all_reduce (the step's loss)"));
  for (const char* noise : {"UCX", "backtrace", "==== "}) CHECK_FALSE(has(t.r.output, noise));
}

TEST_CASE("a rank stopped inside a checkpoint save ends the job within --timeout, naming the save", "[fault][ckpt]") {
  tst::TempDir d;
  Timed t = timed(stoppable("02_data_parallel"),
                  kTiny + "--dp 2 --steps 6 --save-every 2 --timeout 3 --save " + d.file("ck"), 2, 40,
                  "TS_STOP_IN=\"checkpoint of step 4: files created\"");
  INFO(t.secs << " s\n" << t.r.output);
  CHECK(t.r.status != 0);
  CHECK(t.r.status != 124);
  CHECK(t.secs < 3 + 10);
  CHECK(has(t.r.output, "for barrier (checkpoint of step 4: files created) on group 'world' (2 ranks)"));
  // The save of step 2 stays published.
  CHECK(Json::parse(slurp(d.file("ck/trainer.json"))).at("step").as_int() == 2);
}

// ----- an error one rank sees ends every rank --------------------------------------------------

TEST_CASE("an optimizer tensor only rank 1 reads: every rank ends at once with the message", "[fault][ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + ck).status == 0);
  // lm_head is in the last ZeRO shard; resealed, only the tensor checks can see it.
  patch(ck + "/optimizer.safetensors", "\"exp_avg_sq.lm_head.weight\"", "\"exp_avg_sq.lm_head.weighX\"");
  reseal(ck);
  Timed t = timed("03_zero", kTiny + "--dp 2 --zero 1 --steps 4 --timeout 60 --resume " + ck, 2, 30);
  INFO(t.secs << " s\n" << t.r.output);
  CHECK(t.r.status != 0);
  CHECK(t.r.status != 124);
  CHECK(t.secs < 15);
  CHECK(has(t.r.output, "optimizer.safetensors has no tensor exp_avg_sq.lm_head.weight"));
}

// ----- checkpoints: one job per directory, verifiable whole, never diverged ------------------------

TEST_CASE("two jobs saving to one directory: the second is refused, the checkpoint is one job's", "[fault][ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck"), args = kTiny + "--steps 40 --save-every 1 --save " + ck;
  tst::Result a;
  std::thread first([&] { a = tst::run_bin("01_single_gpu", args + " --log-json " + d.file("a.jsonl"), 1, 60); });
  // The second starts once the first has begun saving.
  for (int i = 0; i < 200 && access((ck + "/trainer.json").c_str(), F_OK) != 0; i++) usleep(20000);
  tst::Result b = tst::run_bin("01_single_gpu", args + " --seed 7", 1, 60);
  first.join();
  INFO(a.output << "\n" << b.output);
  CHECK(a.status == 0);
  CHECK(b.status == 2);
  CHECK(has(b.output, "--save " + ck + " is in use by another job"));
  const Json t = Json::parse(slurp(ck + "/trainer.json"));
  CHECK(t.at("step").as_int() == 40);
  CHECK(t.at("seed").as_int() == 1337);
  for (auto& [file, digest] : t.at("files").items()) CHECK(file_digest(ck + "/" + file) == digest.as_string());
  // No temporary of either job is left behind.
  for (const auto& e : std::filesystem::directory_iterator(d.path))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
}

TEST_CASE("a checkpoint whose files come from two saves is refused on load", "[ckpt]") {
  tst::TempDir d;
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + d.file("a")).status == 0);
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 3 --save " + d.file("b")).status == 0);
  std::filesystem::copy_file(d.file("b/optimizer.safetensors"), d.file("a/optimizer.safetensors"),
                             std::filesystem::copy_options::overwrite_existing);
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 4 --resume " + d.file("a"), 1, 60);
  INFO(r.output);
  CHECK(r.status == 2);
  CHECK(has(r.output, "optimizer.safetensors has digest"));
  CHECK(has(r.output, "the files come from different saves"));
  // On two ranks the files are shared out: rank 1 hashes the optimizer file, finds the mismatch
  // and ends both ranks with its message (ZeRO loads unit by unit, each file is hashed once).
  tst::Result z = tst::run_bin("03_zero", kTiny + "--dp 2 --zero 1 --steps 4 --resume " + d.file("a"), 2, 60);
  INFO(z.output);
  CHECK(z.status != 0);
  CHECK(has(z.output, "rank 1: optimizer.safetensors has digest"));
  CHECK(has(z.output, "the files come from different saves"));
}

TEST_CASE("a diverging run keeps its last good checkpoint", "[fault][ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  // lr 1e5: step 1's loss is ~1e11 (finite) and its update leaves infinities in the moments.
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 20 --save-every 1 --lr 1e5 --clip 0 --save " + ck, 1, 60);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(has(r.output, "checkpoint of step 2 not published"));
  CHECK(has(r.output, "holds non-finite values"));
  CHECK(Json::parse(slurp(ck + "/trainer.json")).at("step").as_int() == 1);
  long nonfinite = 0;
  for (const char* f : {"/model.safetensors", "/optimizer.safetensors"})
    for (auto& [name, v] : tst::read_tensors(ck + f))
      for (float x : v) nonfinite += !std::isfinite(x);
  CHECK(nonfinite == 0);
  CHECK(tst::run_bin("01_single_gpu", kTiny + "--steps 3 --reschedule --resume " + ck, 1, 60).status == 0);
}

// ----- bad input: a clear error, never a crash, a block or a silent acceptance ------------------

TEST_CASE("trainer.json and resume: impossible steps and changes are refused, deliberate ones explained", "[ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 4 --save " + ck).status == 0);
  struct Case {
    std::string key;
    Json value;
    std::string args, message;
  };
  const Case cases[] = {
      {"step", Json(int64_t(-5)), "--steps 8", "step -5 is outside [0, "},
      {"step", Json(int64_t(9223372036854775807)), "--steps 8", "step 9223372036854775807 is outside"},
      {"batch", Json(int64_t(0)), "--steps 8", "batch is 0, not a positive int"},
      {"data", Json(std::string("caf\xc3")), "--steps 8", "invalid UTF-8"},  // dump() writes the raw byte
      {"", Json(), "--steps 4", "the checkpoint is at step 4 and --steps is 4: no step would run"},
      {"", Json(), "--steps 8 --seed 3", "is another source, not a continuation (pass --seed 1337)"},
      {"", Json(), "--steps 4611686018427387904", "overflow a 64-bit count"},
  };
  for (const Case& c : cases) {
    const std::string dir = d.file("c" + std::to_string(&c - cases));
    copy_dir(ck, dir);
    if (!c.key.empty()) set_trainer(dir, c.key, c.value);
    tst::Result r = tst::run_bin("01_single_gpu", kTiny + c.args + " --resume " + dir, 1, 60);
    INFO(c.key << " " << c.args << "\n" << r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, c.message));
  }
  tst::Result b = tst::run_bin("01_single_gpu", kTiny + "--steps 6 --batch 4 --dtype bf16 --resume " + ck, 1, 60);
  INFO(b.output);
  CHECK(b.status == 0);
  CHECK(has(b.output, "resume: --batch 4 (the checkpoint's run used 8): each step takes another number of sequences"));
  CHECK(has(b.output, "resume: --dtype bf16 (the checkpoint's run used f32)"));
}

TEST_CASE("config.json fields that change what the model computes are compared", "[ckpt]") {
  ModelConfig c;
  const Json good = hf_config(c);
  CHECK_NOTHROW(check_hf_config(good, c));
  auto with = [&](const std::string& key, const Json& v) {
    Json j = Json::object();
    for (auto& [k, x] : good.items()) j[k] = k == key ? v : x;
    try {
      check_hf_config(j, c);
    } catch (const FormatError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(with("rope_theta", Json(500000.0)) == "does not match the model: rope_theta is 500000.0, the model has 10000.0");
  CHECK(has(with("rms_norm_eps", Json(1e-6)), "rms_norm_eps is 1e-06"));
  CHECK(has(with("head_dim", Json(32)), "head_dim is 32, the model has 16"));
  CHECK(has(with("tie_word_embeddings", Json(true)), "tie_word_embeddings is true"));
  CHECK(has(with("hidden_act", Json("gelu")), "hidden_act is 'gelu', the model has 'silu'"));
  CHECK(with("max_position_embeddings", Json(16)) == "max_position_embeddings is 16, shorter than --seq 32");
  CHECK(with("max_position_embeddings", Json(4096)).empty());  // longer positions are fine
  CHECK(has(with("hidden_act", Json(3)), "expected a string"));
}

TEST_CASE("an optimizer tensor of the wrong shape but the same size is refused", "[ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + ck).status == 0);
  patch(ck + "/optimizer.safetensors", "\"exp_avg.model.layers.0.mlp.gate_proj.weight\":{\"dtype\":\"F32\",\"shape\":[160,64]",
        "\"exp_avg.model.layers.0.mlp.gate_proj.weight\":{\"dtype\":\"F32\",\"shape\":[64,160]");
  reseal(ck);
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 4 --resume " + ck, 1, 60);
  INFO(r.output);
  CHECK(r.status == 2);
  CHECK(has(r.output, "tensor exp_avg.model.layers.0.mlp.gate_proj.weight has the wrong shape"));
}

TEST_CASE("a FIFO as --data or as a checkpoint file is an error, not a block in open()", "[ckpt][data]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + ck).status == 0);
  REQUIRE(mkfifo(d.file("fifo").c_str(), 0644) == 0);
  tst::Result data = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --data " + d.file("fifo"), 1, 20);
  INFO(data.output);
  CHECK(data.status == 2);
  CHECK(has(data.output, "fifo: not a regular file"));
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors", "trainer.json"}) {
    const std::string dir = d.file(std::string("c_") + f);
    copy_dir(ck, dir);
    REQUIRE(unlink((dir + "/" + f).c_str()) == 0);
    REQUIRE(mkfifo((dir + "/" + f).c_str(), 0644) == 0);
    tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 4 --resume " + dir, 1, 20);
    INFO(f << "\n" << r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, std::string(f) + ": not a regular file"));
  }
}

TEST_CASE("a --save path with a quote, a space and a trailing slash saves and resumes", "[ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("it's a dir") + "/";
  const std::string q = "\"" + ck + "\"";
  tst::Result a = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --save " + q);
  INFO(a.output);
  REQUIRE(a.status == 0);
  CHECK(Json::parse(slurp(ck + "trainer.json")).at("step").as_int() == 2);
  tst::Result b = tst::run_bin("01_single_gpu", kTiny + "--steps 3 --resume " + q + " --save " + q);
  INFO(b.output);
  CHECK(b.status == 0);
  CHECK(Json::parse(slurp(ck + "trainer.json")).at("step").as_int() == 3);
}

TEST_CASE("json: strings must be well-formed UTF-8", "[json]") {
  CHECK(Json::parse("\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"").as_string() == "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  for (const char* bad : {"\"\xff\"", "\"\xc3\"", "\"\xc0\xaf\"", "\"\xe0\x80\xaf\"", "\"\xed\xa0\x80\"",
                          "\"\xf4\x90\x80\x80\"", "\"\x80\"", "\"ab\xe2\x82\""}) {
    INFO(bad);
    CHECK_THROWS_WITH(Json::parse(bad), Catch::Matchers::Contains("UTF-8"));
  }
}

// ----- every blocking collective is watched: start-up, metrics, reports, the trace -------------

TEST_CASE("a rank stopped at start-up, in the MoE statistics or in an end-of-run report ends the job within --timeout",
          "[fault]") {
  struct Site {
    std::string bin, args, stop_in, message;
  };
  const std::string trace = tst::scratch("stopped_trace.json");
  const Site sites[] = {
      // start-up: make_mesh's splits, setup_threads and check_memory_fits ask about the node
      {"02_data_parallel", "--dp 2", "the mesh's 'dp' groups", "MPI_Comm_split (the mesh's 'dp' groups) on group 'world'"},
      {"02_data_parallel", "--dp 2", "the threads per rank", "MPI_Comm_split_type (the threads per rank: the ranks on this node)"},
      {"02_data_parallel", "--dp 2", "the memory check", "MPI_Comm_split_type (the memory check: the ranks on this node)"},
      // every step of a mixture of experts
      {"07_expert_parallel", "--dp 2 --ep 2 --experts 4", "the MoE statistics", "all_reduce (the MoE statistics) on group 'dp'"},
      // after training: 05's stage report, 06's attention work report, the merged trace
      {"05_pipeline_parallel", "--pp 2", "the stage report", "gather (the stage report) on group 'pp'"},
      {"06_context_parallel", "--cp 2", "the attention work report", "all_gather (the attention work report) on group 'cp'"},
      {"02_data_parallel", "--dp 2 --trace " + trace, "the trace's sizes", "gather (the trace's sizes) on group 'world'"},
  };
  for (const Site& s : sites) {
    Timed t = timed(stoppable(s.bin), kTiny + s.args + " --steps 2 --timeout 2", 2, 40, "TS_STOP_IN=\"" + s.stop_in + "\"");
    INFO(s.bin << " stopped in " << s.stop_in << " (" << t.secs << " s)\n" << t.r.output);
    CHECK(t.r.status != 0);
    CHECK(t.r.status != 124);
    CHECK(has(t.r.output, "TS_STOP_IN: rank 1 stops in"));
    CHECK(has(t.r.output, "watchdog: rank 0 waited 2.0 s for " + s.message));
    CHECK(t.secs < 2 + 8);  // the deadline, the abort, and two launches of a loaded machine
  }
}

TEST_CASE("numbers out of range are one line and exit 2, from the command line and from --config", "[config]") {
  tst::TempDir d;
  tst::write_bytes(d.file("huge.json"), "{\"steps\": 1e400}");
  tst::write_bytes(d.file("wrap.json"), "{\"tp\": 4294967298}");
  struct Case {
    int np;
    std::string bin, args, message;
  };
  const Case cases[] = {
      // integers that once wrapped modulo 2^32, and values past a type's end
      {2, "04_tensor_parallel", "--tp 4294967298", "--tp expects an integer in [1, 65536], got '4294967298'"},
      {2, "04_tensor_parallel", "--config " + d.file("wrap.json"), "--tp expects an integer in [1, 65536], got '4294967298'"},
      {1, "01_single_gpu", "--dim 4294967360", "--dim expects an integer in [1, 131072], got '4294967360'"},
      {1, "01_single_gpu", "--steps 1e19", "--steps expects an integer in [0, 9223372036854775807], got '1e19'"},
      {1, "01_single_gpu", "--config " + d.file("huge.json"), "--steps expects an integer in [0, 9223372036854775807], got 'inf'"},
      {1, "08_5d_mesh", "--plan --gpus 4294967298", "--gpus expects an integer in [-2147483648, 2147483647], got '4294967298'"},
      // sizes that overflowed into one-element buckets, and a thread count that crashed libgomp
      {2, "02_data_parallel", "--dp 2 --bucket-mb 1e300", "--bucket-mb expects a finite number in (0, 1048576], got '1e300'"},
      {1, "02_data_parallel", "--bucket-mb inf", "--bucket-mb expects a finite number in (0, 1048576], got 'inf'"},
      {1, "01_single_gpu", "--weight-decay 1e400", "--weight-decay expects a finite number in [0, inf), got '1e400'"},
      {1, "07_expert_parallel", "--bucket-mb nan", "--bucket-mb expects a finite number in (0, 1048576], got 'nan'"},
      {1, "01_single_gpu", "--threads 100000", "--threads expects an integer in [0, 1024], got '100000'"},
      // values once accepted silently
      {1, "01_single_gpu", "--lr -1", "--lr expects a finite number in (0, inf), got '-1'"},
      {1, "01_single_gpu", "--lr 0", "--lr expects a finite number in (0, inf), got '0'"},
      {1, "01_single_gpu", "--lr nan", "--lr expects a finite number in (0, inf), got 'nan'"},
      {1, "01_single_gpu", "--beta2 7", "--beta2 expects a finite number in [0, 1), got '7'"},
      {1, "01_single_gpu", "--warmup-steps -5", "--warmup-steps expects an integer in [0, 9223372036854775807], got '-5'"},
      {1, "01_single_gpu", "--save-every -1", "--save-every expects an integer in [0, 9223372036854775807], got '-1'"},
      {1, "01_single_gpu", "--progress-seconds -1", "--progress-seconds expects a finite number in (0, 1000000], got '-1'"},
      {1, "01_single_gpu", "--batch 0", "--batch expects an integer in [1, 16777216], got '0'"},
      {1, "01_single_gpu", "--batch -8", "--batch expects an integer in [1, 16777216], got '-8'"},
      {1, "03_zero", "--zero 3 --prefetch 7", "--prefetch expects an integer in [0, 1], got '7'"},
      {1, "01_single_gpu", "--experts 4 --capacity-factor nan", "--capacity-factor expects a finite number, got 'nan'"},
      {1, "06_context_parallel", "--cp-mode ulysses", "--cp-mode ulysses needs --cp 2 or more (got --cp 1)"},
      // the watchdog's own deadline: a config line, not an error per rank with a source location
      {2, "02_data_parallel", "--dp 2 --timeout 0", "--timeout expects a finite number in (0, 1000000], got '0'"},
      {1, "02_data_parallel", "--timeout -5", "--timeout expects a finite number in (0, 1000000], got '-5'"},
      {2, "02_data_parallel", "--dp 2 --timeout nan", "--timeout expects a finite number in (0, 1000000], got 'nan'"},
      // a typo names the flag it was meant to be
      {1, "01_single_gpu", "--step 3", "unknown flag --step; did you mean --steps? (see --help)"},
      {2, "02_data_parallel", "--dp 2 --bukcet-mb 4", "unknown flag --bukcet-mb; did you mean --bucket-mb? (see --help)"},
  };
  for (const Case& c : cases) {
    tst::Result r = tst::run_bin(c.bin, kTiny + c.args, c.np, 60);
    INFO("mpirun -np " << c.np << " " << c.bin << " " << c.args << "\n" << r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, "error: " + c.message + "\n"));
    CHECK(error_lines(r.output) == 1);
  }
}

// ----- sealed checkpoints: trainer.json is part of the whole --------------------------------------

TEST_CASE("an edited or partial checkpoint is refused with one line before any tensor is used", "[ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 4 --save " + ck).status == 0);
  struct Case {
    std::string what, message;
    std::function<void(const std::string&)> damage;
  };
  auto rm = [](const std::string& path) { REQUIRE(unlink(path.c_str()) == 0); };
  const Case cases[] = {
      {"step 4 edited to 3", "trainer.json: does not match its seal (changed since the save)",
       [](const std::string& dir) { set_trainer(dir, "step", Json(int64_t(3))); }},
      {"trainer.json deleted", "optimizer.safetensors without trainer.json: a partial checkpoint",
       [&](const std::string& dir) { rm(dir + "/trainer.json"); }},
      {"files list removed, optimizer deleted", "trainer.json: does not match its seal",
       [&](const std::string& dir) {
         set_trainer(dir, "files", Json());
         rm(dir + "/optimizer.safetensors");
       }},
      {"optimizer deleted", "trainer.json lists optimizer.safetensors, which cannot be read",
       [&](const std::string& dir) { rm(dir + "/optimizer.safetensors"); }},
      {"seal removed", "trainer.json: no seal", [](const std::string& dir) { set_trainer(dir, "seal", Json()); }},
  };
  for (const Case& c : cases) {
    const std::string dir = d.file("c" + std::to_string(&c - cases));
    copy_dir(ck, dir);
    c.damage(dir);
    tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 6 --resume " + dir, 1, 60);
    INFO(c.what << "\n" << r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, "error: checkpoint " + dir + ": "));
    CHECK(has(r.output, c.message));
    CHECK(error_lines(r.output) == 1);
    CHECK_FALSE(has(r.output, "step 5"));  // refused before training
  }
  // Weights alone (an HF model directory: model.safetensors and config.json) are step 0's, as before.
  const std::string hf = d.file("hf");
  copy_dir(ck, hf);
  rm(hf + "/trainer.json");
  rm(hf + "/optimizer.safetensors");
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --resume " + hf, 1, 60);
  INFO(r.output);
  CHECK(r.status == 0);
}

TEST_CASE("--resume over step_ checkpoints falls back to the newest intact one, saying so", "[ckpt]") {
  tst::TempDir d;
  const std::string ck = d.file("ck");
  REQUIRE(tst::run_bin("01_single_gpu", kTiny + "--steps 6 --save-every 2 --keep-last 3 --save " + ck).status == 0);
  {
    std::ofstream f(ck + "/step_000006/model.safetensors", std::ios::app);
    f << "x";  // a damaged newest checkpoint
  }
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 8 --log-json " + d.file("r.jsonl") + " --resume " + ck, 1, 60);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(has(r.output, "resume: " + ck + "/step_000006 is damaged (model.safetensors does not match the digest "
                      "trainer.json records); resuming from " + ck + "/step_000004, the newest intact checkpoint"));
  const tst::Log log = tst::read_log(d.file("r.jsonl"));
  REQUIRE(log.steps.size() == 4);  // steps 4..7
  // Every one damaged: one line naming each and why.
  set_trainer(ck + "/step_000004", "step", Json(int64_t(3)));
  REQUIRE(unlink((ck + "/step_000002/trainer.json").c_str()) == 0);
  tst::Result none = tst::run_bin("01_single_gpu", kTiny + "--steps 8 --resume " + ck, 1, 60);
  INFO(none.output);
  CHECK(none.status == 2);
  CHECK(has(none.output, "error: --resume " + ck + ": no intact step_ checkpoint: " + ck + "/step_000006 is damaged"));
  CHECK(has(none.output, ck + "/step_000004 is damaged (trainer.json: does not match its seal"));
  CHECK(has(none.output, ck + "/step_000002 is damaged (optimizer.safetensors without trainer.json"));
  CHECK(error_lines(none.output) == 1);
}
