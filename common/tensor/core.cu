// core.cu — errors, the tagging allocator, tensors and copies.
#include "tensor/core.h"
#include "tensor/allocator.h"
#include "tensor/hooks.h"
#include "tensor/device.h"
#include "tensor/shape_only.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

namespace ts {

// ----- errors ----------------------------------------------------------------------------------

int world_rank() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return 0;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

static long g_step = -1;
void set_current_step(long step) { g_step = step; }

long current_step() { return g_step; }

// Ends every rank of the job with `status` after this rank's message is out.
[[noreturn]] static void abort_job(int status) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  // MPI_Abort takes every rank of the job down with a non-zero status: an error on one rank
  // must never leave the others waiting in a collective. The pause first lets the launcher
  // forward the message: mpirun stops relaying output as soon as the abort reaches it.
  if (init && !fin) {
    usleep(300 * 1000);
    MPI_Abort(MPI_COMM_WORLD, status);
  }
  exit(status);
}

// The printf-style message of an error function, formatted once.
#define TS_FORMAT_MESSAGE(msg, fmt) \
  char msg[2048];                   \
  va_list ap;                       \
  va_start(ap, fmt);                \
  vsnprintf(msg, sizeof msg, fmt, ap); \
  va_end(ap)

static void (*g_fatal_hook)(const char*) = nullptr;
void set_fatal_hook(void (*hook)(const char* message)) { g_fatal_hook = hook; }
static std::string (*g_fatal_cleanup)() = nullptr;
static void (*g_recycle_hook)(void*, size_t, void*) = nullptr;
void set_recycle_hook(void (*hook)(void* p, size_t bytes, void* stream)) { g_recycle_hook = hook; }
void set_fatal_cleanup(std::string (*cleanup)()) { g_fatal_cleanup = cleanup; }
static void (*g_finalize)() = nullptr;  // comm_init sets comm_finalize
void set_finalize_hook(void (*finalize)()) { g_finalize = finalize; }

void fatal_at(const char* file, int line, const char* fmt, ...) {
  TS_FORMAT_MESSAGE(msg, fmt);
  if (auto cleanup = g_fatal_cleanup) {
    g_fatal_cleanup = nullptr;
    const std::string said = cleanup();
    strncat(msg, said.c_str(), sizeof msg - strlen(msg) - 1);
  }
  if (g_step >= 0)
    fprintf(stderr, "error [rank %d, step %ld] %s:%d: %s\n", world_rank(), g_step, file, line, msg);
  else
    fprintf(stderr, "error [rank %d] %s:%d: %s\n", world_rank(), file, line, msg);
  fflush(stderr);
  if (auto hook = g_fatal_hook) {
    g_fatal_hook = nullptr;  // a failure inside the hook ends the job without it
    hook(msg);
  }
  abort_job(1);
}

void rank_error(const char* fmt, ...) {
  TS_FORMAT_MESSAGE(msg, fmt);
  fprintf(stderr, "error [rank %d]: %s\n", world_rank(), msg);
  fflush(stderr);
  abort_job(2);
}

static std::string g_error_where;  // ConfigErrorWhere's, "" outside one

ConfigErrorWhere::ConfigErrorWhere(std::string where) : outer_(g_error_where) { g_error_where = std::move(where); }
ConfigErrorWhere::~ConfigErrorWhere() { g_error_where = outer_; }

void config_error(const char* fmt, ...) {
  TS_FORMAT_MESSAGE(msg, fmt);
  if (world_rank() == 0) {
    fprintf(stderr, "error: %s%s%s\n", g_error_where.c_str(), g_error_where.empty() ? "" : ": ", msg);
    fflush(stderr);
  }
  if (g_finalize) g_finalize();  // every rank is here, so the watched finalisation completes
  exit(2);
}

#ifdef TS_CUDA
const char* cublas_error_string(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "unknown cuBLAS status";
  }
}
#endif

// ----- devices and dtypes ----------------------------------------------------------------------

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }
const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::F8E4M3: return "f8e4m3";
    case DType::F8E5M2: return "f8e5m2";
  }
  return "?";
}
size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16: return 2;
    case DType::F8E4M3:
    case DType::F8E5M2: return 1;
    default: return 4;
  }
}

