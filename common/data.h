// data.h — the token stream every technique trains on, and the batch order.
//
// Three sources: an embedded synthetic byte source with a known entropy rate (the default, so a
// run needs no files and can print the loss floor it should approach), any text file as bytes,
// and llm.c token shards. The whole stream is loaded on every rank; which window a sequence
// reads is a pure function of the global step, so every mesh sees the same batches.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace ts {

struct TokenData {
  std::vector<int32_t> tokens;
  int vocab = 256;                 // the data's own vocabulary: 256 for bytes, max id + 1 for a shard
  std::string description;         // "synthetic order-2 Markov chain (seed 1), 1048576 tokens"
  double entropy_floor = NAN;      // nats/token a perfect model reaches; known for the synthetic source
};

// The llm.c shard header: 256 little-endian int32, of which the first three are used.
constexpr int kShardHeaderInts = 256;
constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;

// path "" -> the synthetic source seeded by data_seed; "*.bin" -> an llm.c shard; anything else
// -> the file's bytes. A token >= model_vocab, or fewer than min_tokens tokens (one window,
// seq + 2), or a malformed or unreadable file is a config_error naming the file and the problem.
TokenData load_data(const std::string& path, int model_vocab, uint64_t data_seed, int64_t min_tokens);
// The same, throwing FormatError with the same message instead of exiting.
TokenData load_data_or_throw(const std::string& path, int model_vocab, uint64_t data_seed, int64_t min_tokens);

// The synthetic source on its own: n tokens of the seeded order-2 Markov chain, and the entropy
// rate of that chain in nats per token.
std::vector<int32_t> synthetic_tokens(uint64_t seed, int64_t n);
double synthetic_entropy_rate();
constexpr int64_t kSyntheticTokens = int64_t(1) << 20;

// The data order: sequence i of step s reads the window at token offset
// ((s*B + i)*T) mod (N - T - 1); inputs are tokens[o, o+T), targets tokens[o+1, o+T+1).
int64_t window_offset(int64_t n_tokens, long step, int B, int T, int i);
// Fills inputs and targets, each [nseq, T] row-major, for the global sequences
// [seq0, seq0 + nseq) of step `step` of a global batch of B sequences.
void fill_batch(const TokenData& d, long step, int B, int T, int seq0, int nseq, int32_t* inputs,
                int32_t* targets);

}  // namespace ts
