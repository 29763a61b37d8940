// memcheck_extra_partial, in 01_single_gpu --device cuda under the emulated GPU's memcheck build
// (make CUDA=emu SANITIZE=memory): a block reduction that reads one partial too many. After each
// embedding forward, a row maximum in the project's block_max pattern (common/kernels/
// kernels_cuda.cu) has warp 0 read partials up to and including nwarps (`lane <= nwarps` for
// `lane < nwarps`): slot nwarps was never written. In the default build the 0xFF poison there is
// NaN, which fmaxf drops, so only TS_EMU_POISON=big changes the maximum (issue 59's block_max case);
// the shadow's initcheck names row_max_kernel and the line of the read (tests/test_emu_memcheck.cpp).
#include <cmath>

#include "bug.h"
#include "kernels/kernels_cuda_internal.h"

using ts::Tensor;
void real_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");
void maxed_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");

__global__ void row_max_kernel(float* maxes, const float* x, int64_t D) {
  __shared__ float sh[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  float v = -INFINITY;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) v = fmaxf(v, x[blockIdx.x * D + d]);
  v = ts::cuda::warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = ts::cuda::warp_max(lane <= nwarps ? sh[lane] : -INFINITY);  // the defect: one partial too many
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) maxes[blockIdx.x] = sh[0];
}

void maxed_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start) {
  bug::announce("memcheck_extra_partial");
  real_embedding_forward(out, table, tokens, start);
  if (out.dtype != ts::DType::F32) return;
  const int64_t rows = out.numel() / out.size(-1), D = out.size(-1);
  static Tensor maxes;
  maxes = Tensor::empty({rows}, ts::DType::F32, ts::Device::CUDA, ts::Tag::Workspace);
  TS_LAUNCH(unsigned(rows), 256, 0, ts::compute_stream(), row_max_kernel)(maxes.f32(), out.f32(), D);
  KERNEL_CHECK();
}
