// safetensors.h — Hugging Face's safetensors format, written in slices by many ranks at once,
// plus the small file helpers that checkpoints need (read a text file, write and fsync, fsync a
// directory).
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
// padded with spaces to a multiple of 8, then the tensors' bytes packed back to back (offsets are
// relative to the end of the header). This is what `safetensors.torch.load_file` and
// `transformers` read.
//
// The layout is a pure function of the global tensor table, so every rank computes the same
// offsets and writes its own slices of each tensor where they belong in the full tensor: the
// checkpoint does not depend on the mesh that wrote it.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "formats/json.h"

namespace ts {

struct StEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I32" (the reader also knows the format's other dtypes)
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Bytes per element of a safetensors dtype name; 0 when the name is not a safetensors dtype.
size_t st_dtype_size(const std::string& dtype);

class SafetensorsWriter {
 public:
  // create=true (one rank): creates or truncates the file, writes the header and sizes the file,
  // so that unwritten tensors read as zeros. create=false (the other ranks, after the creator):
  // opens the existing file and checks its header is the one this table gives.
  SafetensorsWriter(const std::string& path, const std::vector<StEntry>& entries,
                    const std::map<std::string, std::string>& metadata, bool create);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Elements [elem_offset, elem_offset + count) of the flattened tensor, converted from fp32 to
  // the entry's dtype (BF16 rounds to nearest even, I32 rounds to nearest).
  void write(const std::string& name, int64_t elem_offset, const float* src, int64_t count);
  // The same with src already in the entry's dtype.
  void write_raw(const std::string& name, int64_t elem_offset, const void* src, int64_t count);
  void sync_and_close();  // fsync, so a rename after it publishes complete data

  // The header bytes (length prefix included) and total file size for a table: what every rank
  // computes identically.
  static std::string header_bytes(const std::vector<StEntry>& entries,
                                  const std::map<std::string, std::string>& metadata);

 private:
  struct Slot {
    StEntry e;
    int64_t begin;  // absolute file offset of the tensor's first byte
  };
  const Slot& slot(const std::string& name, int64_t elem_offset, int64_t count) const;
  void pwrite_all(const void* src, size_t bytes, int64_t file_offset);

  std::string path_;
  int fd_ = -1;
  std::map<std::string, Slot> slots_;
};

class SafetensorsReader {
 public:
  // Validates everything before any read: the file exists, the header length is sane, the JSON
  // parses, every dtype is known, offsets are in bounds, match dtype * shape and tile the data
  // exactly. Any problem is a config_error naming the file.
  explicit SafetensorsReader(const std::string& path);
  // The same validation, throwing FormatError instead (tests; callers that add context).
  static SafetensorsReader open_or_throw(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& o) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;

  bool has(const std::string& name) const { return slots_.count(name) != 0; }
  const StEntry& entry(const std::string& name) const;  // config_error when absent
  std::vector<std::string> names() const;                // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

  // Elements [elem_offset, elem_offset + count) of the flattened tensor as fp32 (from F32, BF16
  // or I32 storage).
  void read(const std::string& name, int64_t elem_offset, float* dst, int64_t count) const;
  // The same bytes as stored, in any dtype.
  void read_raw(const std::string& name, int64_t elem_offset, void* dst, int64_t count) const;

 private:
  struct Slot {
    StEntry e;
    int64_t begin;  // absolute file offset
  };
  SafetensorsReader() = default;
  void open(const std::string& path);  // throws FormatError
  void parse_header(const std::string& header, int64_t data_bytes);
  const Slot& slot(const std::string& name, int64_t elem_offset, int64_t count) const;
  void pread_all(void* dst, size_t bytes, int64_t file_offset) const;

  std::string path_;
  int fd_ = -1;
  std::map<std::string, Slot> slots_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

// ----- file helpers ------------------------------------------------------------------------------

// The whole file; config_error naming it when it cannot be read.
std::string read_text_file(const std::string& path);
// The same, throwing FormatError ("path: No such file or directory").
std::string read_file_or_throw(const std::string& path);
// Writes (create or truncate) and fsyncs; any failure is fatal.
void write_text_file_synced(const std::string& path, const std::string& content);
// fsync a directory, so that files created or renamed in it survive a crash.
void fsync_dir(const std::string& path);
// A 64-bit digest of a file's bytes as 16 hex digits (FormatError when it cannot be read). Not
// cryptographic: it tells a checkpoint's file from one another save wrote, or a damaged copy.
std::string file_digest(const std::string& path);
// The same digest of bytes in memory.
std::string bytes_digest(const std::string& bytes);

}  // namespace ts
