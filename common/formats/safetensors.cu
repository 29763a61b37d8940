// safetensors.cu — the safetensors writer (sliced, many ranks) and validating reader, and the
// file helpers behind checkpoints.
#include "formats/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "tensor/core.h"
#include "tensor/device.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors and llm.c files are little-endian");

namespace ts {

// The format's own limit: a larger header is a corrupt or hostile file, not a checkpoint.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Elements converted per pwrite/pread when a dtype conversion is needed.
constexpr int64_t kChunk = 1 << 16;

int64_t StEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t st_dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"I64", 8},  {"U64", 8}, {"F64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

static std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t k = 0; k < shape.size(); k++) s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + "]";
}

static std::string errno_str() { return strerror(errno); }

// ----- layout ------------------------------------------------------------------------------------

// Byte offsets of each tensor within the data section. Larger elements go first (stably), so
// every tensor starts aligned to its element size, as the reference implementation arranges.
static std::vector<std::pair<int64_t, int64_t>> data_layout(const std::vector<StEntry>& entries) {
  std::vector<size_t> order(entries.size());
  for (size_t k = 0; k < order.size(); k++) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return st_dtype_size(entries[a].dtype) > st_dtype_size(entries[b].dtype);
  });
  std::vector<std::pair<int64_t, int64_t>> offsets(entries.size());
  int64_t at = 0;
  for (size_t k : order) {
    int64_t bytes = entries[k].numel() * int64_t(st_dtype_size(entries[k].dtype));
    offsets[k] = {at, at + bytes};
    at += bytes;
  }
  return offsets;
}

static void check_table(const std::vector<StEntry>& entries) {
  std::map<std::string, int> seen;
  for (auto& e : entries) {
    TS_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "I32",
             "safetensors: tensor '%s' has dtype '%s'; the writer supports F32, BF16 and I32",
             e.name.c_str(), e.dtype.c_str());
    TS_CHECK(e.name != "__metadata__" && seen[e.name]++ == 0,
             "safetensors: tensor name '%s' is reserved or repeated", e.name.c_str());
    for (int64_t d : e.shape) TS_CHECK(d >= 0, "safetensors: tensor '%s' has a negative dimension", e.name.c_str());
  }
}

std::string SafetensorsWriter::header_bytes(const std::vector<StEntry>& entries,
                                            const std::map<std::string, std::string>& metadata) {
  Json h = Json::object();
  if (!metadata.empty()) {
    Json& m = h["__metadata__"];
    m = Json::object();
    for (auto& [k, v] : metadata) m[k] = v;
  }
  auto offsets = data_layout(entries);
  for (size_t k = 0; k < entries.size(); k++) {
    Json t = Json::object();
    t["dtype"] = entries[k].dtype;
    t["shape"] = Json::array();
    for (int64_t d : entries[k].shape) t["shape"].push_back(d);
    t["data_offsets"] = Json::array({offsets[k].first, offsets[k].second});
    h[entries[k].name] = std::move(t);
  }
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  uint64_t n = json.size();
  std::string out(8, '\0');
  memcpy(&out[0], &n, 8);
  return out + json;
}