bool cuda_available() {
#ifdef TS_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::CPU;
  if (s == "shape") {  // CPU tensors without values (tensor/shape_only.h)
    enable_shape_only();
    return Device::CPU;
  }
  if (s == "cuda") {
#ifndef TS_CUDA
    config_error("--device cuda: this binary was built without CUDA (build with nvcc, or use --device cpu)");
#endif
    if (!cuda_available()) config_error("--device cuda: no GPU is visible");
    return Device::CUDA;
  }
#ifdef TS_CUDA_EMU
  // The emulated GPU checks the CUDA code; it is never what a run should pick by itself.
  if (s == "auto") return Device::CPU;
#endif
  if (s == "auto") return cuda_available() ? Device::CUDA : Device::CPU;
  config_error("--device must be auto, cpu, cuda or shape (got '%s')", s.c_str());
}

// ----- the tagging allocator -------------------------------------------------------------------

const char* tag_name(Tag t) {
  static const char* names[] = {"params", "grads", "optimizer", "activations", "comm", "workspace"};
  return names[int(t)];
}

static MemStats g_stats[2];
static std::mutex g_mem_mu;
static AllocObserver g_observer = nullptr;
void set_alloc_observer(AllocObserver observer) { g_observer = observer; }

// `fresh`: bytes of a new block from the system behind this allocation (0 when it came from the
// cache).
static void account(Device dev, Tag tag, size_t bytes, bool add, size_t fresh = 0) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  MemStats& s = g_stats[int(dev)];
  int t = int(tag);
  if (add) {
    s.reserved += fresh;
    if (s.reserved > s.reserved_peak) s.reserved_peak = s.reserved;
    s.current[t] += bytes;
    s.total_current += bytes;
    if (s.current[t] > s.peak[t]) s.peak[t] = s.current[t];
    if (s.total_current > s.total_peak) {
      s.total_peak = s.total_current;
      for (int i = 0; i < kNumTags; i++) s.at_peak[i] = s.current[i];
    }
  } else {
    s.current[t] -= bytes;
    s.total_current -= bytes;
  }
  if (g_observer) g_observer(dev, tag, add ? (long long)bytes : -(long long)bytes, s);
}

// Freed blocks are kept for reuse, by block size: a training step allocates the same activation
// sizes every step, and handing them back each time costs a few percent of a step (CPU: munmap and
// a page fault per 4 KiB on the next touch; CUDA: cudaFree synchronises the device). The
// categories count what tensors hold; `reserved` counts this cache as well.
static std::multimap<size_t, void*> g_cache[2];

// A block's size: a multiple of 256 B up to 64 KiB; above, a multiple of an eighth of the largest
// power of two not above the request (at most 12.5% more, eight sizes per octave, as PyTorch's
// caching allocator's power-of-two divisions). The tensors of a mixture of experts change size
// with every step's routing (each expert's rows); rounded, they fall into the blocks earlier steps
// freed instead of asking the system for fresh pages, and the cache stops growing with every new
// size.
size_t mem_block_size(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  if (n <= (size_t(64) << 10)) return n;
  size_t octave = size_t(64) << 10;
  while (octave * 2 <= n) octave *= 2;
  const size_t step = octave / 8;
  return (n + step - 1) / step * step;
}

