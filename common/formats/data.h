// data.h — the token stream every technique trains on, and the batch order.
//
// Three sources: an embedded synthetic byte source with a known entropy rate (the default, so a
// run needs no files and can print the loss floor it should approach), any text file as bytes,
// and llm.c token shards. The whole stream is loaded on every rank; which window a sequence
// reads is a pure function of the global step, so every mesh sees the same batches. Loading the
// sources and cutting the held-out tail are data_sources.h's.
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

// The data order: sequence i of step s reads the window at token offset
// ((s*B + i)*T) mod (N - T - 1); inputs are tokens[o, o+T), targets tokens[o+1, o+T+1).
int64_t window_offset(int64_t n_tokens, long step, int B, int T, int i);
// Fills inputs and targets, each [nseq, T] row-major, for the global sequences
// [seq0, seq0 + nseq) of step `step` of a global batch of B sequences.
void fill_batch(const TokenData& d, long step, int B, int T, int seq0, int nseq, int32_t* inputs,
                int32_t* targets);

}  // namespace ts
