// ranks: 1
// The emulated GPU's own checks (common/emu/kernel.cu, runtime.cu): each rule it enforces has a
// kernel or a call here with the defect seeded, and the case asserts that the emulator refused it
// and named it — a divergent barrier, a shuffle naming an exited lane, launches the hardware
// refuses, a stream that reads without waiting for the stream that writes, a pinned staging
// buffer refilled before its asynchronous copy has run, a barrier that is missing (the block's threads run the other way round and the result changes) — and that correct
// kernels give the same bits in either order. Only in the emulated build (make CUDA=emu).
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/allocator.h"
#include "tensor/device.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "emu.h"
#include "emu_util.h"
#include "test_util.h"
#include "tensor/rng.h"
#include "kernels/tensor_core.h"

namespace {

// A block-wide sum through shared memory and warp shuffles, as kernels_cuda.cu's block_sum does.
__global__ void block_sum_kernel(float* out, const float* x, int n) {
  __shared__ float partial[32];
  float v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += x[i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; w++) s += partial[w];
    out[blockIdx.x] = s;
  }
}

// Seeded: threads of the first warp wait at one barrier, the others at another.
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Seeded: lanes 16..31 exit, then the rest shuffle with a full mask.
__global__ void exited_lane_shuffle_kernel(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  float v = float(threadIdx.x);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Exited threads count as arrived at __syncthreads (as on NVIDIA's hardware): legal.
__global__ void early_exit_barrier_kernel(float* out) {
  __shared__ float s[64];
  if (threadIdx.x >= 32) return;
  s[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[31 - threadIdx.x];
}

// Seeded: reads a neighbour's shared-memory slot with no barrier between write and read.
__global__ void missing_barrier_kernel(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = float(threadIdx.x);
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

__global__ void write_kernel(float* y, float v, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = v;
}
__global__ void copy_kernel(float* y, const float* x, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i];
}
__global__ void nothing_kernel(float*) {}

// Butterfly shuffles within segments of `width` lanes; lanes at or above `active` take no part
// (the mask names only the lanes below it).
__global__ void segment_shuffle_kernel(int* out, int lane_mask, int width, int active) {
  const unsigned mask = active == 32 ? 0xffffffffu : (1u << active) - 1;
  if (int(threadIdx.x) < active) out[threadIdx.x] = __shfl_xor_sync(mask, int(threadIdx.x), lane_mask, width);
}

// Reads its static __shared__ array without writing it: a template kernel's array, which g++ keeps
// outside the section of the others, must start as poison too.
template <class T> __global__ void template_shared_kernel(T* out, int write) {
  __shared__ T unwritten[32];
  if (write) unwritten[threadIdx.x] = 1;  // never (write is 0): g++ may not fold the reads to the zero of .bss
  out[threadIdx.x] = unwritten[threadIdx.x];
}

// Seeded: writes through whatever pointer it is given (a host std::vector's, below).
__global__ void write_42_kernel(float* out) { out[threadIdx.x] = 42; }

// Seeded: a 16-byte vector load at an address 4 bytes past 16-byte alignment (attention_v2's Chunk).
struct alignas(16) Chunk16 {
  uint32_t v[4];
};
__global__ void misaligned_chunk_kernel(Chunk16* dst, const char* src) {
  dst[threadIdx.x] = *reinterpret_cast<const Chunk16*>(src + 4 + 16 * threadIdx.x);
}

// Shared memory at sm_90's limits: 52 KiB of static arrays (ptxas refuses such a kernel), 40 KiB
// (legal alone, and with up to 8 KiB of dynamic memory without the opt-in), the same 52 KiB in a
// template whose argument the launch deduces (found by name), and two kernels that use only
// dynamic shared memory, for the opt-in that is one kernel's and not the other's.
__global__ void static_52k_kernel(float* out) {
  __shared__ float big[13 * 1024];
  big[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}
template <class T> __global__ void static_52k_template_kernel(T* out) {
  __shared__ T big[13 * 1024];
  big[threadIdx.x] = T(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}
__global__ void static_40k_kernel(float* out) {
  __shared__ float s[10 * 1024];
  s[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
__global__ void dynamic_a_kernel(float* out) {
  TS_DYNAMIC_SHARED(float, smem);
  smem[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = smem[(threadIdx.x + 1) % blockDim.x];
}
__global__ void dynamic_b_kernel(float* out) {
  TS_DYNAMIC_SHARED(float, smem);
  smem[threadIdx.x] = 2.f * float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = smem[(threadIdx.x + 1) % blockDim.x];
}

// One warp multiplies a 16 × 16 bf16 A (row-major) by a 16 × 8 bf16 B (stored column by column)
// and adds a 16 × 8 fp32 C, building its fragments as the PTX ISA's tables say (written here
// independently of the emulator): lane l, g = l / 4, t = l % 4. `via_ldmatrix`: A's fragments come
// from shared memory by ldmatrix.x4 instead (lane l points at row l % 8 + 8·(l / 8 % 2), column
// 8·(l / 16) of the tile), and `loaded` receives both versions for comparison. `seed_defect`:
// the lane swaps two of A's registers, the kind of fragment-index slip the emulator must expose.
__global__ void mma_tile_kernel(float* D, uint32_t* loaded, const uint16_t* A, const uint16_t* B, const float* C,
                                int via_ldmatrix, int seed_defect) {
  TS_DYNAMIC_SHARED(uint16_t, tile);
  const int l = int(threadIdx.x), g = l / 4, t = l % 4;
  auto pair = [](uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; };
  uint32_t a[4], b[2];
  float c[4], d[4];
  for (int r = 0; r < 4; r++) {
    const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
    a[r] = pair(A[row * 16 + col], A[row * 16 + col + 1]);
  }
  for (int r = 0; r < 2; r++) b[r] = pair(B[g * 16 + 2 * t + 8 * r], B[g * 16 + 2 * t + 8 * r + 1]);
  for (int i = 0; i < 4; i++) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
  if (via_ldmatrix) {
    for (int i = l; i < 256; i += 32) tile[i] = A[i];
    __syncwarp();
    uint32_t r[4];
    TS_LDMATRIX_X4(r, tile + (l % 8 + 8 * (l / 8 % 2)) * 16 + 8 * (l / 16));
    for (int i = 0; i < 4; i++) loaded[l * 8 + i] = a[i], loaded[l * 8 + 4 + i] = r[i], a[i] = r[i];
  }
  if (seed_defect) std::swap(a[1], a[2]);
  TS_MMA_M16N8K16_BF16(d, a, b, c);
  for (int i = 0; i < 4; i++) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}

// ldmatrix.x4.trans turns a row-major 16 × 16 tile M (row k, column n) into mma's B fragments
// for its two 8-column halves: by the PTX ISA, lane l (g = l / 4, t = l % 4) holds in register r of
// half h the elements M[2t + 8r][8h + g] and M[2t + 8r + 1][8h + g]. Lane l points at row
// l % 8 + 8·(l / 8 % 2), column 8·(l / 16), so matrix j covers rows 8·(j % 2).., columns 8·(j / 2)..
// `loaded` receives, per lane, the hand-built registers, then ldmatrix's; `trans` 0 is the seeded
// slip of loading without .trans. Then D = A·M (16 × 16, A row-major from ldmatrix as in
// mma_tile_kernel) through two mma.sync, one per half of M: the layout as attention uses it.
__global__ void ldmatrix_trans_kernel(uint32_t* loaded, float* D, const uint16_t* A, const uint16_t* M, int trans) {
  TS_DYNAMIC_SHARED(uint16_t, tile);
  uint16_t* atile = tile + 256;
  const int l = int(threadIdx.x), g = l / 4, t = l % 4;
  for (int i = l; i < 256; i += 32) tile[i] = M[i], atile[i] = A[i];
  __syncwarp();
  uint32_t r[4], a[4];
  const int row = l % 8 + 8 * (l / 8 % 2), col = 8 * (l / 16);
  if (trans) TS_LDMATRIX_X4_TRANS(r, tile + row * 16 + col);
  else TS_LDMATRIX_X4(r, tile + row * 16 + col);
  TS_LDMATRIX_X4(a, atile + row * 16 + col);
  for (int h = 0; h < 2; h++) {
    for (int q = 0; q < 2; q++) {
      const int k = 2 * t + 8 * q, n = 8 * h + g;
      loaded[l * 8 + 2 * h + q] = uint32_t(M[k * 16 + n]) | uint32_t(M[(k + 1) * 16 + n]) << 16;
      loaded[l * 8 + 4 + 2 * h + q] = r[2 * h + q];
    }
    float c[4] = {}, d[4];
    TS_MMA_M16N8K16_BF16(d, a, r + 2 * h, c);
    for (int i = 0; i < 4; i++) D[(g + 8 * (i / 2)) * 16 + 8 * h + 2 * t + i % 2] = d[i];
  }
}

// Seeded: ldmatrix given an address in global memory.
__global__ void ldmatrix_global_kernel(uint32_t* out, const uint16_t* A) {
  uint32_t r[4];
  TS_LDMATRIX_X4(r, A + (threadIdx.x % 16) * 16);
  out[threadIdx.x] = r[0];
}

// Seeded: half the warp exits before the mma.
__global__ void mma_half_warp_kernel(float* D) {
  if (threadIdx.x >= 16) return;
  uint32_t a[4] = {}, b[2] = {};
  float c[4] = {}, d[4];
  TS_MMA_M16N8K16_BF16(d, a, b, c);
  D[threadIdx.x] = d[0];
}

float* device_floats(const std::vector<float>& h) { return tst::to_device(h); }
// Kernel results, once the device has run everything queued.
template <class T> std::vector<T> host_copy(const T* d, size_t n) {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  return tst::to_host(d, n);
}
std::vector<float> host_floats(const float* d, size_t n) { return host_copy(d, n); }
// After a seeded fault the device is sticky-broken, as real hardware is; the next case starts afresh.
struct Fresh {
  Fresh() {
    setenv("TS_EMU_QUIET", "1", 1);
    emu::clear_report();
    cudaGetLastError();
  }
  ~Fresh() {
    cudaDeviceSynchronize();
    emu::clear_report();
    emu::set_reverse_order(false);
    cudaGetLastError();
  }
};

}  // namespace

TEST_CASE("emulated GPU: a block sum through shared memory and shuffles is exact and order-independent", "[emu]") {
  Fresh fresh;
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); i++) x[i] = float(i % 7);  // small integers: every order sums exactly
  float* dx = device_floats(x);
  float* dout = device_floats({0, 0});
  for (bool reverse : {false, true}) {
    emu::set_reverse_order(reverse);
    TS_LAUNCH(2, 256, 0, nullptr, block_sum_kernel)(dout, dx, int(x.size()));
    REQUIRE(cudaGetLastError() == cudaSuccess);
    std::vector<float> out = host_floats(dout, 2);
    double want = 0;
    for (float v : x) want += v;
    CHECK(out[0] == float(want));
    CHECK(out[1] == float(want));
  }
  cudaFree(dx);
  cudaFree(dout);
}

TEST_CASE("emulated GPU: cudaMalloc'd memory starts as NaN", "[emu]") {
  Fresh fresh;
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 64) == cudaSuccess);
  std::vector<float> h = host_floats(static_cast<float*>(p), 16);
  for (float v : h) CHECK(std::isnan(v));
  cudaFree(p);
}

TEST_CASE("emulated GPU: a divergent __syncthreads is named with its kernel and lines", "[emu]") {
  Fresh fresh;
  float* d = device_floats(std::vector<float>(64, 0));
  TS_LAUNCH(1, 64, 0, nullptr, divergent_barrier_kernel)(d);
  CHECK(cudaGetLastError() == cudaSuccess);  // the launch itself is legal
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
  const std::string r = emu::last_report();
  CHECK(r.find("divergent __syncthreads") != std::string::npos);
  CHECK(r.find("divergent_barrier_kernel") != std::string::npos);
  CHECK(r.find("test_emu.cpp") != std::string::npos);
}

TEST_CASE("emulated GPU: a shuffle whose mask names an exited lane is refused", "[emu]") {
  Fresh fresh;
  float* d = device_floats(std::vector<float>(32, 0));
  TS_LAUNCH(1, 32, 0, nullptr, exited_lane_shuffle_kernel)(d);
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
  const std::string r = emu::last_report();
  CHECK(r.find("__shfl_xor_sync") != std::string::npos);
  CHECK(r.find("has exited") != std::string::npos);
  CHECK(r.find("exited_lane_shuffle_kernel") != std::string::npos);
}

TEST_CASE("emulated GPU: exited threads count as arrived at __syncthreads", "[emu]") {
  Fresh fresh;
  float* d = device_floats(std::vector<float>(32, 0));
  TS_LAUNCH(1, 64, 0, nullptr, early_exit_barrier_kernel)(d);
  std::vector<float> out = host_floats(d, 32);
  for (int i = 0; i < 32; i++) CHECK(out[size_t(i)] == float(31 - i));
  cudaFree(d);
}

TEST_CASE("emulated GPU: a missing barrier shows as a result that changes with the threads' order", "[emu]") {
  Fresh fresh;
  float* d = device_floats(std::vector<float>(64, 0));
  std::vector<float> runs[2];
  for (int reverse = 0; reverse < 2; reverse++) {
    emu::set_reverse_order(reverse);
    TS_LAUNCH(1, 64, 0, nullptr, missing_barrier_kernel)(d);
    runs[reverse] = host_floats(d, 64);
  }
  // Forward, thread 63 reads slot 0 after thread 0 wrote it; reversed, thread 62 reads slot 63
  // after it was written but thread 0 reads slot 1 before: some slot still holds the 0xFF pattern.
  bool differs = memcmp(runs[0].data(), runs[1].data(), 64 * 4) != 0;
  CHECK(differs);
  int nan_forward = 0, nan_reverse = 0;
  for (int i = 0; i < 64; i++) nan_forward += std::isnan(runs[0][size_t(i)]), nan_reverse += std::isnan(runs[1][size_t(i)]);
  CHECK(nan_forward + nan_reverse > 0);
  cudaFree(d);
}

TEST_CASE("emulated GPU: launches the hardware refuses are named", "[emu]") {
  Fresh fresh;
  float* d = device_floats({0});
  TS_LAUNCH(1, 1025, 0, nullptr, nothing_kernel)(d);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK(emu::last_report().find("1025 threads per block") != std::string::npos);
  CHECK(emu::last_report().find("nothing_kernel") != std::string::npos);
  TS_LAUNCH(dim3(1, 65536), 32, 0, nullptr, nothing_kernel)(d);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK(emu::last_report().find("65535") != std::string::npos);
  TS_LAUNCH(1, 32, 48 * 1024 + 4, nullptr, nothing_kernel)(d);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(emu::last_report().find("dynamic shared memory") != std::string::npos);
  TS_LAUNCH(1, 32, 48 * 1024, nullptr, nothing_kernel)(d);  // at the limit: legal
  CHECK(cudaGetLastError() == cudaSuccess);
  cudaFree(d);
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The launch knows its kernel: the static arrays counted and the opt-in honoured are that kernel's.
TEST_CASE("emulated GPU: shared memory is held to sm_90's limits, the opt-in per kernel", "[emu]") {
  Fresh fresh;
  float* d = device_floats(std::vector<float>(32, 0));
  auto refused = [](const std::string& part) {
    INFO(part << ": " << emu::last_report());
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(has(emu::last_report(), part));
  };
  TS_LAUNCH(1, 32, 0, nullptr, static_52k_kernel)(d);
  refused("static_52k_kernel");
  CHECK(has(emu::last_report(), "53248 bytes of static __shared__ memory"));
  TS_LAUNCH(1, 32, 0, nullptr, static_52k_template_kernel)(d);
  refused("53248 bytes of static __shared__ memory");
  TS_LAUNCH(1, 32, 0, nullptr, static_40k_kernel)(d);
  CHECK(cudaGetLastError() == cudaSuccess);
  TS_LAUNCH(1, 32, 16 * 1024, nullptr, static_40k_kernel)(d);
  refused("40960 bytes of static and 16384 of dynamic shared memory, over the 49152");
  TS_LAUNCH(1, 32, 8 * 1024, nullptr, static_40k_kernel)(d);  // 48 KiB together: legal
  CHECK(cudaGetLastError() == cudaSuccess);
  // 64 KiB of dynamic memory: refused until the kernel opts in, then legal for it and not for another.
  TS_LAUNCH(1, 32, 64 * 1024, nullptr, dynamic_a_kernel)(d);
  refused("without the opt-in");
  REQUIRE(cudaFuncSetAttribute(dynamic_a_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024) == cudaSuccess);
  TS_LAUNCH(1, 32, 64 * 1024, nullptr, dynamic_a_kernel)(d);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(host_floats(d, 32)[5] == 6.f);
  TS_LAUNCH(1, 32, 64 * 1024, nullptr, dynamic_b_kernel)(d);
  refused("dynamic_b_kernel");
  TS_LAUNCH(1, 32, 64 * 1024 + 4, nullptr, dynamic_a_kernel)(d);
  refused("over the 65536 this kernel opted in to");
  // 227 KiB is the most: the opt-in beyond it is refused, and so is a launch beyond it.
  CHECK(cudaFuncSetAttribute(dynamic_a_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 + 1) == cudaErrorInvalidValue);
  refused("must lie in [0, 232448]");
  REQUIRE(cudaFuncSetAttribute(dynamic_a_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448) == cudaSuccess);
  TS_LAUNCH(1, 32, 232448, nullptr, dynamic_a_kernel)(d);
  CHECK(cudaGetLastError() == cudaSuccess);
  TS_LAUNCH(1, 32, 232448 + 1, nullptr, dynamic_a_kernel)(d);
  refused("over the 232448 this kernel opted in to");
  // A kernel's static arrays count against its opt-in: 40 KiB + 187 KiB + 1 byte is over 227 KiB.
  CHECK(cudaFuncSetAttribute(static_40k_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 - 40960 + 1) ==
        cudaErrorInvalidValue);
  refused("with the kernel's 40960 bytes of static __shared__ memory");
  REQUIRE(cudaFuncSetAttribute(static_40k_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 1024) == cudaSuccess);
  TS_LAUNCH(1, 32, 16 * 1024, nullptr, static_40k_kernel)(d);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(host_floats(d, 32)[5] == 6.f);
  cudaFree(d);
}

// ----- settings --------------------------------------------------------------------------------
// This test binary run again as a child with TS_EMU_* set: a bad value must stop it before main
// with one line naming it; good values must reach the emulator.

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : "";
}
tst::Result run_child(const std::string& env) {
  return tst::run("env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u PMI_PORT -u PMI_ID -u PMI_HOSTNAME -u MPI_LOCALRANKID "
                  "-u MPI_LOCALNRANKS -u PMIX_RANK -u PMI_SPAWNED -u PMI_APPNUM " + env + " " + self_exe() +
                  " '[emu_settings_child]'", 120);
}

TEST_CASE("emulated GPU settings: the child run", "[.emu_settings_child]") {
  int n = 0;
  size_t free_bytes = 0, total = 0;
  REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  float* d = device_floats({0});
  TS_LAUNCH(1, 32, 0, nullptr, nothing_kernel)(d);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(d);
  printf("settings child ok: %d GPUs, %zu bytes, %s, timeout %g s, quiet %d, poison 0x%02X\n", n, total,
         emu::reverse_order() ? "reverse" : "forward", emu::nccl_timeout_s(), int(emu::quiet()), emu::uninit_byte());
}

TEST_CASE("emulated GPU: a TS_EMU_* value the emulator cannot use stops it with one line", "[emu]") {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"TS_EMU_ORDER", "sideways"},       {"TS_EMU_ORDER", "Reverse"},      {"TS_EMU_MEMORY_GB", "lots"},
      {"TS_EMU_MEMORY_GB", "0"},          {"TS_EMU_MEMORY_GB", "-1"},       {"TS_EMU_MEMORY_GB", "80GB"},
      {"TS_EMU_MEMORY_GB", "nan"},        {"TS_EMU_MEMORY_GB", "1e400"},    {"TS_EMU_NCCL_TIMEOUT", "-5"},
      {"TS_EMU_NCCL_TIMEOUT", "soon"},    {"TS_EMU_NCCL_TIMEOUT", "0"},     {"TS_EMU_NCCL_TIMEOUT", "inf"},
      {"TS_EMU_GPUS", "0"},               {"TS_EMU_GPUS", "two"},           {"TS_EMU_GPUS", "8.5"},
      {"TS_EMU_GPUS", " 8"},              {"TS_EMU_GPUS", "65"},            {"TS_EMU_QUIET", "yes"},
      {"TS_EMU_COVERAGE", "/nonexistent/dir/cover.txt"}, {"TS_EMU_POISON", "zero"},  {"TS_EMU_POISON", "NaN"},
  };
  for (const auto& [name, value] : bad) {
    const tst::Result r = run_child(name + "='" + value + "'");
    INFO(name << "=" << value << ":\n" << r.output);
    CHECK(r.status == 2);
    CHECK(has(r.output, "emulated GPU: " + name + "=\"" + value + "\" cannot be used: " + name + " accepts "));
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
    CHECK(!has(r.output, "settings child ok"));
  }
}

TEST_CASE("emulated GPU: good TS_EMU_* values reach the emulator", "[emu]") {
  const std::string cover = tst::scratch("settings_cover.txt");
  tst::Result r = run_child("TS_EMU_ORDER=reverse TS_EMU_MEMORY_GB=0.5 TS_EMU_NCCL_TIMEOUT=30 TS_EMU_GPUS=2 "
                            "TS_EMU_QUIET=0 TS_EMU_POISON=big TS_EMU_COVERAGE=" + cover);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(has(r.output, "settings child ok: 2 GPUs, 536870912 bytes, reverse, timeout 30 s, quiet 0, poison 0x7F"));
  std::ifstream f(cover);
  const std::string covered((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(has(covered, "kernel nothing_kernel"));
  r = run_child("TS_EMU_ORDER=forward TS_EMU_MEMORY_GB=80 TS_EMU_NCCL_TIMEOUT=2.5e2 TS_EMU_GPUS=64 TS_EMU_QUIET=1 "
                "TS_EMU_POISON=nan TS_EMU_COVERAGE=");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(has(r.output, "settings child ok: 64 GPUs, 85899345920 bytes, forward, timeout 250 s, quiet 1, poison 0xFF"));
}

// PTX's shfl.sync.bfly with CUDA's segment clamp: at width 16 lane 20 (^16 = 4) reads lane 4, lane 4
// (^16 = 20, above its segment) keeps its own value; at width 8 lane 9 (^8 = 1) reads lane 1.
TEST_CASE("emulated GPU: __shfl_xor_sync with width < 32 reads as PTX's shfl.bfly does", "[emu]") {
  Fresh fresh;
  int* d = tst::to_device(std::vector<int>(32, 0));
  TS_LAUNCH(1, 32, 0, nullptr, segment_shuffle_kernel)(d, 16, 16, 32);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<int> got = tst::to_host(d, 32);
  CHECK(got[20] == 4);
  CHECK(got[31] == 15);
  CHECK(got[4] == 4);
  CHECK(got[15] == 15);
  TS_LAUNCH(1, 32, 0, nullptr, segment_shuffle_kernel)(d, 8, 8, 32);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  got = tst::to_host(d, 32);
  CHECK(got[9] == 1);
  CHECK(got[1] == 1);
  CHECK(got[27] == 19);
  CHECK(got[16] == 16);
  TS_LAUNCH(1, 32, 0, nullptr, segment_shuffle_kernel)(d, 1, 32, 32);  // the full warp: a plain exchange
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  got = tst::to_host(d, 32);
  for (int l = 0; l < 32; l++) CHECK(got[size_t(l)] == (l ^ 1));
  cudaFree(d);
}

// A source lane outside the mask gives an undefined value: poison, not the lane's own or its partner's.
TEST_CASE("emulated GPU: a shuffle reading a lane outside its mask gets poison", "[emu]") {
  Fresh fresh;
  int* d = tst::to_device(std::vector<int>(32, 0));
  TS_LAUNCH(1, 32, 0, nullptr, segment_shuffle_kernel)(d, 16, 32, 16);  // lanes 0..15 read lanes 16..31
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<int> got = tst::to_host(d, 32);
  int poison;
  memset(&poison, emu::uninit_byte(), sizeof poison);
  for (int l = 0; l < 16; l++) CHECK(got[size_t(l)] == poison);
  cudaFree(d);
}

// memcheck: a kernel given a host pointer is refused before it runs, named with its argument.
TEST_CASE("emulated GPU: a kernel launched with a host pointer is named, and does not run", "[emu]") {
  Fresh fresh;
  std::vector<float> host(32, 0);
  TS_LAUNCH(1, 32, 0, nullptr, write_42_kernel)(host.data());
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
  CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress);
  const std::string r = emu::last_report();
  CHECK(has(r, "kernel write_42_kernel (launched at tests/test_emu.cpp:"));
  CHECK(has(r, "argument 0 is 0x"));
  CHECK(has(r, "a host pointer"));
  CHECK(std::count(host.begin(), host.end(), 0.0f) == 32);
  emu::clear_report();
  // Device and page-locked pointers, and null, are what a kernel may take.
  float* h = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&h), 32 * sizeof(float)) == cudaSuccess);
  TS_LAUNCH(1, 32, 0, nullptr, write_42_kernel)(h);
  TS_LAUNCH(1, 1, 0, nullptr, nothing_kernel)(nullptr);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(h[31] == 42);
  cudaFreeHost(h);
}

