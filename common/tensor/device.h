// device.h — what kernels, their launches and the CUDA calls stand on, beside core.h: the CUDA
// headers (NVIDIA's, or the emulated GPU's stand-ins), the one launch form nvcc and g++ both
// read, bf16's bit-exact rounding and the loads/stores that let one kernel serve fp32 and bf16,
// the CUDA and cuBLAS check macros, and the compute stream.
#pragma once
#include <cstring>
#include <functional>

#include "tensor/core.h"

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
// The emulator's launch also takes the kernel's address where the source names one function (a
// plain kernel, or a template's arguments spelled out), so cudaFuncSetAttribute's opt-in and the
// kernel's static __shared__ arrays are those of the kernel launched; a template kernel whose
// arguments the call deduces has no address here (nullptr) and is found by its name.
#define TS_LAUNCH(grid, block, smem, stream, ...)                                                             \
  ::emu::make_launch(#__VA_ARGS__, __FILE__ ":" TS_STR(__LINE__), [](auto... a_) { __VA_ARGS__(a_...); },      \
                     ::emu::address_or_null([](auto t_) -> decltype(::emu::kernel_address<decltype(t_)>(&__VA_ARGS__)) { \
                       return ::emu::kernel_address<decltype(t_)>(&__VA_ARGS__);                                \
                     }),                                                                                      \
                     grid, block, smem, stream)
#define TS_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::emu::dynamic_shared())
#else
#define TS_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define TS_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif
namespace ts {

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
}  // namespace ts