// ----- writer ------------------------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<StEntry>& entries,
                                     const std::map<std::string, std::string>& metadata, bool create)
    : path_(path) {
  check_table(entries);
  std::string header = header_bytes(entries, metadata);
  auto offsets = data_layout(entries);
  int64_t total = int64_t(header.size());
  for (size_t k = 0; k < entries.size(); k++) {
    slots_[entries[k].name] = Slot{entries[k], int64_t(header.size()) + offsets[k].first};
    total += offsets[k].second - offsets[k].first;
  }
  fd_ = ::open(path.c_str(), create ? O_RDWR | O_CREAT | O_TRUNC : O_RDWR, 0644);
  if (fd_ < 0) fatal("cannot open '%s' for writing: %s", path.c_str(), errno_str().c_str());
  if (create) {
    pwrite_all(header.data(), header.size(), 0);
    if (ftruncate(fd_, total) != 0) fatal("cannot size '%s': %s", path.c_str(), errno_str().c_str());
    return;
  }
  // Every rank derives the layout itself; a different table here would scatter slices.
  std::string on_disk(header.size(), '\0');
  ssize_t got = pread(fd_, &on_disk[0], on_disk.size(), 0);
  struct stat st;
  bool same = got == ssize_t(header.size()) && on_disk == header && fstat(fd_, &st) == 0 && st.st_size == total;
  TS_CHECK(same, "'%s': the file's header or size differs from this rank's tensor table", path.c_str());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsWriter::Slot& SafetensorsWriter::slot(const std::string& name, int64_t elem_offset,
                                                       int64_t count) const {
  auto it = slots_.find(name);
  TS_CHECK(it != slots_.end(), "'%s': no tensor '%s' in the table", path_.c_str(), name.c_str());
  int64_t n = it->second.e.numel();
  TS_CHECK(elem_offset >= 0 && count >= 0 && elem_offset + count <= n,
           "'%s': write of elements [%lld, %lld) of '%s' outside its %lld elements", path_.c_str(),
           (long long)elem_offset, (long long)(elem_offset + count), name.c_str(), (long long)n);
  return it->second;
}

void SafetensorsWriter::pwrite_all(const void* src, size_t bytes, int64_t file_offset) {
  const char* p = static_cast<const char*>(src);
  while (bytes > 0) {
    ssize_t n = pwrite(fd_, p, bytes, file_offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fatal("write to '%s' failed: %s", path_.c_str(), n < 0 ? errno_str().c_str() : "no progress");
    p += n, bytes -= size_t(n), file_offset += n;
  }
}

void SafetensorsWriter::write_raw(const std::string& name, int64_t elem_offset, const void* src,
                                  int64_t count) {
  TS_CHECK(fd_ >= 0, "'%s': write after sync_and_close", path_.c_str());
  const Slot& s = slot(name, elem_offset, count);
  int64_t es = int64_t(st_dtype_size(s.e.dtype));
  pwrite_all(src, size_t(count * es), s.begin + elem_offset * es);
}

void SafetensorsWriter::write(const std::string& name, int64_t elem_offset, const float* src, int64_t count) {
  const std::string& dt = slot(name, elem_offset, count).e.dtype;
  if (dt == "F32") return write_raw(name, elem_offset, src, count);
  std::vector<char> buf(size_t(std::min(count, kChunk)) * 4);
  for (int64_t k = 0; k < count; k += kChunk) {
    int64_t n = std::min(kChunk, count - k);
    if (dt == "BF16") {
      auto* b = reinterpret_cast<bf16*>(buf.data());
      for (int64_t j = 0; j < n; j++) b[j] = float_to_bf16(src[k + j]);
    } else {
      auto* q = reinterpret_cast<int32_t*>(buf.data());
      for (int64_t j = 0; j < n; j++) q[j] = int32_t(std::lrint(src[k + j]));
    }
    write_raw(name, elem_offset + k, buf.data(), n);
  }
}

void SafetensorsWriter::sync_and_close() {
  if (fd_ < 0) return;
  if (fsync(fd_) != 0) fatal("fsync of '%s' failed: %s", path_.c_str(), errno_str().c_str());
  if (::close(fd_) != 0) fatal("close of '%s' failed: %s", path_.c_str(), errno_str().c_str());
  fd_ = -1;
}

// ----- reader ------------------------------------------------------------------------------------

// Opens for reading without blocking: a FIFO or device named as a checkpoint or data file would
// block in open() until a writer appears. Callers check that it is a regular file.
static int open_regular(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

SafetensorsReader::SafetensorsReader(const std::string& path) {
  try {
    open(path);
  } catch (const FormatError& e) {
    config_error("%s", e.what());
  }
}

SafetensorsReader SafetensorsReader::open_or_throw(const std::string& path) {
  SafetensorsReader r;
  r.open(path);
  return r;
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& o) noexcept
    : path_(std::move(o.path_)), fd_(o.fd_), slots_(std::move(o.slots_)), order_(std::move(o.order_)),
      metadata_(std::move(o.metadata_)) {
  o.fd_ = -1;
}

void SafetensorsReader::open(const std::string& path) {
  path_ = path;
  auto bad = [&](const std::string& msg) { return FormatError(path + ": " + msg); };
  fd_ = open_regular(path);
  if (fd_ < 0) throw bad(errno_str());
  struct stat st;
  if (fstat(fd_, &st) != 0) throw bad(errno_str());
  if (!S_ISREG(st.st_mode)) throw bad("not a regular file");
  int64_t size = st.st_size;
  if (size < 8)
    throw bad("only " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  uint64_t n = 0;
  pread_all(&n, 8, 0);
  if (n > uint64_t(size - 8))
    throw bad("header length " + std::to_string(n) + " runs past the end of the file (" +
              std::to_string(size) + " bytes): truncated, or not a safetensors file");
  if (n > kMaxHeaderBytes) throw bad("header length " + std::to_string(n) + " is implausibly large");
  std::string header(n, '\0');
  pread_all(&header[0], n, 8);
  try {
    parse_header(header, size - 8 - int64_t(n));
  } catch (const FormatError& e) {
    throw bad(std::string("header: ") + e.what());
  }
  for (auto& [name, s] : slots_) s.begin += 8 + int64_t(n);
}

// Fills slots_ (offsets relative to the data section), order_ and metadata_ from the header
// JSON, checking everything the reference implementation checks.
void SafetensorsReader::parse_header(const std::string& header, int64_t data_bytes) {
  Json h = Json::parse(header);
  if (!h.is_object()) throw FormatError("expected a JSON object");
  std::vector<std::pair<int64_t, int64_t>> spans;
  std::vector<std::string> span_names;
  for (auto& member : h.items()) {
    const std::string& name = member.first;  // named, not bound: lambdas capture it (C++17)
    const Json& v = member.second;
    auto in = [&](const std::string& what) { return FormatError("tensor '" + name + "': " + what); };
    if (name == "__metadata__") {
      if (!v.is_object()) throw FormatError("__metadata__ must be an object of strings");
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) throw FormatError("__metadata__ value for '" + k + "' is not a string");
        metadata_[k] = s.as_string();
      }
      continue;
    }
    if (!v.is_object()) throw in("expected an object with dtype, shape and data_offsets");
    StEntry e;
    e.name = name;
    int64_t b = 0, end = 0, numel = 1;
    try {
      e.dtype = v.at("dtype").as_string();
      for (auto& d : v.at("shape").as_array()) e.shape.push_back(d.as_int());
      auto& off = v.at("data_offsets").as_array();
      if (off.size() != 2) throw FormatError("data_offsets must be [begin, end]");
      b = off[0].as_int(), end = off[1].as_int();
    } catch (const FormatError& err) {
      throw in(err.what());
    }
    size_t es = st_dtype_size(e.dtype);
    if (es == 0) throw in("unknown dtype '" + e.dtype + "'");
    for (int64_t d : e.shape) {
      if (d < 0) throw in("negative dimension in shape " + shape_str(e.shape));
      if (d && numel > (INT64_MAX / 8) / d) throw in("shape " + shape_str(e.shape) + " is too large");
      numel *= d;
    }
    if (b < 0 || end < b)
      throw in("invalid data_offsets [" + std::to_string(b) + ", " + std::to_string(end) + "]");
    if (end - b != numel * int64_t(es))
      throw in("data_offsets [" + std::to_string(b) + ", " + std::to_string(end) + "] hold " +
               std::to_string(end - b) + " bytes but " + e.dtype + " " + shape_str(e.shape) + " needs " +
               std::to_string(numel * int64_t(es)));
    if (end > data_bytes)
      throw in("data ends at byte " + std::to_string(end) + " but only " + std::to_string(data_bytes) +
               " bytes of data follow the header (file truncated?)");
    spans.push_back({b, end});
    span_names.push_back(name);
    order_.push_back(name);
    slots_[name] = Slot{e, b};
  }
  // The tensors must tile the data section exactly: no gaps, no overlaps, nothing after.
  std::vector<size_t> idx(spans.size());
  for (size_t k = 0; k < idx.size(); k++) idx[k] = k;
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t c) { return spans[a] < spans[c]; });
  int64_t at = 0;
  for (size_t k : idx) {
    if (spans[k].first != at)
      throw FormatError("tensor '" + span_names[k] + "' starts at data byte " + std::to_string(spans[k].first) +
                        " where " + std::to_string(at) + " was expected (tensors must be packed without gaps or overlaps)");
    at = spans[k].second;
  }
  if (at != data_bytes)
    throw FormatError(std::to_string(data_bytes - at) + " bytes of data after the last tensor");
}