static void* raw_alloc(size_t n, Device dev) {
  void* p = nullptr;
  if (dev == Device::CPU) return shape_only() ? shape_block(n) : aligned_alloc(64, n);  // whole cache lines
#ifdef TS_CUDA
  if (cudaMalloc(&p, n) != cudaSuccess) {
    cudaGetLastError();
    // Out of memory: give the cached blocks back and try once more.
    {
      std::lock_guard<std::mutex> lk(g_mem_mu);
      for (auto& [sz, q] : g_cache[int(dev)]) {
        cudaFree(q);
        g_stats[int(dev)].reserved -= sz;
      }
      g_cache[int(dev)].clear();
    }
    if (cudaMalloc(&p, n) != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
  }
#endif
  return p;
}

void* mem_alloc(size_t bytes, Device dev, Tag tag) {
#ifndef TS_CUDA
  if (dev == Device::CUDA) fatal("CUDA allocation in a CPU-only build");
#endif
  const size_t n = mem_block_size(bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    auto it = g_cache[int(dev)].find(n);
    if (it != g_cache[int(dev)].end()) {
      p = it->second;
      g_cache[int(dev)].erase(it);
    }
  }
#ifdef TS_CUDA
  if (p && dev == Device::CUDA && g_recycle_hook) g_recycle_hook(p, n, compute_stream());  // hooks.h
#endif
  size_t fresh = 0;
  if (!p) {
    p = raw_alloc(n, dev);
    fresh = p ? n : 0;
  }
  if (!p) {
    const MemStats& s = g_stats[int(dev)];
    fprintf(stderr, "out of %s memory allocating %zu bytes for %s; allocated now by category:\n",
            dev == Device::CPU ? "host" : "CUDA", bytes, tag_name(tag));
    for (int i = 0; i < kNumTags; i++) fprintf(stderr, "  %-12s %12zu bytes\n", tag_name(Tag(i)), s.current[i]);
    fatal("out of %s memory", dev == Device::CPU ? "host" : "CUDA");
  }
  account(dev, tag, bytes, true, fresh);
  return p;
}

void mem_free(void* p, size_t bytes, Device dev, Tag tag) {
  if (!p) return;
  account(dev, tag, bytes, false);
  const size_t n = mem_block_size(bytes);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_cache[int(dev)].insert({n, p});
}

const MemStats& mem_stats(Device dev) { return g_stats[int(dev)]; }

void mem_reset_peaks(Device dev) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  MemStats& s = g_stats[int(dev)];
  for (int i = 0; i < kNumTags; i++) s.peak[i] = s.at_peak[i] = s.current[i];
  s.total_peak = s.total_current;
  s.reserved_peak = s.reserved;
}

Buffer::Buffer(size_t bytes_, Device dev_, Tag tag_) : bytes(bytes_), dev(dev_), tag(tag_) {
  ptr = mem_alloc(bytes, dev, tag);
}
Buffer::~Buffer() { mem_free(ptr, bytes, dev, tag); }

// ----- tensors ---------------------------------------------------------------------------------

static int64_t prod(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::empty(std::vector<int64_t> shape, DType dt, Device dev, Tag tag) {
  for (int64_t d : shape) TS_CHECK(d >= 0, "negative dimension in tensor shape");
  Tensor t;
  t.shape = std::move(shape);
  t.dtype = dt;
  t.buf = std::make_shared<Buffer>(size_t(prod(t.shape)) * dtype_size(dt), dev, tag);
  return t;
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dt, Device dev, Tag tag) {
  Tensor t = empty(std::move(shape), dt, dev, tag);
  zero(t);
  return t;
}

int64_t Tensor::numel() const { return prod(shape); }

float* Tensor::f32() const {
  TS_CHECK(dtype == DType::F32, "expected an f32 tensor, got %s", str().c_str());
  return data<float>();
}
bf16* Tensor::b16() const {
  TS_CHECK(dtype == DType::BF16, "expected a bf16 tensor, got %s", str().c_str());
  return data<bf16>();
}
int32_t* Tensor::i32() const {
  TS_CHECK(dtype == DType::I32, "expected an i32 tensor, got %s", str().c_str());
  return data<int32_t>();
}

Tensor Tensor::view(int64_t elem_offset, std::vector<int64_t> new_shape) const {
  TS_CHECK(elem_offset >= 0 && elem_offset + prod(new_shape) <= numel(),
           "view [%lld, +%lld) out of range of %s", (long long)elem_offset, (long long)prod(new_shape),
           str().c_str());
  Tensor t = *this;
  t.byte_offset = byte_offset + size_t(elem_offset) * dtype_size(dtype);
  t.shape = std::move(new_shape);
  return t;
}

Tensor Tensor::rows(int64_t r0, int64_t n) const {
  std::vector<int64_t> s = shape;
  int64_t row = numel() / s[0];
  s[0] = n;
  return view(r0 * row, s);
}

std::string Tensor::str() const {
  std::string s = std::string(dtype_name(dtype)) + "[";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]@" + device_name(device());
}

#ifdef TS_CUDA
static cudaMemcpyKind copy_kind(Device dst, Device src) {
  if (dst == Device::CPU) return src == Device::CPU ? cudaMemcpyHostToHost : cudaMemcpyDeviceToHost;
  return src == Device::CPU ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice;
}
#endif

void copy(const Tensor& dst, const Tensor& src) {
  TS_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: %s <- %s", dst.str().c_str(),
           src.str().c_str());
  TS_SHAPE_ONLY_SKIP();
  if (dst.device() == Device::CPU && src.device() == Device::CPU) {
    memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
#ifdef TS_CUDA
  CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), copy_kind(dst.device(), src.device()),
                             compute_stream()));
  if (dst.device() == Device::CPU) sync_compute_stream();