TEST_CASE("emulated GPU: the misaligned-load child run", "[.emu_fault_child]") {
  Chunk16* dst = nullptr;
  char* src = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dst), 32 * sizeof(Chunk16)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&src), 33 * sizeof(Chunk16)) == cudaSuccess);
  TS_LAUNCH(1, 32, 0, nullptr, misaligned_chunk_kernel)(dst, src);
  cudaDeviceSynchronize();
  printf("misaligned child survived\n");
}

// A misaligned 16-byte load faults on the CPU as on the GPU; the emulator names the kernel, its
// launch site, the block and the thread before the process dies.
TEST_CASE("emulated GPU: a misaligned 16-byte vector load is named with its kernel and thread", "[emu]") {
  const tst::Result r = tst::run("env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u PMI_PORT -u PMI_ID -u PMI_HOSTNAME "
                                 "-u MPI_LOCALRANKID -u MPI_LOCALNRANKS -u PMIX_RANK -u PMI_SPAWNED -u PMI_APPNUM " +
                                     self_exe() + " '[emu_fault_child]' 2>&1", 120);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(!has(r.output, "misaligned child survived"));
#ifdef __SANITIZE_ADDRESS__  // make SANITIZE=address: AddressSanitizer's own report, with the kernel in its stack
  CHECK(has(r.output, "AddressSanitizer"));
  CHECK(has(r.output, "misaligned_chunk_kernel"));
#else
  CHECK(has(r.output, "emulated GPU: kernel misaligned_chunk_kernel (launched at tests/test_emu.cpp:"));
  CHECK(has(r.output, "block (0,0,0), thread (0,0,0): memory fault (SIGSEGV) with no address: a vector load or "
                      "store misaligned for its size"));
#endif
}

