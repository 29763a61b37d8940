// The safetensors reader on arbitrary files: a FormatError naming the problem, or a file whose
// tensors tile the data exactly and read back in full, never a crash or a read out of bounds.
#include <cstdlib>
#include <vector>

#include "fuzz_util.h"
#include "formats/safetensors.h"

static fz::Counts counts{"fuzz_safetensors"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  counts.inputs++;
  const std::string path = fz::as_file(data, size, ".safetensors");
  try {
    ts::SafetensorsReader r = ts::SafetensorsReader::open_or_throw(path);
    int64_t bytes = 0;
    for (const std::string& n : r.names()) {
      const ts::StEntry& e = r.entry(n);
      const int64_t es = int64_t(ts::st_dtype_size(e.dtype));
      bytes += e.numel() * es;
      std::vector<char> buf(size_t(e.numel() * es));
      r.read_raw(n, 0, buf.data(), e.numel());
      if (e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "I32") {
        std::vector<float> f(size_t(e.numel()));
        r.read(n, 0, f.data(), e.numel());
      }
    }
    if (bytes > int64_t(size)) abort();  // accepted tensors larger than the file itself
  } catch (const ts::FormatError&) {
    counts.clean_errors++;
  }
  return 0;
}
