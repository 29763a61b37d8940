// kernel.h — a kernel's view of the emulated GPU: its indices, barriers, warp shuffles, shared
// memory and the launch. kernel.cu runs each block's threads as fibers (Boost.Context) on one host
// thread, switching only where a thread must wait for others; the rules the hardware enforces, and
// some it leaves undefined, are checked there and named with the kernel and the source line.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace emu {

// The running thread's coordinates; kernel.cu switches them with the fiber.
struct ThreadCtx {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
ThreadCtx& ctx();

// __syncthreads and __syncwarp at a source line: every live thread of the block (of the mask) must
// reach the same one. Threads that have exited count as arrived, as on NVIDIA's hardware.
void syncthreads(const char* file, int line);
void syncwarp(const char* file, int line, unsigned mask = 0xffffffffu);
struct SyncwarpAt {  // __syncwarp() and __syncwarp(mask) at a source line
  const char* file;
  int line;
  void operator()(unsigned mask = 0xffffffffu) const { syncwarp(file, line, mask); }
};
// The butterfly shuffle on raw bits (at most 8 bytes): every lane named in `mask` must be alive
// and arrive at the same shuffle; each gets the value of lane (lane ^ lane_mask) of its segment.
uint64_t shfl_xor(const char* file, int line, unsigned mask, uint64_t bits, int lane_mask, int width);
// The tensor cores' warp-wide instructions, with the PTX ISA's fragment layouts (kernel.cu):
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (D = A·B + C) and
// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16. Every lane of the warp must execute the same one.
void mma_m16n8k16_bf16(const char* file, int line, float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]);
void ldmatrix_x4(const char* file, int line, uint32_t r[4], const void* row, bool trans);
// The block's dynamic shared memory (the launch's third argument), poisoned at block start (emu.h).
void* dynamic_shared();

// Enqueues a grid on stream s: `body` runs once per thread. Returns the launch's error (a launch the
// hardware refuses: too many threads, too large a grid, too much shared memory), which is also
// the host thread's last error, as cudaGetLastError reports it after a real launch.
// `fn` is the kernel's address (nullptr where the launch could not name one function: the kernel is
// then found by `name` among the program's symbols).
cudaError_t launch(const char* name, const char* site, const void* fn, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t s, std::function<void()> body);
// cudaFuncAttributeMaxDynamicSharedMemorySize for the kernel at fn: refused (cudaErrorInvalidValue)
// when its static __shared__ arrays and `bytes` together exceed sm_90's 227 KiB.
cudaError_t set_max_dynamic_shared(const void* fn, int bytes);

// The kernel's address for TS_LAUNCH: `get` is a generic lambda that takes &kernel, and is not
// callable when the name is a template whose arguments only the call deduces.
template <class Tag, class F> const void* kernel_address(F f) { return reinterpret_cast<const void*>(f); }
template <class L> const void* address_or_null(L get) {
  if constexpr (std::is_invocable_v<L, int>) return get(0);
  else return nullptr;
}

// memcheck on a launch's arguments: each pointer a kernel takes must be null or point into device
// memory (cudaMalloc) or page-locked host memory (cudaMallocHost), as on a GPU, where any other
// address faults when the kernel dereferences it. A bad one is named (kernel, launch site, argument
// index, address) and leaves the device with a sticky cudaErrorIllegalAddress; the kernel does not
// run. Pointers inside a struct argument are not seen.
template <class T> const void* pointer_argument(const T& v) {
  if constexpr (std::is_pointer_v<T> && !std::is_function_v<std::remove_pointer_t<T>>)
    return reinterpret_cast<const void*>(uintptr_t(v));
  else return nullptr;
}
bool pointer_arguments_ok(const char* name, const char* site, const void* const* p, size_t n);

// kernel<<<grid, block, smem, stream>>>(args...) for g++. `call` is a generic lambda that calls
// the kernel, so a template kernel's arguments are deduced from the launch's as nvcc deduces them;
// the arguments are copied at the launch, as the hardware copies them into parameter space.
template <class K> struct Launch {
  const char* name;
  const char* site;
  K call;
  const void* fn;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <class... A> void operator()(A&&... a) const {
    std::tuple<std::decay_t<A>...> args(std::forward<A>(a)...);
    const bool ok = std::apply([&](const auto&... x) {
      const void* p[] = {pointer_argument(x)..., nullptr};
      return pointer_arguments_ok(name, site, p, sizeof...(A));
    }, args);
    if (ok) launch(name, site, fn, grid, block, smem, stream, [k = call, args] { std::apply(k, args); });
  }
};
template <class K>
Launch<K> make_launch(const char* name, const char* site, K call, const void* fn, dim3 grid, dim3 block, size_t smem,
                      cudaStream_t s) {
  return Launch<K>{name, site, call, fn, grid, block, smem, s};
}

template <class T> T shfl_xor_sync(const char* file, int line, unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "__shfl_xor_sync: at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = shfl_xor(file, line, mask, bits, lane_mask, width);
  memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace emu

template <class... A> cudaError_t cudaFuncSetAttribute(void (*kernel)(A...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return emu::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value);
}

#define threadIdx (::emu::ctx().thread_idx)
#define blockIdx (::emu::ctx().block_idx)
#define blockDim (::emu::ctx().block_dim)
#define gridDim (::emu::ctx().grid_dim)
constexpr int warpSize = 32;

#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::emu::SyncwarpAt{__FILE__, __LINE__}(__VA_ARGS__)
#define __shfl_xor_sync(...) ::emu::shfl_xor_sync(__FILE__, __LINE__, __VA_ARGS__)

// Static __shared__ arrays live in one linker section, which kernel.cu fills with poison at the start
// of every block (kernels run one at a time, so one copy serves every block; a template kernel's
// arrays, outside the section, are poisoned by their symbols' addresses). Dynamic shared memory
// is declared with TS_DYNAMIC_SHARED (core.h), the one place where a kernel's source differs.
#define __shared__ static __attribute__((section("ts_emu_shared")))

// What nvcc's device library provides and g++'s does not.
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) {
  return a > b ? std::common_type_t<A, B>(a) : std::common_type_t<A, B>(b);
}
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? std::common_type_t<A, B>(a) : std::common_type_t<A, B>(b);
}