#ifdef __SANITIZE_ADDRESS__
TEST_CASE("emulated GPU: the out-of-bounds child run", "[.emu_oob_child]") {
  float* d = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(float)) == cudaSuccess);  // 256 bytes, no rounding
  TS_LAUNCH(1, 65, 0, nullptr, write_42_kernel)(d);  // thread 64 writes one float past the end
  cudaDeviceSynchronize();
  printf("out-of-bounds child survived\n");
}

// make SANITIZE=address: a device allocation is a heap block with AddressSanitizer's redzones, so a
// kernel's write one element past its end is a report naming the kernel's function and line.
TEST_CASE("emulated GPU under AddressSanitizer: a write past a device allocation is reported", "[emu]") {
  const tst::Result r = tst::run("env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u PMI_PORT -u PMI_ID -u PMI_HOSTNAME "
                                 "-u MPI_LOCALRANKID -u MPI_LOCALNRANKS -u PMIX_RANK -u PMI_SPAWNED -u PMI_APPNUM " +
                                     self_exe() + " '[emu_oob_child]' 2>&1", 120);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(!has(r.output, "out-of-bounds child survived"));
  CHECK(has(r.output, "heap-buffer-overflow"));
  CHECK(has(r.output, "write_42_kernel"));
  CHECK(has(r.output, "tests/test_emu.cpp:"));
}
#endif

