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
  bool bytes = true;               // tokens are raw bytes (synthetic, text, prepare_data.py shards): printable as text
};

// The llm.c shard header: 256 little-endian int32, of which the first three are used.
constexpr int kShardHeaderInts = 256;
constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
// Header int 3, which llm.c leaves 0: scripts/prepare_data.py writes kShardBytes there, so a
// shard of byte tokens is known to be text (01's --sample prints it) rather than GPT-2 ids.
constexpr int kShardKindInt = 3;
constexpr int32_t kShardBytes = 1;

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

// Held-out data for evaluation: either a separate file (eval_path, loaded as load_data does) or
// the tail of `train`, cut off so that the training order never reads it. The tail is the last
// tenth of the tokens, or more when `windows` windows of `seq` tokens need it; it is moved out
// of train.tokens. Too little data for both is a config_error saying how much is needed.
TokenData split_held_out(TokenData& train, const std::string& eval_path, int model_vocab, int64_t windows, int seq);
// The smallest stream that holds `windows` evaluation windows in the data order below without
// wrapping around: window j starts at j*T, which must stay below N - T - 1.
inline int64_t held_out_tokens_needed(int64_t windows, int seq) { return windows * int64_t(seq) + 2; }

// The data order: sequence i of step s reads the window at token offset
// ((s*B + i)*T) mod (N - T - 1); inputs are tokens[o, o+T), targets tokens[o+1, o+T+1).
int64_t window_offset(int64_t n_tokens, long step, int B, int T, int i);
// Fills inputs and targets, each [nseq, T] row-major, for the global sequences
// [seq0, seq0 + nseq) of step `step` of a global batch of B sequences.
void fill_batch(const TokenData& d, long step, int B, int T, int seq0, int nseq, int32_t* inputs,
                int32_t* targets);

}  // namespace ts