const StEntry& SafetensorsReader::entry(const std::string& name) const {
  auto it = slots_.find(name);
  // A rank asks for the tensors of its own range: others may not ask for this one at all.
  if (it == slots_.end()) rank_error("%s: no tensor named '%s'", path_.c_str(), name.c_str());
  return it->second.e;
}

std::vector<std::string> SafetensorsReader::names() const { return order_; }

const SafetensorsReader::Slot& SafetensorsReader::slot(const std::string& name, int64_t elem_offset,
                                                       int64_t count) const {
  const StEntry& e = entry(name);
  int64_t n = e.numel();
  TS_CHECK(elem_offset >= 0 && count >= 0 && elem_offset + count <= n,
           "'%s': read of elements [%lld, %lld) of '%s' outside its %lld elements", path_.c_str(),
           (long long)elem_offset, (long long)(elem_offset + count), name.c_str(), (long long)n);
  return slots_.at(name);
}

void SafetensorsReader::pread_all(void* dst, size_t bytes, int64_t file_offset) const {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    ssize_t n = pread(fd_, p, bytes, file_offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fatal("read of '%s' failed: %s", path_.c_str(), errno_str().c_str());
    if (n == 0) fatal("'%s' ended early: was it changed while being read?", path_.c_str());
    p += n, bytes -= size_t(n), file_offset += n;
  }
}

