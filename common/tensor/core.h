// core.h — the pieces every file stands on: devices, dtypes, bf16, fatal() and its checks, the
// tagging allocator and the Tensor type. What device code and its launches use besides (the
// CUDA headers, the launch form, bf16's rounding, the CUDA check macros, the compute stream) is
// tensor/device.h's.
//
// One source tree, two backends: compiled by nvcc, TS_CUDA is defined and every binary carries
// both the CPU and the CUDA implementation; compiled by g++, the CUDA code is compiled out.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <functional>
#include <string>
#include <vector>


namespace ts {

// ---------------------------------------------------------------------------------------------
// Errors. fatal() ends the whole job: every rank, non-zero, never a hang (MPI_Abort when MPI
// is up). config_error() is for validation that every rank performs identically before the
// first collective: rank 0 prints one message, every rank exits non-zero.
// ---------------------------------------------------------------------------------------------
[[noreturn]] void fatal_at(const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
[[noreturn]] void config_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// While one lives, config_error() says where the bad value came from ("error: WHERE: message"):
// flags read from a file's string rather than the command line.
class ConfigErrorWhere {
 public:
  explicit ConfigErrorWhere(std::string where);
  ~ConfigErrorWhere();

 private:
  std::string outer_;
};
// The same for bad input that only this rank sees (the part of a file it alone reads): it prints
// "error [rank r]: ..." itself and takes every rank down at once, as fatal() does, so the others
// are not left waiting in their next collective.
[[noreturn]] void rank_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#define fatal(...) ::ts::fatal_at(__FILE__, __LINE__, __VA_ARGS__)
#define TS_CHECK(cond, ...)          \
  do {                               \
    if (!(cond)) fatal(__VA_ARGS__); \
  } while (0)

int world_rank();  // 0 before MPI is initialised


// ---------------------------------------------------------------------------------------------
// Devices and dtypes
// ---------------------------------------------------------------------------------------------
enum class Device : uint8_t { CPU, CUDA };
// F8E4M3 / F8E5M2: the OCP 8-bit float formats (fp8.h), one byte per element, used for the FP8
// linears' quantized operands.
enum class DType : uint8_t { F32, BF16, I32, F8E4M3, F8E5M2 };
const char* device_name(Device d);
const char* dtype_name(DType t);
size_t dtype_size(DType t);
bool cuda_available();  // a GPU is visible (always false in a CPU-only build)
// "auto" -> CUDA when a GPU is visible; "cuda" without one is a config error.
Device parse_device(const std::string& s);

// bf16: the top 16 bits of an fp32, rounded to nearest even. Plain bits so that CPU and CUDA
// code share one definition and the rounding is identical on both.
struct bf16 {
  uint16_t bits;
};

// ---------------------------------------------------------------------------------------------
// The tagging allocator: every allocation carries a category, and current and peak bytes are
// kept per category and in total, per device. This is the "measured" column that runs print
// next to the playbook's memory formulas. Its figures and calls are tensor/allocator.h's.
// ---------------------------------------------------------------------------------------------
enum class Tag : uint8_t { Params, Grads, Optimizer, Activations, Comm, Workspace, Count };
constexpr int kNumTags = int(Tag::Count);
const char* tag_name(Tag t);

// A reference-counted allocation; tensors are views into one.
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device dev = Device::CPU;
  Tag tag = Tag::Workspace;
  Buffer(size_t bytes, Device dev, Tag tag);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// A contiguous, row-major tensor. Views share the buffer: the flat parameter and gradient
// buffers of the model are single Buffers and each weight is a view at its offset.
struct Tensor {
  std::shared_ptr<Buffer> buf;
  size_t byte_offset = 0;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;

  static Tensor empty(std::vector<int64_t> shape, DType dt, Device dev, Tag tag);
  static Tensor zeros(std::vector<int64_t> shape, DType dt, Device dev, Tag tag);

  bool defined() const { return buf != nullptr; }
  Device device() const { return buf ? buf->dev : Device::CPU; }
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  int dim() const { return int(shape.size()); }
  int64_t size(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  void* raw() const { return static_cast<char*>(buf->ptr) + byte_offset; }
  template <class T> T* data() const { return static_cast<T*>(raw()); }
  float* f32() const;  // checked accessors
  bf16* b16() const;
  int32_t* i32() const;

  // A contiguous sub-range of elements [offset, offset + prod(shape)) with a new shape.
  Tensor view(int64_t elem_offset, std::vector<int64_t> new_shape) const;
  Tensor reshape(std::vector<int64_t> new_shape) const { return view(0, std::move(new_shape)); }
  // Rows [r0, r0 + n) along the first dimension.
  Tensor rows(int64_t r0, int64_t n) const;
  std::string str() const;  // "f32[2,3]@cpu"
};

// Copies between any two devices; dtypes must match.
void copy(const Tensor& dst, const Tensor& src);
void zero(const Tensor& t);
// Host copies for tests and I/O (converting bf16 to float).
std::vector<float> to_host_f32(const Tensor& t);
void from_host_f32(const Tensor& t, const float* src);  // converts to t's dtype
// A new int32 tensor on `dev` holding v (token ids, index lists), counted as `tag`.
Tensor from_host_i32(const std::vector<int32_t>& v, Device dev, Tag tag = Tag::Workspace);
// A new fp32 tensor on `dev` holding v (weights, scales), counted as `tag`.
Tensor from_host_f32(const std::vector<float>& v, Device dev, Tag tag = Tag::Workspace);
// An int32 tensor's values on the host (routing bookkeeping the host plans with).
std::vector<int32_t> to_host_i32(const Tensor& t);

void device_sync(Device dev);

}  // namespace ts
