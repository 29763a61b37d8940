// ranks: 1
// Real text for a learner: the held-out loss (--eval-every) in 01, 02 and 03 and its refusal
// elsewhere, sampling from 01 (--sample), and scripts/prepare_data.py's shards.
#include <catch2/catch.hpp>

#include <cmath>

#include "formats/data.h"
#include "formats/data_sources.h"
#include "test_util.h"

namespace {

const std::string kTiny = "--preset tiny --lr-schedule constant --quiet ";

bool has(const std::string& out, const std::string& s) { return out.find(s) != std::string::npos; }

// (step, eval_loss) of every record that has one.
std::vector<std::pair<long, double>> evals(const tst::Log& log) {
  std::vector<std::pair<long, double>> v;
  for (const ts::Json& s : log.steps)
    if (s.contains("eval_loss")) v.push_back({long(s.at("step").as_int()), s.at("eval_loss").as_double()});
  return v;
}

std::vector<double> eval_values(const tst::Log& log) {
  std::vector<double> v;
  for (auto [step, loss] : evals(log)) v.push_back(loss);
  return v;
}

std::vector<double> grad_norms(const tst::Log& log) {
  std::vector<double> v;
  for (const ts::Json& s : log.steps) v.push_back(s.at("grad_norm").as_double());
  return v;
}

// The line after `header` in the output.
std::string line_after(const std::string& out, const std::string& header) {
  const size_t at = out.find(header);
  if (at == std::string::npos) return "<no line " + header + ">";
  const size_t b = out.find('\n', at) + 1;
  return out.substr(b, out.find('\n', b) - b);
}

// The bytes 01 printed escaped (\n, \t, \\, \xNN), two spaces of indent first.
std::string unescape(const std::string& line) {
  std::string out;
  for (size_t i = 2; i < line.size(); i++) {
    if (line[i] != '\\') {
      out += line[i];
    } else if (line[i + 1] == 'x') {
      out += char(std::stoi(line.substr(i + 2, 2), nullptr, 16));
      i += 3;
    } else {
      out += line[i + 1] == 'n' ? '\n' : line[i + 1] == 't' ? '\t' : line[i + 1];
      i += 1;
    }
  }
  return out;
}

// An llm.c shard of uint16 tokens without prepare_data.py's byte mark (another tokenizer's ids).
std::string id_shard(const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(ts::kShardHeaderInts, 0);
  header[0] = ts::kShardMagic, header[1] = ts::kShardVersion, header[2] = int32_t(tokens.size());
  return std::string(reinterpret_cast<const char*>(header.data()), header.size() * 4) +
         std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
}

}  // namespace

TEST_CASE("eval: the held-out loss after every N-th step and the last, finite; training is unchanged", "[text][eval]") {
  const tst::CachedRun& e = tst::cached_run("01_single_gpu", 1, kTiny + "--steps 5 --eval-every 2");
  const tst::CachedRun& plain = tst::cached_run("01_single_gpu", 1, kTiny + "--steps 5");
  const auto ev = evals(e.log);
  REQUIRE(ev.size() == 3);
  CHECK(ev[0].first == 1);
  CHECK(ev[1].first == 3);
  CHECK(ev[2].first == 4);  // the last step, though 5 is not a multiple of 2
  for (auto [step, loss] : ev) {
    CHECK(std::isfinite(loss));
    CHECK(loss > 1.2);                       // above the source's entropy floor (1.2080)
    CHECK(loss < std::log(256.0) + 0.1);     // at most a little above uniform bytes
  }
  CHECK(ev[2].second < ev[0].second - 0.2);  // it learns what the held-out tail holds too
  CHECK(e.log.summary.at("eval_loss").as_double() == ev[2].second);
  // The tail of the synthetic stream, and how many windows: 4 batches of 8.
  CHECK(has(e.output, "held out: tokens [943719, 1048576) of the data, the last 104857, which the training order no "
                      "longer reads; 32 evaluation windows of 32 (--eval-batches 4 × --batch 8) every 2 steps"));
  CHECK(has(e.output, "| eval "));  // shown even under --quiet
  // Forward only: the same losses, gradient norms and weights as without evaluation (the run
  // does not reach the end of the shortened training span, so it reads the same windows).
  CHECK(e.log.losses() == plain.log.losses());
  CHECK(grad_norms(e.log) == grad_norms(plain.log));
  CHECK(tst::max_abs_diff_files(e.ckpt + "/model.safetensors", plain.ckpt + "/model.safetensors") == 0);
  CHECK(!plain.log.summary.contains("eval_loss"));
  CHECK(!has(plain.output, "held out"));
}