void SafetensorsReader::read_raw(const std::string& name, int64_t elem_offset, void* dst, int64_t count) const {
  const Slot& s = slot(name, elem_offset, count);
  int64_t es = int64_t(st_dtype_size(s.e.dtype));
  pread_all(dst, size_t(count * es), s.begin + elem_offset * es);
}

void SafetensorsReader::read(const std::string& name, int64_t elem_offset, float* dst, int64_t count) const {
  const std::string& dt = slot(name, elem_offset, count).e.dtype;
  if (dt == "F32") return read_raw(name, elem_offset, dst, count);
  if (dt != "BF16" && dt != "I32")
    rank_error("%s: tensor '%s' is %s; only F32, BF16 and I32 tensors can be read as fp32", path_.c_str(),
                 name.c_str(), dt.c_str());
  std::vector<char> buf(size_t(std::min(count, kChunk)) * 4);
  for (int64_t k = 0; k < count; k += kChunk) {
    int64_t n = std::min(kChunk, count - k);
    read_raw(name, elem_offset + k, buf.data(), n);
    if (dt == "BF16") {
      auto* b = reinterpret_cast<const bf16*>(buf.data());
      for (int64_t j = 0; j < n; j++) dst[k + j] = bf16_to_float(b[j]);
    } else {
      auto* q = reinterpret_cast<const int32_t*>(buf.data());
      for (int64_t j = 0; j < n; j++) dst[k + j] = float(q[j]);
    }
  }
}