// Stream order as CUDA promises it: cudaMemset, a device-to-device cudaMemcpy and a pageable
// host-to-device cudaMemcpy go on the legacy stream and return before they have run; a kernel on a
// non-blocking stream that reads their result without waiting reads poison, and with the wait
// (here a synchronisation of the legacy stream) their values.
TEST_CASE("emulated GPU: legacy-stream cudaMemset and cudaMemcpy are not ordered before a non-blocking stream", "[emu]") {
  Fresh fresh;
  const int n = 64;
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  float* src = device_floats(std::vector<float>(n, 2.0f));
  const std::vector<float> pageable(n, 3.0f);
  for (int way = 0; way < 3; way++) {
    for (bool wait : {false, true}) {
      INFO("way " << way << (wait ? ", with the wait" : ", without"));
      float* x = device_floats(std::vector<float>(n, 0.0f));
      float* y = device_floats(std::vector<float>(n, 0.0f));
      REQUIRE(cudaMemset(x, 0xFF, n * sizeof(float)) == cudaSuccess);  // x holds poison again (0xFF bytes)
      REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
      if (way == 0) REQUIRE(cudaMemset(x, 0, n * sizeof(float)) == cudaSuccess);
      if (way == 1) REQUIRE(cudaMemcpy(x, src, n * sizeof(float), cudaMemcpyDeviceToDevice) == cudaSuccess);
      if (way == 2) REQUIRE(cudaMemcpy(x, pageable.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
      if (wait) REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
      TS_LAUNCH(1, n, 0, s, copy_kernel)(y, static_cast<const float*>(x), n);
      REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
      const std::vector<float> got = tst::to_host(y, n);
      const float want = way == 0 ? 0.0f : way == 1 ? 2.0f : 3.0f;
      CHECK(std::isnan(got[0]) == !wait);
      if (wait) CHECK(got[n - 1] == want);
      cudaFree(x);
      cudaFree(y);
    }
  }
  // A blocking stream (created without cudaStreamNonBlocking) does wait for the legacy stream's
  // earlier work, as CUDA promises: its kernel sees the memset with no wait of its own.
  cudaStream_t blocking;
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  float* x = device_floats(std::vector<float>(n, 1.0f));
  float* y = device_floats(std::vector<float>(n, 1.0f));
  REQUIRE(cudaMemset(x, 0, n * sizeof(float)) == cudaSuccess);
  TS_LAUNCH(1, n, 0, blocking, copy_kernel)(y, static_cast<const float*>(x), n);
  REQUIRE(cudaStreamSynchronize(blocking) == cudaSuccess);
  const std::vector<float> got = tst::to_host(y, n);
  CHECK(std::count(got.begin(), got.end(), 0.0f) == n);
  cudaFree(x);
  cudaFree(y);
  cudaFree(src);
  cudaStreamDestroy(s);
  cudaStreamDestroy(blocking);
}

TEST_CASE("emulated GPU: a template kernel's static shared memory starts as poison", "[emu]") {
  Fresh fresh;
  int* d = tst::to_device(std::vector<int>(32, 0));
  int poison;
  memset(&poison, emu::uninit_byte(), sizeof poison);
  TS_LAUNCH(1, 32, 0, nullptr, template_shared_kernel<int>)(d, 0);  // the kernel's address is known
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<int> got = tst::to_host(d, 32);
  CHECK(std::count(got.begin(), got.end(), poison) == 32);
  REQUIRE(cudaMemset(d, 0, 32 * sizeof(int)) == cudaSuccess);
  TS_LAUNCH(1, 32, 0, nullptr, template_shared_kernel)(d, 0);  // found by name (arguments deduced)
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  got = tst::to_host(d, 32);
  CHECK(std::count(got.begin(), got.end(), poison) == 32);
  cudaFree(d);
}

// initcheck: what the caching allocator hands out again, and page-locked host memory, hold poison
// (the 0xFF bytes of a fresh cudaMalloc), not last use's values or a fresh page's zeros.
TEST_CASE("emulated GPU: recycled allocator blocks and cudaMallocHost memory start as poison", "[emu]") {
  Fresh fresh;
  const size_t bytes = 4096;
  void* p = ts::mem_alloc(bytes, ts::Device::CUDA, ts::Tag::Workspace);
  REQUIRE(cudaMemsetAsync(p, 0x3F, bytes, ts::compute_stream()) == cudaSuccess);  // last use's values
  ts::mem_free(p, bytes, ts::Device::CUDA, ts::Tag::Workspace);
  void* q = ts::mem_alloc(bytes, ts::Device::CUDA, ts::Tag::Workspace);
  REQUIRE(q == p);  // the same block, from the cache
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<unsigned char> back = tst::to_host(static_cast<const unsigned char*>(q), bytes);
  CHECK(std::count(back.begin(), back.end(), emu::uninit_byte()) == long(bytes));
  ts::mem_free(q, bytes, ts::Device::CUDA, ts::Tag::Workspace);
  void* h = nullptr;
  REQUIRE(cudaMallocHost(&h, bytes) == cudaSuccess);
  const unsigned char* hb = static_cast<const unsigned char*>(h);
  CHECK(std::count(hb, hb + bytes, emu::uninit_byte()) == long(bytes));
  cudaFreeHost(h);
}

TEST_CASE("emulated GPU: a stream that reads without waiting for the writer's event reads NaN", "[emu]") {
  Fresh fresh;
  cudaStream_t writer, reader;
  REQUIRE(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking) == cudaSuccess);
  void *x = nullptr, *y = nullptr;
  REQUIRE(cudaMalloc(&x, 256 * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&y, 256 * 4) == cudaSuccess);
  std::vector<float> h(256);
  for (bool wait : {false, true}) {
    TS_LAUNCH(1, 128, 0, writer, write_kernel)(static_cast<float*>(x), wait ? 2.f : 1.f, 256);
    if (wait) {
      cudaEvent_t ev;
      REQUIRE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
      REQUIRE(cudaEventRecord(ev, writer) == cudaSuccess);
      REQUIRE(cudaStreamWaitEvent(reader, ev, 0) == cudaSuccess);
      REQUIRE(cudaEventDestroy(ev) == cudaSuccess);
    }
    TS_LAUNCH(1, 128, 0, reader, copy_kernel)(static_cast<float*>(y), static_cast<const float*>(x), 256);
    REQUIRE(cudaStreamSynchronize(reader) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(h.data(), y, 256 * 4, cudaMemcpyDeviceToHost, reader) == cudaSuccess);
    if (wait) {
      for (float v : h) CHECK(v == 2.f);
    } else {
      for (float v : h) CHECK(std::isnan(v));  // the write had not run: nothing had asked for it
    }
    REQUIRE(cudaStreamSynchronize(writer) == cudaSuccess);
  }
  cudaFree(x);
  cudaFree(y);
  cudaStreamDestroy(writer);
  cudaStreamDestroy(reader);
}

// CUDA's rule for page-locked memory (CUDA C++ Programming Guide, "Page-Locked Host Memory"; the
// runtime API's notes on the synchronous behaviour of memcpy): an asynchronous copy from pinned
// memory is a DMA that reads its source when it runs on the stream, so the host may refill the
// buffer only once an event recorded after the copy has completed. From pageable memory the copy
// takes its source before returning. The emulator runs the pinned copy late, so refilling too early
// is always seen, where on a GPU it depends on timing.
TEST_CASE("emulated GPU: an async copy from pinned memory reads its source when it runs", "[emu]") {
  Fresh fresh;
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const int n = 64;
  int32_t* pinned = nullptr;
  int32_t* d = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), 2 * n * sizeof(int32_t)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(int32_t)) == cudaSuccess);
  auto fill = [&](int32_t* h, int32_t v) {
    for (int i = 0; i < n; i++) h[i] = v + i;
  };
  auto upload = [&](const int32_t* h) {
    REQUIRE(cudaMemcpyAsync(d, h, n * sizeof(int32_t), cudaMemcpyHostToDevice, s) == cudaSuccess);
  };
  auto holds = [&](int32_t v) {
    const std::vector<int32_t> got = host_copy(d, size_t(n));
    int wrong = 0;
    for (int i = 0; i < n; i++) wrong += got[size_t(i)] != v + i;
    return wrong == 0;
  };
  // Seeded defect: the staging buffer refilled before anything waited for the copy. The device
  // gets the new contents, not the ones the copy was issued with; the same from the buffer's second
  // half (a slot of a staging ring, a pointer into the allocation).
  for (int32_t* src : {pinned, pinned + n}) {
    fill(src, 100);
    upload(src);
    fill(src, 200);  // too early
    CHECK(holds(200));
    CHECK(!holds(100));
  }
  // The correct pattern: an event recorded after the copy, waited for before the refill.
  cudaEvent_t copied;
  REQUIRE(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming) == cudaSuccess);
  fill(pinned, 300);
  upload(pinned);
  REQUIRE(cudaEventRecord(copied, s) == cudaSuccess);
  REQUIRE(cudaEventSynchronize(copied) == cudaSuccess);
  fill(pinned, 400);
  CHECK(holds(300));
  // Pageable memory: the copy has taken its source when cudaMemcpyAsync returns.
  std::vector<int32_t> pageable(n);
  fill(pageable.data(), 500);
  upload(pageable.data());
  fill(pageable.data(), 600);
  CHECK(holds(500));
  // A device-to-host copy is counted (fp8's native GEMM is held to making none).
  const uint64_t before = emu::device_to_host_copies();
  REQUIRE(cudaMemcpy(pageable.data(), d, n * sizeof(int32_t), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(d, pageable.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(emu::device_to_host_copies() == before + 1);
  REQUIRE(cudaEventDestroy(copied) == cudaSuccess);
  REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
  CHECK(cudaFreeHost(pinned) == cudaErrorInvalidValue);  // freed already
  cudaGetLastError();
  cudaFree(d);
  cudaStreamDestroy(s);
}

// The project's staging ring for token ids, targets and positions (upload_ints, model.cu) under
// that rule: more uploads than the ring has slots, queued with nothing between them that waits
// for the device, each arrive with their own contents, because a slot is refilled only after the
// event of its last copy. Without that wait the later uploads' ints would reach the earlier tensors.
TEST_CASE("emulated GPU: upload_ints' pinned ring delivers every upload when many are queued", "[emu]") {
  Fresh fresh;
  const int uploads = 20, n = 64;  // one size, so no slot grows (freeing pinned memory drains the device)
  std::vector<ts::Tensor> up;
  for (int k = 0; k < uploads; k++) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; i++) v[size_t(i)] = 1000 * k + i;
    up.push_back(ts::upload_ints(v, ts::Device::CUDA));
  }
  int wrong = 0;
  for (int k = 0; k < uploads; k++) {
    ts::Tensor h = ts::Tensor::empty({n}, ts::DType::I32, ts::Device::CPU, ts::Tag::Workspace);
    ts::copy(h, up[size_t(k)]);
    for (int i = 0; i < n; i++) wrong += h.i32()[i] != 1000 * k + i;
  }
  CHECK(wrong == 0);
}