TEST_CASE("eval at dp 2 (02, and 03's ZeRO-3) is 01's held-out loss; training unchanged", "[text][eval]") {
  const tst::CachedRun& single = tst::cached_run("01_single_gpu", 1, kTiny + "--steps 5 --eval-every 2");
  struct Case {
    std::string bin, args;
  } cases[] = {{"02_data_parallel", "--dp 2"}, {"03_zero", "--dp 2 --zero 3"}};
  for (const Case& c : cases) {
    const tst::CachedRun& e = tst::cached_run(c.bin, 2, kTiny + "--steps 5 --eval-every 2 " + c.args);
    const tst::CachedRun& plain = tst::cached_run(c.bin, 2, kTiny + "--steps 5 " + c.args);
    INFO(c.bin << " " << c.args);
    REQUIRE(evals(e.log).size() == 3);
    // Each rank sums its half of the windows' token losses; the halves add up in another order
    // than 01's, and the per-token losses come from matmuls of half the rows: not bitwise.
    CHECK(tst::max_rel_diff(eval_values(e.log), eval_values(single.log)) <= 1e-6);
    CHECK(e.log.losses() == plain.log.losses());
    CHECK(grad_norms(e.log) == grad_norms(plain.log));
    // The evaluation's all-gathers (ZeRO-3) are not counted as the training steps' traffic.
    CHECK(e.log.summary.at("comm").dump() == plain.log.summary.at("comm").dump());
  }
}

TEST_CASE("eval: a technique without it refuses --eval-every in one line on every rank", "[text][eval][errors]") {
  struct Case {
    std::string bin, args;
  } cases[] = {{"05_pipeline_parallel", "--pp 2"}, {"04_tensor_parallel", "--tp 2"}};
  for (const Case& c : cases) {
    tst::Result r = tst::run_bin(c.bin, kTiny + "--steps 2 --eval-every 1 " + c.args, 2, 60);
    INFO(c.bin << "\n" << r.output);
    CHECK(r.status == 2);  // config_error's exit status, from every rank (mpirun reports the first)
    CHECK(has(r.output, "error: --eval-every is not available in " + c.bin + ": it has no evaluation pass"));
    CHECK(has(r.output, "evaluate its checkpoint with 01_single_gpu --resume DIR"));
    size_t lines = 0;
    for (size_t at = r.output.find("error:"); at != std::string::npos; at = r.output.find("error:", at + 1)) lines++;
    CHECK(lines == 1);
    CHECK(!has(r.output, "step 0/2"));
  }
}

TEST_CASE("eval and sample: bad input is a one-line error", "[text][errors]") {
  const std::string small = tst::scratch("small.txt"), ids = tst::scratch("ids.bin");
  tst::write_bytes(small, std::string(500, 'a'));
  std::vector<uint16_t> toks(100, 7);
  toks[40] = 300;
  tst::write_bytes(ids, id_shard(toks));
  tst::check_errors("01_single_gpu", kTiny + "--steps 2 ", {
      {1, "--eval-every 1 --eval-batches 0", "--eval-batches must be >= 1 (got 0)"},
      {1, "--eval-every -1", "--eval-every must be >= 0"},
      {1, "--eval-data " + small, "--eval-data " + small + " needs --eval-every N"},
      {1, "--eval-every 1 --eval-data " + small, "500 tokens, too few for 32 evaluation windows of 32 (needs 1026"},
      {1, "--eval-every 1 --data " + small, "cannot hold 1026 held-out tokens (32 evaluation windows of 32)"},
      {1, "--data " + ids, ids + " holds token 300 ≥ --vocab 256: pass --vocab 301 or more"},
      {1, "--data " + ids + " --vocab 301 --sample 4", "holds token ids, not bytes"},
      {1, "--vocab 200 --sample 4", "--sample needs a vocabulary of bytes (--vocab 256 or more, got 200)"},
      {1, "--sample 4 --temperature 0", "--temperature must be > 0"},
  });
}