// ----- file helpers ------------------------------------------------------------------------------

std::string read_file_or_throw(const std::string& path) {
  auto bad = [&](const std::string& msg) { return FormatError(path + ": " + msg); };
  int fd = open_regular(path);
  if (fd < 0) throw bad(errno_str());
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw bad("not a regular file");
  }
  std::string out(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::read(fd, &out[got], out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string why = n < 0 ? errno_str() : "file shrank while being read";
      ::close(fd);
      throw bad(why);
    }
    got += size_t(n);
  }
  ::close(fd);
  return out;
}

std::string read_text_file(const std::string& path) {
  try {
    return read_file_or_throw(path);
  } catch (const FormatError& e) {
    config_error("cannot read %s", e.what());
  }
}

void write_text_file_synced(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fatal("cannot open '%s' for writing: %s", path.c_str(), errno_str().c_str());
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fatal("write to '%s' failed: %s", path.c_str(), n < 0 ? errno_str().c_str() : "no progress");
    done += size_t(n);
  }
  if (fsync(fd) != 0) fatal("fsync of '%s' failed: %s", path.c_str(), errno_str().c_str());
  if (::close(fd) != 0) fatal("close of '%s' failed: %s", path.c_str(), errno_str().c_str());
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fatal("cannot open directory '%s': %s", path.c_str(), errno_str().c_str());
  if (fsync(fd) != 0) fatal("fsync of directory '%s' failed: %s", path.c_str(), errno_str().c_str());
  ::close(fd);
}

// Four independent lanes of multiply-rotate over 8-byte words (the structure of xxHash), so a
// checkpoint hashes at memory speed; the length and a zero-padded tail are mixed in at the end.
namespace {
constexpr uint64_t kP1 = 0x9e3779b185ebca87ull, kP2 = 0xc2b2ae3d27d4eb4full;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
struct Digest {
  uint64_t lane[4] = {kP1, kP2, ~kP1, ~kP2};
  uint64_t bytes = 0;
  void block(const unsigned char* p) {  // 32 bytes
    for (int k = 0; k < 4; k++) {
      uint64_t w;
      memcpy(&w, p + 8 * k, 8);
      lane[k] = rotl(lane[k] + w * kP2, 31) * kP1;
    }
  }
  void add(const unsigned char* p, size_t n) {  // n a multiple of 32 except for the last call
    bytes += n;
    for (; n >= 32; p += 32, n -= 32) block(p);
    if (n) {
      unsigned char tail[32] = {};
      memcpy(tail, p, n);
      block(tail);
    }
  }
  std::string hex() const {
    uint64_t h = bytes * kP1;
    for (uint64_t l : lane) h = rotl(h ^ (l * kP2), 27) * kP1 + kP2;
    h ^= h >> 33, h *= kP2, h ^= h >> 29;
    char buf[17];
    snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
    return buf;
  }
};
}  // namespace

std::string bytes_digest(const std::string& bytes) {
  Digest d;
  d.add(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  return d.hex();
}

std::string file_digest(const std::string& path) {
  int fd = open_regular(path);
  if (fd < 0) throw FormatError(path + ": " + errno_str());
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(path + ": not a regular file");
  }
  Digest d;
  std::vector<unsigned char> buf(size_t(1) << 22);
  while (true) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string why = errno_str();
      ::close(fd);
      throw FormatError(path + ": " + why);
    }
    if (n == 0) break;
    // A short read mid-file would shift the lanes: fill whole blocks before hashing.
    size_t have = size_t(n);
    while (have % 32 && have < buf.size()) {
      ssize_t m = ::read(fd, buf.data() + have, buf.size() - have);
      if (m < 0 && errno == EINTR) continue;
      if (m <= 0) break;
      have += size_t(m);
    }
    d.add(buf.data(), have);
  }
  ::close(fd);
  return d.hex();
}

}  // namespace ts