TEST_CASE("emulated GPU: cudaMemcpy with the wrong kind and an over-size allocation are refused", "[emu]") {
  Fresh fresh;
  void* d = nullptr;
  REQUIRE(cudaMalloc(&d, 64) == cudaSuccess);
  std::vector<float> h(16);
  CHECK(cudaMemcpy(h.data(), d, 64, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK(emu::last_report().find("the source is device memory") != std::string::npos);
  size_t free_b = 0, total_b = 0;
  REQUIRE(cudaMemGetInfo(&free_b, &total_b) == cudaSuccess);
  void* big = nullptr;
  CHECK(cudaMalloc(&big, free_b + (1 << 20)) == cudaErrorMemoryAllocation);
  CHECK(big == nullptr);
  cudaGetLastError();
  cudaFree(d);
}


TEST_CASE("emulated GPU: mma.sync m16n8k16 and ldmatrix.x4 put each element where the PTX ISA says", "[emu]") {
  Fresh fresh;
  std::vector<uint16_t> A(256), B(128);
  std::vector<float> C(128);
  for (size_t i = 0; i < A.size(); i++) A[i] = ts::float_to_bf16(ts::rng_normal(1, i)).bits;
  for (size_t i = 0; i < B.size(); i++) B[i] = ts::float_to_bf16(ts::rng_normal(2, i)).bits;
  for (size_t i = 0; i < C.size(); i++) C[i] = ts::rng_normal(3, i);
  // The plain product in double: D[m][n] = C[m][n] + Σ_k A[m][k]·B[k][n], B stored column by column.
  std::vector<double> want(128);
  double scale = 0;
  for (int m = 0; m < 16; m++)
    for (int n = 0; n < 8; n++) {
      double acc = C[size_t(m * 8 + n)];
      for (int k = 0; k < 16; k++)
        acc += double(ts::bf16_to_float(ts::bf16{A[size_t(m * 16 + k)]})) * double(ts::bf16_to_float(ts::bf16{B[size_t(n * 16 + k)]}));
      want[size_t(m * 8 + n)] = acc;
      scale = std::max(scale, std::fabs(acc));
    }
  uint16_t *dA = tst::to_device(A), *dB = tst::to_device(B);
  float *dC = tst::to_device(C), *dD = tst::to_device(std::vector<float>(128, 0));
  uint32_t* dL = tst::to_device(std::vector<uint32_t>(256, 0));
  for (int via : {0, 1})
    for (int defect : {0, 1}) {
      INFO("via ldmatrix " << via << ", seeded defect " << defect);
      TS_LAUNCH(1, 32, 512, nullptr, mma_tile_kernel)(dD, dL, dA, dB, dC, via, defect);
      REQUIRE(cudaGetLastError() == cudaSuccess);
      const std::vector<float> D = host_copy(dD, 128);
      double err = 0;
      for (size_t i = 0; i < 128; i++) err = std::max(err, std::fabs(double(D[i]) - want[i]));
      // 16 exact products summed in fp32: within 16 roundings of the largest partial sum.
      if (!defect) CHECK(err <= 16 * 0x1p-24 * 4 * scale);
      else CHECK(err > 1e-2 * scale);  // a swapped register multiplies the wrong columns
      if (via) {
        const std::vector<uint32_t> L = host_copy(dL, 256);
        for (int l = 0; l < 32; l++)
          for (int r = 0; r < 4; r++) CHECK(L[size_t(l * 8 + r)] == L[size_t(l * 8 + 4 + r)]);
      }
    }
  cudaFree(dA), cudaFree(dB), cudaFree(dC), cudaFree(dD), cudaFree(dL);
}

TEST_CASE("emulated GPU: ldmatrix.x4.trans gives mma's B fragments of a row-major tile", "[emu]") {
  Fresh fresh;
  std::vector<uint16_t> A(256), M(256);
  for (size_t i = 0; i < M.size(); i++) {
    A[i] = ts::float_to_bf16(ts::rng_normal(4, i)).bits;
    M[i] = ts::float_to_bf16(ts::rng_normal(5, i)).bits;  // distinct values, so a misplaced one shows
  }
  std::vector<double> want(256);  // the plain product A·M in double
  double scale = 0;
  for (int m = 0; m < 16; m++)
    for (int n = 0; n < 16; n++) {
      double acc = 0;
      for (int k = 0; k < 16; k++)
        acc += double(ts::bf16_to_float(ts::bf16{A[size_t(m * 16 + k)]})) * ts::bf16_to_float(ts::bf16{M[size_t(k * 16 + n)]});
      want[size_t(m * 16 + n)] = acc;
      scale = std::max(scale, std::fabs(acc));
    }
  uint16_t *dA = tst::to_device(A), *dM = tst::to_device(M);
  uint32_t* dL = tst::to_device(std::vector<uint32_t>(256, 0));
  float* dD = device_floats(std::vector<float>(256, 0));
  for (int trans : {1, 0}) {
    INFO("trans " << trans);
    TS_LAUNCH(1, 32, 1024, nullptr, ldmatrix_trans_kernel)(dL, dD, dA, dM, trans);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    const std::vector<uint32_t> L = host_copy(dL, 256);
    const std::vector<float> D = host_copy(dD, 256);
    int same = 0;
    for (int l = 0; l < 32; l++)
      for (int r = 0; r < 4; r++) same += L[size_t(l * 8 + r)] == L[size_t(l * 8 + 4 + r)];
    double err = 0;
    for (size_t i = 0; i < 256; i++) err = std::max(err, std::fabs(double(D[i]) - want[i]));
    if (trans) {
      CHECK(same == 128);
      CHECK(err <= 16 * 0x1p-24 * 4 * scale);  // 16 exact products summed in fp32
    } else {
      CHECK(same < 8);  // without .trans the lanes hold rows of M, not columns
      CHECK(err > 1e-2 * scale);
    }
  }
  cudaFree(dA), cudaFree(dM), cudaFree(dL), cudaFree(dD);
}

TEST_CASE("emulated GPU: ldmatrix outside shared memory and an mma half the warp skips are named", "[emu]") {
  Fresh fresh;
  uint16_t* dA = tst::to_device(std::vector<uint16_t>(256, 0));
  uint32_t* dO = tst::to_device(std::vector<uint32_t>(32, 0));
  TS_LAUNCH(1, 32, 0, nullptr, ldmatrix_global_kernel)(dO, dA);
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
  CHECK(emu::last_report().find("not in the block's shared memory") != std::string::npos);
  CHECK(emu::last_report().find("ldmatrix_global_kernel") != std::string::npos);
  emu::clear_report();
  float* dD = device_floats(std::vector<float>(32, 0));
  TS_LAUNCH(1, 32, 0, nullptr, mma_half_warp_kernel)(dD);
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
  CHECK(emu::last_report().find("mma.sync.m16n8k16") != std::string::npos);
  CHECK(emu::last_report().find("has exited") != std::string::npos);
  emu::clear_report();
}

#endif