#endif
}

void zero(const Tensor& t) {
  TS_SHAPE_ONLY_SKIP();
  if (t.device() == Device::CPU) {
    memset(t.raw(), 0, t.nbytes());
    return;
  }
#ifdef TS_CUDA
  CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), compute_stream()));
#endif
}

std::vector<float> to_host_f32(const Tensor& t) {
  std::vector<float> out(t.numel());
  Tensor h = t;
  if (t.device() != Device::CPU) {
    h = Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Workspace);
    copy(h, t);
  }
  if (t.dtype == DType::F32) {
    memcpy(out.data(), h.raw(), out.size() * 4);
  } else if (t.dtype == DType::BF16) {
    for (size_t i = 0; i < out.size(); i++) out[i] = bf16_to_float(h.b16()[i]);
  } else {
    for (size_t i = 0; i < out.size(); i++) out[i] = float(h.i32()[i]);
  }
  return out;
}

void from_host_f32(const Tensor& t, const float* src) {
  Tensor h = t;
  if (t.device() != Device::CPU) h = Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Workspace);
  int64_t n = t.numel();
  if (t.dtype == DType::F32) {
    memcpy(h.raw(), src, size_t(n) * 4);
  } else if (t.dtype == DType::BF16) {
    for (int64_t i = 0; i < n; i++) h.b16()[i] = float_to_bf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; i++) h.i32()[i] = int32_t(src[i]);
  }
  if (t.device() != Device::CPU) copy(t, h);
}

Tensor from_host_f32(const std::vector<float>& v, Device dev, Tag tag) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::F32, dev, tag);
  from_host_f32(t, v.data());
  return t;
}

std::vector<int32_t> to_host_i32(const Tensor& t) {
  TS_CHECK(t.dtype == DType::I32, "to_host_i32 of a non-int32 tensor");
  if (t.device() == Device::CPU) return std::vector<int32_t>(t.i32(), t.i32() + t.numel());
  Tensor h = Tensor::empty(t.shape, DType::I32, Device::CPU, Tag::Workspace);
  copy(h, t);
  return std::vector<int32_t>(h.i32(), h.i32() + h.numel());
}

Tensor from_host_i32(const std::vector<int32_t>& v, Device dev, Tag tag) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I32, dev, tag);
  Tensor h = dev == Device::CPU ? t : Tensor::empty(t.shape, DType::I32, Device::CPU, Tag::Workspace);
  std::copy(v.begin(), v.end(), h.i32());
  if (dev != Device::CPU) copy(t, h);
  return t;
}

#ifdef TS_CUDA
cudaStream_t compute_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}
cublasHandle_t cublas() {
  static cublasHandle_t h = [] {
    cublasHandle_t hh;
    CUBLAS_CHECK(cublasCreate(&hh));
    CUBLAS_CHECK(cublasSetStream(hh, compute_stream()));
    // Deterministic results: no atomics-based split-K reductions.
    CUBLAS_CHECK(cublasSetAtomicsMode(hh, CUBLAS_ATOMICS_NOT_ALLOWED));
    return hh;
  }();
  return h;
}
#endif

#ifdef TS_CUDA
static StreamWatch g_watch;
void set_stream_watch(StreamWatch w) { g_watch = std::move(w); }

void sync_compute_stream() {
  if (!g_watch.waiting) {
    CUDA_CHECK(cudaStreamSynchronize(compute_stream()));
  } else {
    cudaEvent_t idle;
    CUDA_CHECK(cudaEventCreateWithFlags(&idle, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(idle, compute_stream()));
    const auto t0 = std::chrono::steady_clock::now();
    cudaError_t e;
    while ((e = cudaEventQuery(idle)) == cudaErrorNotReady) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > 0.005) {  // a short wait is the normal case: spin; then check and sleep
        g_watch.waiting(waited);
        usleep(200);
      }
    }
    CUDA_CHECK(e);
    CUDA_CHECK(cudaEventDestroy(idle));
  }
  if (g_watch.synced) g_watch.synced();
}
#endif

void device_sync(Device dev) {
#ifdef TS_CUDA
  if (dev == Device::CUDA) sync_compute_stream();
#else
  (void)dev;
#endif
}

}  // namespace ts
