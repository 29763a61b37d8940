// The JSON parser on arbitrary bytes: a value or a FormatError, never a crash; and what it
// accepts is a fixed point of dump and parse after one round (non-finite numbers become null once).
#include <cstdlib>

#include "fuzz_util.h"

static fz::Counts counts{"fuzz_json"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  counts.inputs++;
  ts::Json j;
  if (!fz::parse_json(data, size, counts, j)) return 0;
  const ts::Json once = ts::Json::parse(j.dump());
  if (ts::Json::parse(once.dump(2)) != once) abort();
  return 0;
}
