// ranks: 1
// The data sources and the batch order: window offsets, batches, text and llm.c files with every
// error they can raise, and the synthetic source's determinism and entropy floor.
#include <catch2/catch.hpp>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "formats/data.h"
#include "formats/data_sources.h"
#include "test_util.h"
#include "formats/json.h"

using namespace ts;
using tst::TempDir;
using tst::write_bytes;
using Catch::Matchers::Contains;

namespace {

// An llm.c shard: the 1024-byte header (magic, version, count) then uint16 tokens; `count`
// overrides the header's token count (-1: the true count).
std::string shard(const std::vector<uint16_t>& tokens, int32_t magic = kShardMagic,
                  int32_t version = kShardVersion, int64_t count = -1) {
  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = magic, header[1] = version, header[2] = int32_t(count == -1 ? int64_t(tokens.size()) : count);
  std::string out(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  return out + std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
}

std::string load_error(const std::string& path, int vocab = 256, int64_t min_tokens = 10) {
  try {
    load_data_or_throw(path, vocab, 1, min_tokens);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TokenData iota_data(int n) {
  TokenData d;
  d.tokens.resize(size_t(n));
  std::iota(d.tokens.begin(), d.tokens.end(), 0);
  d.vocab = n;
  return d;
}

}  // namespace

TEST_CASE("data: window offsets follow ((s*B + i)*T) mod (N - T - 1)", "[data]") {
  // N = 100, T = 10: windows start anywhere in [0, 89).
  CHECK(window_offset(100, 0, 4, 10, 0) == 0);
  CHECK(window_offset(100, 0, 4, 10, 3) == 30);
  CHECK(window_offset(100, 2, 4, 10, 1) == 90 % 89);
  CHECK(window_offset(100, 7, 4, 10, 2) == 300 % 89);
  CHECK(window_offset(12, 5, 3, 10, 2) == 0);  // N = T + 2: a single window
  // Large steps must not overflow 32 bits.
  int64_t n = 1'000'003;
  long step = 2'000'000'000L;
  CHECK(window_offset(n, step, 512, 1024, 511) == ((int64_t(step) * 512 + 511) * 1024) % (n - 1025));
  for (long s = 0; s < 50; s++)
    for (int i = 0; i < 8; i++) {
      int64_t o = window_offset(1000, s, 8, 64, i);
      CHECK(o >= 0);
      CHECK(o + 64 + 1 <= 999);  // the last target stays inside the stream
    }
}

TEST_CASE("data: fill_batch reads the windows, targets shifted by one", "[data]") {
  TokenData d = iota_data(500);
  const int B = 6, T = 16;
  std::vector<int32_t> in(B * T), tg(B * T);
  fill_batch(d, 9, B, T, 0, B, in.data(), tg.data());
  for (int i = 0; i < B; i++) {
    int64_t o = window_offset(500, 9, B, T, i);
    for (int t = 0; t < T; t++) {
      CHECK(in[size_t(i * T + t)] == o + t);
      CHECK(tg[size_t(i * T + t)] == o + t + 1);
    }
  }
  // Slices of the batch (DP ranks, micro-batches) concatenate to the whole batch.
  std::vector<int32_t> in2(B * T), tg2(B * T);
  fill_batch(d, 9, B, T, 0, 2, in2.data(), tg2.data());
  fill_batch(d, 9, B, T, 2, 1, in2.data() + 2 * T, tg2.data() + 2 * T);
  fill_batch(d, 9, B, T, 3, 3, in2.data() + 3 * T, tg2.data() + 3 * T);
  CHECK(in2 == in);
  CHECK(tg2 == tg);
}

TEST_CASE("data: a text file gives its bytes", "[data]") {
  TempDir dir;
  std::string p = dir.file("corpus.txt");
  const char raw[] = "hello, world\n\xc3\xa9\xff\x00!";
  std::string text(raw, sizeof raw - 1);  // the NUL byte is data too
  text += std::string(20, 'z');
  write_bytes(p, text);
  TokenData d = load_data_or_throw(p, 256, 1, 10);
  REQUIRE(d.tokens.size() == text.size());
  for (size_t k = 0; k < text.size(); k++) CHECK(d.tokens[k] == int32_t((unsigned char)text[k]));
  CHECK(d.vocab == 256);
  CHECK(d.description == p + ": " + std::to_string(text.size()) + " bytes");
  CHECK(std::isnan(d.entropy_floor));
  // A byte the model's vocabulary cannot hold is an error at its position (0xc3 = 195 fits).
  CHECK(load_error(p, 200) ==
        p + " holds token 255 ≥ --vocab 200: pass --vocab 256 or more (the first token out of range is at position 15)");
}

TEST_CASE("data: an llm.c shard loads", "[data]") {
  TempDir dir;
  std::string p = dir.file("tokens.bin");
  std::vector<uint16_t> toks;
  for (int k = 0; k < 300; k++) toks.push_back(uint16_t((k * 7919) % 50257));
  write_bytes(p, shard(toks));
  TokenData d = load_data_or_throw(p, 50304, 1, 100);
  REQUIRE(d.tokens.size() == toks.size());
  for (size_t k = 0; k < toks.size(); k++) CHECK(d.tokens[k] == toks[k]);
  CHECK(d.vocab == *std::max_element(toks.begin(), toks.end()) + 1);
  CHECK(d.description == p + ": llm.c shard, 300 tokens");
  const int max_id = *std::max_element(toks.begin(), toks.end());
  CHECK_THAT(load_error(p, 256), Contains(p + " holds token " + std::to_string(max_id) + " ≥ --vocab 256: pass --vocab " +
                                          std::to_string(max_id + 1) + " or more"));
}

TEST_CASE("data: bad files give messages naming the file and the problem", "[data]") {
  TempDir dir;
  std::string p = dir.file("bad.bin");
  std::vector<uint16_t> toks(40, 7);
  CHECK(load_error(dir.file("missing.txt")) == dir.file("missing.txt") + ": No such file or directory");
  CHECK(load_error(dir.path) == dir.path + ": not a regular file");
  write_bytes(p, shard(toks, 20240519));
  CHECK(load_error(p) == p + ": wrong magic number 20240519 (an llm.c token shard starts with 20240520)");
  write_bytes(p, shard(toks, kShardMagic, 2));
  CHECK(load_error(p) == p + ": unsupported llm.c shard version 2 (expected 1)");
  write_bytes(p, shard(toks, kShardMagic, 1, 50));
  CHECK(load_error(p) == p + ": truncated: the header announces 50 tokens (100 bytes) but only 80 bytes follow it");
  write_bytes(p, shard(toks, kShardMagic, 1, 30));
  CHECK(load_error(p) == p + ": 20 unexpected bytes after the 30 tokens its header announces");
  write_bytes(p, shard(toks, kShardMagic, 1, -3));
  CHECK_THAT(load_error(p), Contains("negative token count -3"));
  write_bytes(p, std::string(100, 'x'));
  CHECK(load_error(p) == p + ": 100 bytes, too short for the 1024-byte llm.c shard header");
  write_bytes(p, shard(toks));
  CHECK(load_error(p, 256, 42) == p + ": 40 tokens, too short for one sequence (needs at least 42: sequence length + 2)");
  CHECK(load_error(p, 256, 40).empty());
  std::string txt = dir.file("short.txt");
  write_bytes(txt, "abc");
  CHECK(load_error(txt, 256, 10) == txt + ": 3 tokens, too short for one sequence (needs at least 10: sequence length + 2)");
}

TEST_CASE("data: the synthetic source is deterministic per seed and stays in bytes", "[data]") {
  TokenData a = load_data_or_throw("", 256, 1234, 130);
  TokenData b = load_data_or_throw("", 256, 1234, 130);
  TokenData c = load_data_or_throw("", 256, 1235, 130);
  REQUIRE(int64_t(a.tokens.size()) == kSyntheticTokens);
  CHECK(a.tokens == b.tokens);
  CHECK(a.tokens != c.tokens);
  CHECK(a.vocab == 256);
  CHECK(a.description == "synthetic order-2 Markov chain (seed 1234), 1048576 tokens");
  double h = -(0.5 * std::log(0.5) + 0.25 * std::log(0.25) + 0.15 * std::log(0.15) + 0.1 * std::log(0.1));
  CHECK(a.entropy_floor == Approx(h).epsilon(1e-12));
  CHECK(std::all_of(a.tokens.begin(), a.tokens.end(), [](int32_t t) { return t >= 0 && t < 256; }));
  // More tokens when one window needs more; a model vocabulary below 'z' + 1 cannot hold them.
  CHECK(int64_t(load_data_or_throw("", 256, 1, kSyntheticTokens + 5).tokens.size()) == kSyntheticTokens + 5);
  CHECK(std::all_of(a.tokens.begin(), a.tokens.end(), [](int32_t t) { return t == '\n' || (t >= ' ' && t <= 'z'); }));
  CHECK_THAT(load_error("", 100), Contains("synthetic data holds token 122 ≥ --vocab 100: pass --vocab 123 or more"));
  // A prefix does not depend on the length asked for.
  std::vector<int32_t> s = synthetic_tokens(1234, 1000);
  CHECK(std::equal(s.begin(), s.end(), a.tokens.begin()));
}

TEST_CASE("data: the synthetic chain's empirical entropy matches the stated floor", "[data]") {
  // Plug-in conditional entropy H(next | previous two) of a long sample, with the Miller-Madow
  // correction (+ (successors seen - 1) / 2N per context) for the bias of finite counts.
  const int64_t n = int64_t(1) << 24;
  std::vector<int32_t> s = synthetic_tokens(99, n);
  std::vector<uint32_t> counts(size_t(1) << 24, 0);
  for (int64_t i = 2; i < n; i++) counts[(size_t(s[size_t(i - 2)]) << 16) | (size_t(s[size_t(i - 1)]) << 8) | size_t(s[size_t(i)])]++;
  double total = double(n - 2), h = 0, correction = 0;
  int contexts = 0, max_successors = 0;
  for (size_t ctx = 0; ctx < 65536; ctx++) {
    const uint32_t* c = &counts[ctx << 8];
    double nc = 0;
    int seen = 0;
    for (int k = 0; k < 256; k++) nc += c[k], seen += c[k] > 0;
    if (nc == 0) continue;
    contexts++;
    max_successors = std::max(max_successors, seen);
    for (int k = 0; k < 256; k++)
      if (c[k]) h -= c[k] / total * std::log(c[k] / nc);
    correction += (seen - 1) / (2 * total);
  }
  INFO("plug-in " << h << ", corrected " << h + correction << ", contexts visited " << contexts);
  CHECK(max_successors == 4);
  CHECK(contexts > 900);  // the chain wanders over most of the 32 x 32 contexts, not a small closed set
  CHECK(h + correction == Approx(synthetic_entropy_rate()).epsilon(0.002));
}
