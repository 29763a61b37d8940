// fuzz_util.h — what the fuzz targets share: the input as a file (the readers take paths), and a
// count of inputs and of clean errors printed when the run ends.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include "formats/json.h"

namespace fz {

struct Counts {
  const char* name;
  long inputs = 0, clean_errors = 0;
  ~Counts() { fprintf(stderr, "%s: %ld inputs, %ld clean errors, %ld accepted\n", name, inputs, clean_errors, inputs - clean_errors); }
};

// The input written to a file of this process's own, ending in `suffix`.
inline std::string as_file(const uint8_t* data, size_t size, const std::string& suffix) {
  static const struct File {
    std::string path;
    ~File() { unlink(path.c_str()); }
  } file{"/tmp/ts_fuzz_" + std::to_string(getpid()) + suffix};
  const std::string& path = file.path;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

// The input parsed as JSON into `out`; false (counted as a clean error) when it is not JSON.
inline bool parse_json(const uint8_t* data, size_t size, Counts& counts, ts::Json& out) {
  try {
    out = ts::Json::parse(std::string(reinterpret_cast<const char*>(data), size));
    return true;
  } catch (const ts::FormatError&) {
    counts.clean_errors++;
    return false;
  }
}

}  // namespace fz
