// core.h — the pieces every file stands on: devices, dtypes, bf16, check macros, fatal(),
// the tagging allocator and the Tensor type.
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

#ifdef TS_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#if defined(TS_CUDA_EMU) && !(defined(TS_EMU_CUDA_RUNTIME) && defined(TS_EMU_CUBLAS))
#error "the emulated GPU's build found NVIDIA's headers: common/emu/ must come first on the include path"
#endif
#endif

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

// One launch form that nvcc and the emulated GPU's g++ both read (g++ cannot parse <<<>>>):
//   TS_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...)
// and the declaration of a kernel's dynamic shared memory, the one line whose CUDA spelling
// (`extern __shared__ T name[]`) no macro can stand in for.
#define TS_STR_(x) #x
#define TS_STR(x) TS_STR_(x)
#ifdef TS_CUDA_EMU
#define TS_LAUNCH(grid, block, smem, stream, ...) \
  ::emu::make_launch(#__VA_ARGS__, __FILE__ ":" TS_STR(__LINE__), [](auto... a_) { __VA_ARGS__(a_...); }, grid, block, smem, stream)
#define TS_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::emu::dynamic_shared())
#else
#define TS_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define TS_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

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
// Called by fatal() with its message before the job is aborted (the flight recorder's dump).
void set_fatal_hook(void (*hook)(const char* message));
// Called by fatal() first, whose return it appends to the message: what was cleaned up (a
// failed save's temporary files).
void set_fatal_cleanup(std::string (*cleanup)());
// How config_error() finalises, every rank being there: the comm layer sets comm_finalize (its
// communicators released in order, then MPI_Finalize); before comm_init, nothing.
void set_finalize_hook(void (*finalize)());

// Called by the run's step loop so fatal() and the watchdog can name the step.
void set_current_step(long step);
long current_step();

#ifdef TS_CUDA
const char* cublas_error_string(cublasStatus_t s);
#define CUDA_CHECK(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) fatal("CUDA error %s: %s", #x, cudaGetErrorString(e_));     \
  } while (0)
#define CUBLAS_CHECK(x)                                                                \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                   \
      fatal("cuBLAS error %s: %s", #x, ::ts::cublas_error_string(s_));                 \
  } while (0)
// After every kernel launch: launch-configuration errors surface here with file:line.
#define KERNEL_CHECK() CUDA_CHECK(cudaGetLastError())
#endif

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
TS_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
TS_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
TS_HD float bf16_to_float(bf16 h) { return bits_float(uint32_t(h.bits) << 16); }
TS_HD bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{uint16_t(u >> 16)};
}
// Loads and stores that let one templated kernel serve fp32 and bf16 storage.
TS_HD float ld(float x) { return x; }
TS_HD float ld(bf16 x) { return bf16_to_float(x); }
template <class T> TS_HD T st(float x);
template <> TS_HD float st<float>(float x) { return x; }
template <> TS_HD bf16 st<bf16>(float x) { return float_to_bf16(x); }

// ---------------------------------------------------------------------------------------------
// The tagging allocator: every allocation carries a category, and current and peak bytes are
// kept per category and in total, per device. This is the "measured" column that runs print
// next to the playbook's memory formulas.
// ---------------------------------------------------------------------------------------------
enum class Tag : uint8_t { Params, Grads, Optimizer, Activations, Comm, Workspace, Count };
constexpr int kNumTags = int(Tag::Count);
const char* tag_name(Tag t);

// The per-category and total figures are bytes in use by tensors (as requested, unrounded).
// `reserved` is what the allocator holds from the system: the blocks in use, rounded up, plus
// the freed blocks it caches for reuse.
struct MemStats {
  size_t current[kNumTags] = {};
  size_t peak[kNumTags] = {};      // each category's own peak
  size_t at_peak[kNumTags] = {};   // each category's bytes at the moment of the total peak
  size_t total_current = 0;
  size_t total_peak = 0;
  size_t reserved = 0;
  size_t reserved_peak = 0;
};

void* mem_alloc(size_t bytes, Device dev, Tag tag);
void mem_free(void* p, size_t bytes, Device dev, Tag tag);
// The block an allocation of `bytes` takes (and a freed one returns to the cache): 256-B multiples
// to 64 KiB, then eight sizes per power of two.
size_t mem_block_size(size_t bytes);
const MemStats& mem_stats(Device dev);
void mem_reset_peaks(Device dev);  // peaks := current (used between measured phases)

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

#ifdef TS_CUDA
// The compute stream and cuBLAS handle every CUDA kernel uses.
cudaStream_t compute_stream();
cublasHandle_t cublas();
// The host's one way to wait for the compute stream (device-to-host copies, device_sync, sums
// read on the host). NCCL collectives are ordered before later kernels by stream waits, not by
// the host (comm.cu), so a stalled peer shows here as a wait that does not end: while it waits,
// the watch set by the comm layer runs every few milliseconds (it checks the NCCL operations in
// flight and ends the job past the watchdog's timeout), and `synced` once the stream is idle.
void sync_compute_stream();
struct StreamWatch {
  std::function<void(double waited_s)> waiting;
  std::function<void()> synced;
};
void set_stream_watch(StreamWatch w);
#endif
void device_sync(Device dev);

}  // namespace ts
