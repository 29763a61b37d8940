// memcheck_shared_overrun, in 01_single_gpu --device cuda under the emulated GPU's memcheck build
// (make CUDA=emu SANITIZE=memory): a shared-array overrun. After each embedding forward, a block
// reduction in the project's pattern (block_sum, common/kernels/kernels_cuda.cu) sums the output
// rows, with its partials array sized for 256 threads (8 warps) but launched with 512: warps 8-15
// write past `partial` into what follows it, which on the emulated GPU is the next static __shared__
// array (in the one section that holds them all), silently, and on a GPU is compute-sanitizer
// memcheck's "invalid __shared__ write". Wraps ts::cuda::embedding_forward (the dispatcher calls
// it) to launch the kernel after the real one. The shadow's memcheck names row_sums_kernel and the
// line of the write (tests/test_emu_memcheck.cpp).
#include "bug.h"
#include "kernels/kernels_cuda_internal.h"

using ts::Tensor;
void real_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");
void summed_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");

constexpr int kWarpsPlanned = 8;  // the 256-thread block the array was sized for

__global__ void row_sums_kernel(float* sums, const float* x, int64_t D) {
  __shared__ float partial[kWarpsPlanned];
  __shared__ float total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  float v = 0.f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) v += x[blockIdx.x * D + d];
  v = ts::cuda::warp_sum(v);
  if (lane == 0) partial[warp] = v;  // the defect: warp 8 and above write past the array
  __syncthreads();
  if (warp == 0) {
    v = ts::cuda::warp_sum(lane < nwarps && lane < kWarpsPlanned ? partial[lane] : 0.f);
    if (lane == 0) total = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

void summed_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start) {
  bug::announce("memcheck_shared_overrun");
  real_embedding_forward(out, table, tokens, start);
  if (out.dtype != ts::DType::F32) return;
  const int64_t rows = out.numel() / out.size(-1), D = out.size(-1);
  static Tensor sums;
  sums = Tensor::empty({rows}, ts::DType::F32, ts::Device::CUDA, ts::Tag::Workspace);
  TS_LAUNCH(unsigned(rows), 2 * 32 * kWarpsPlanned, 0, ts::compute_stream(), row_sums_kernel)(sums.f32(), out.f32(), D);
  KERNEL_CHECK();
}