TEST_CASE("sample: N bytes, greedy and at the temperature, the same on every run and from the checkpoint", "[text][sample]") {
  const std::string args = kTiny + "--steps 20 --sample 24 --prompt 'the '";
  const std::string greedy = "sample, greedy, 24 bytes after \"the \":",
                    warm = "sample, temperature 0.8, seed 1337, 24 bytes after \"the \":";
  const tst::CachedRun& a = tst::cached_run("01_single_gpu", 1, args);
  tst::Result b = tst::run_bin("01_single_gpu", args, 1, 60);
  REQUIRE(b.status == 0);
  const std::string g = unescape(line_after(a.output, greedy)), t = unescape(line_after(a.output, warm));
  INFO(a.output);
  CHECK(g.size() == 24);
  CHECK(t.size() == 24);
  CHECK(g != t);
  CHECK(line_after(b.output, greedy) == line_after(a.output, greedy));
  CHECK(line_after(b.output, warm) == line_after(a.output, warm));
  // --steps 20 on a step-20 checkpoint trains nothing and samples the same model.
  tst::Result r = tst::run_bin("01_single_gpu", args + " --temperature 2 --resume " + a.ckpt, 1, 60);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(!has(r.output, "step 19/20"));
  CHECK(line_after(r.output, greedy) == line_after(a.output, greedy));
  const std::string hot = line_after(r.output, "sample, temperature 2, seed 1337, 24 bytes after \"the \":");
  CHECK(unescape(hot).size() == 24);
  CHECK(hot != line_after(a.output, warm));
}

TEST_CASE("prepare_data.py: text to byte shards that 01 reads back byte for byte", "[text][data]") {
  tst::TempDir dir;
  std::string text;
  for (int i = 0; i < 100; i++) text += "caf\xc3\xa9 line " + std::to_string(i) + "\t\x01\n";
  tst::write_bytes(dir.file("in.txt"), text);
  tst::Result p = tst::run("/usr/bin/python3 scripts/prepare_data.py " + dir.file("in.txt") + " -o " +
                           dir.file("shards/t") + " --val-fraction 0.25");
  INFO(p.output);
  REQUIRE(p.status == 0);
  const size_t val = text.size() / 4;
  CHECK(has(p.output, dir.file("shards/t_val.bin") + ": " + std::to_string(val) + " byte tokens"));
  ts::TokenData tr = ts::load_data_or_throw(dir.file("shards/t_train.bin"), 256, 1, 10);
  ts::TokenData va = ts::load_data_or_throw(dir.file("shards/t_val.bin"), 256, 1, 10);
  CHECK(tr.bytes);
  CHECK(va.bytes);
  std::string back;
  for (auto* d : {&tr, &va})
    for (int32_t t : d->tokens) back += char(t);
  CHECK(va.tokens.size() == val);
  CHECK(back == text);
  // 01 trains on the train shard, evaluates on the val shard and prints its bytes.
  tst::Result r = tst::run_bin("01_single_gpu", kTiny + "--steps 2 --eval-every 2 --eval-batches 1 --sample 8 --data " +
                                                   dir.file("shards/t_train.bin") + " --eval-data " +
                                                   dir.file("shards/t_val.bin"), 1, 60);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(has(r.output, "t_train.bin: llm.c shard, " + std::to_string(text.size() - val) + " byte tokens"));
  CHECK(has(r.output, "held out: " + dir.file("shards/t_val.bin") + ": llm.c shard, " + std::to_string(val) +
                          " byte tokens; 8 evaluation windows of 32"));
  CHECK(has(r.output, "sample, greedy, 8 bytes after \"c\":"));  // the data's first byte
  tst::Result bad = tst::run("/usr/bin/python3 scripts/prepare_data.py " + dir.file("in.txt") + " -o " +
                             dir.file("x") + " --val-fraction 1.5");
  CHECK(bad.status != 0);
  CHECK(has(bad.output, "error: --val-fraction must be between 0 and 1 (got 1.5)"));
}

TEST_CASE("split_held_out: the last tenth, or what the windows need; the training stream loses it", "[text][data]") {
  ts::TokenData d;
  for (int i = 0; i < 2000; i++) d.tokens.push_back(i % 251);
  ts::TokenData e = ts::split_held_out(d, "", 256, 4, 32);
  CHECK(d.tokens.size() == 1800);
  REQUIRE(e.tokens.size() == 200);
  CHECK(e.tokens.front() == 1800 % 251);
  CHECK(ts::held_out_tokens_needed(4, 32) == 130);
  ts::TokenData d2;
  d2.tokens.assign(2000, 1);
  ts::TokenData e2 = ts::split_held_out(d2, "", 256, 20, 32);  // 20 windows need 642 > 200
  CHECK(e2.tokens.size() == 642);
  CHECK(d2.tokens.size() == 2000 - 642);
  // The last evaluation window ends inside the held-out tokens without wrapping around.
  CHECK(ts::window_offset(int64_t(e2.tokens.size()), 2, 8, 32, 3) == 19 * 32);
}
