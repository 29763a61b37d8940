// The llm.c .bin loader on arbitrary files: tokens within the vocabulary and at least one window,
// or a FormatError naming the file, never a crash.
#include <cstdlib>

#include "formats/data.h"
#include "formats/data_sources.h"
#include "fuzz_util.h"
#include "formats/json.h"

static fz::Counts counts{"fuzz_shard"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  counts.inputs++;
  const std::string path = fz::as_file(data, size, ".bin");
  constexpr int kVocab = 50304, kMinTokens = 34;
  try {
    ts::TokenData d = ts::load_data_or_throw(path, kVocab, 1, kMinTokens);
    if (int64_t(d.tokens.size()) < kMinTokens) abort();
    for (int32_t t : d.tokens)
      if (t < 0 || t >= kVocab) abort();
  } catch (const ts::FormatError&) {
    counts.clean_errors++;
  }
  return 0;
}
