// data_sources.h — where data.h's token stream comes from: the embedded synthetic source, text
// files and llm.c shards, each refused with a clear message when it cannot serve a run, and the
// held-out tail cut from the training stream for evaluation.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/data.h"

namespace ts {

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

}  // namespace ts
