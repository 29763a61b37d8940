// data.cu — the synthetic source, the text and llm.c loaders, and the batch order.
#include "formats/data.h"
#include "formats/data_sources.h"

#include <algorithm>
#include <cstring>

#include "tensor/core.h"
#include "tensor/rng.h"
#include "formats/json.h"
#include "formats/safetensors.h"

namespace ts {

// ----- the synthetic source ----------------------------------------------------------------------
//
// An order-2 Markov chain over a 32-symbol alphabet of bytes (letters, space, punctuation): each
// context (a, b) has K = 4 distinct successors, drawn from the seed, taken with probabilities
// 10/20, 5/20, 3/20, 2/20. The entropy rate of a stationary Markov chain is the sum over
// contexts of pi(ctx) * H(next | ctx); every context has the same H, so the rate is that H
// whatever the stationary distribution pi is — exact and free to compute, with no need to find
// pi. It is the loss a model that knows the table reaches. 32 symbols make 1024 contexts: a
// table a small model learns in minutes, with three visible plateaus on the way (ln 256 for
// uniform bytes, ln 32 once the alphabet is learnt, then the floor as the contexts are).

constexpr int kSuccessors = 4;
constexpr int kWeights[kSuccessors] = {10, 5, 3, 2};
constexpr int kWeightTotal = 20;
constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz .,;!\n";
constexpr int kSymbols = 32;
static_assert(sizeof(kAlphabet) == kSymbols + 1, "the alphabet has 32 symbols");

double synthetic_entropy_rate() {
  double h = 0;
  for (int w : kWeights) {
    double p = double(w) / kWeightTotal;
    h -= p * std::log(p);
  }
  return h;
}

// successors[ctx * K + j]: the j-th successor (a symbol index) of context ctx = a * 32 + b,
// all distinct.
static std::vector<uint8_t> successor_table(uint64_t seed) {
  uint64_t key = rng_key(seed, "synthetic.successors");
  std::vector<uint8_t> table(kSymbols * kSymbols * kSuccessors);
  for (uint64_t ctx = 0; ctx < uint64_t(kSymbols * kSymbols); ctx++) {
    uint8_t* s = &table[ctx * kSuccessors];
    uint64_t draw = ctx << 16;
    for (int j = 0; j < kSuccessors;) {
      uint8_t c = uint8_t(mix64(key ^ mix64(draw++)) % kSymbols);
      bool dup = false;
      for (int k = 0; k < j; k++) dup |= s[k] == c;
      if (!dup) s[j++] = c;
    }
  }
  return table;
}

std::vector<int32_t> synthetic_tokens(uint64_t seed, int64_t n) {
  std::vector<uint8_t> table = successor_table(seed);
  uint64_t key = rng_key(seed, "synthetic.chain");
  std::vector<int32_t> out(size_t(std::max<int64_t>(n, 0)));
  uint64_t start = mix64(key);
  uint32_t a = start % kSymbols, b = (start >> 8) % kSymbols;
  for (int64_t i = 0; i < n; i++) {
    if (i >= 2) {
      // r % 20 from 64 random bits: the modulo bias is below 1e-17.
      int r = int(mix64(key ^ mix64(uint64_t(i))) % kWeightTotal), j = 0;
      while (r >= kWeights[j]) r -= kWeights[j++];
      uint32_t c = table[(a * kSymbols + b) * kSuccessors + j];
      a = b, b = c;
    }
    out[size_t(i)] = int32_t(uint8_t(kAlphabet[i == 0 ? a : b]));
  }
  return out;
}

// ----- file sources ------------------------------------------------------------------------------

static TokenData load_text(const std::string& path) {
  std::string bytes = read_file_or_throw(path);
  TokenData d;
  d.tokens.assign(bytes.begin(), bytes.end());
  for (auto& t : d.tokens) t &= 0xff;  // char may be signed
  d.description = path + ": " + std::to_string(bytes.size()) + " bytes";
  return d;
}

static TokenData load_shard(const std::string& path) {
  std::string bytes = read_file_or_throw(path);
  auto bad = [&](const std::string& msg) { return FormatError(path + ": " + msg); };
  const int64_t header_bytes = kShardHeaderInts * 4;
  if (int64_t(bytes.size()) < header_bytes)
    throw bad(std::to_string(bytes.size()) + " bytes, too short for the 1024-byte llm.c shard header");
  int32_t header[kShardKindInt + 1];
  memcpy(header, bytes.data(), sizeof header);
  if (header[0] != kShardMagic)
    throw bad("wrong magic number " + std::to_string(header[0]) + " (an llm.c token shard starts with " +
              std::to_string(kShardMagic) + ")");
  if (header[1] != kShardVersion)
    throw bad("unsupported llm.c shard version " + std::to_string(header[1]) + " (expected " +
              std::to_string(kShardVersion) + ")");
  int64_t count = header[2], present = int64_t(bytes.size()) - header_bytes;
  if (count < 0) throw bad("negative token count " + std::to_string(count) + " in the header");
  if (present < 2 * count)
    throw bad("truncated: the header announces " + std::to_string(count) + " tokens (" +
              std::to_string(2 * count) + " bytes) but only " + std::to_string(present) + " bytes follow it");
  if (present > 2 * count)
    throw bad(std::to_string(present - 2 * count) + " unexpected bytes after the " + std::to_string(count) +
              " tokens its header announces");
  TokenData d;
  d.tokens.resize(size_t(count));
  int32_t max_id = -1;
  for (int64_t i = 0; i < count; i++) {
    uint16_t t;
    memcpy(&t, bytes.data() + header_bytes + 2 * i, 2);
    d.tokens[size_t(i)] = t;
    max_id = std::max<int32_t>(max_id, t);
  }
  d.vocab = max_id + 1;
  d.bytes = header[kShardKindInt] == kShardBytes;
  d.description = path + ": llm.c shard, " + std::to_string(count) + (d.bytes ? " byte tokens" : " tokens");
  return d;
}

static bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TokenData load_data_or_throw(const std::string& path, int model_vocab, uint64_t data_seed, int64_t min_tokens) {
  TokenData d;
  std::string name = path.empty() ? "synthetic data" : path;
  if (path.empty()) {
    d.tokens = synthetic_tokens(data_seed, std::max(kSyntheticTokens, min_tokens));
    d.entropy_floor = synthetic_entropy_rate();
    d.description = "synthetic order-2 Markov chain (seed " + std::to_string(data_seed) + "), " +
                    std::to_string(d.tokens.size()) + " tokens";
  } else {
    d = ends_with(path, ".bin") ? load_shard(path) : load_text(path);
  }
  // The message names the largest id, so that it says which --vocab would hold the whole file.
  const auto max_it = std::max_element(d.tokens.begin(), d.tokens.end());
  if (max_it != d.tokens.end() && *max_it >= model_vocab) {
    const auto first = std::find_if(d.tokens.begin(), d.tokens.end(), [&](int32_t t) { return t >= model_vocab; });
    throw FormatError(name + " holds token " + std::to_string(*max_it) + " ≥ --vocab " + std::to_string(model_vocab) +
                      ": pass --vocab " + std::to_string(*max_it + 1) + " or more (the first token out of range is at "
                      "position " + std::to_string(first - d.tokens.begin()) + ")");
  }
  if (int64_t(d.tokens.size()) < min_tokens)
    throw FormatError(name + ": " + std::to_string(d.tokens.size()) +
                      " tokens, too short for one sequence (needs at least " + std::to_string(min_tokens) +
                      ": sequence length + 2)");
  return d;
}

TokenData load_data(const std::string& path, int model_vocab, uint64_t data_seed, int64_t min_tokens) {
  try {
    return load_data_or_throw(path, model_vocab, data_seed, min_tokens);
  } catch (const FormatError& e) {
    config_error("%s", e.what());
  }
}

// ----- held-out data ----------------------------------------------------------------------------

TokenData split_held_out(TokenData& train, const std::string& eval_path, int model_vocab, int64_t windows, int seq) {
  const int64_t need = held_out_tokens_needed(windows, seq);
  if (!eval_path.empty()) {
    TokenData e = load_data(eval_path, model_vocab, 0, seq + 2);
    if (int64_t(e.tokens.size()) < need)
      config_error("--eval-data %s: %zu tokens, too few for %lld evaluation windows of %d (needs %lld; lower "
                   "--eval-batches)", eval_path.c_str(), e.tokens.size(), (long long)windows, seq, (long long)need);
    return e;
  }
  const int64_t n = int64_t(train.tokens.size()), tail = std::max(n / 10, need);
  if (n - tail < int64_t(seq) + 2)
    config_error("%s: %lld tokens cannot hold %lld held-out tokens (%lld evaluation windows of %d) and one training "
                 "window of %d + 2; lower --eval-batches or give --eval-data", train.description.c_str(),
                 (long long)n, (long long)tail, (long long)windows, seq, seq);
  TokenData e;
  e.tokens.assign(train.tokens.end() - tail, train.tokens.end());
  e.vocab = train.vocab;
  e.bytes = train.bytes;
  e.entropy_floor = train.entropy_floor;
  e.description = "tokens [" + std::to_string(n - tail) + ", " + std::to_string(n) + ") of the data, the last " +
                  std::to_string(tail) + ", which the training order no longer reads";
  train.tokens.resize(size_t(n - tail));
  return e;
}

// ----- the batch order ---------------------------------------------------------------------------

int64_t window_offset(int64_t n_tokens, long step, int B, int T, int i) {
  TS_CHECK(n_tokens >= int64_t(T) + 2, "window_offset: %lld tokens cannot hold a window of %d + 2",
           (long long)n_tokens, T);
  TS_CHECK(step >= 0 && i >= 0, "window_offset: step %ld, sequence %d: negative positions read outside the data", step, i);
  int64_t span = n_tokens - T - 1;
  return ((int64_t(step) * B + i) * T) % span;
}

void fill_batch(const TokenData& d, long step, int B, int T, int seq0, int nseq, int32_t* inputs,
                int32_t* targets) {
  TS_CHECK(seq0 >= 0 && nseq >= 0 && seq0 + nseq <= B, "fill_batch: sequences [%d, %d) outside a batch of %d",
           seq0, seq0 + nseq, B);
  int64_t n = int64_t(d.tokens.size());
  for (int j = 0; j < nseq; j++) {
    const int32_t* w = d.tokens.data() + window_offset(n, step, B, T, seq0 + j);
    memcpy(inputs + int64_t(j) * T, w, sizeof(int32_t) * size_t(T));
    memcpy(targets + int64_t(j) * T, w + 1, sizeof(int32_t) * size_t(T));
  }
}

}  // namespace ts
