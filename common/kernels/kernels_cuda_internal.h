// kernels_cuda_internal.h — what the CUDA kernel files share (kernels_cuda.cu, attention_v2.cu):
// the warp reductions, attention's dimensions and its row dots. Device code: included only where
// TS_CUDA is defined.
#pragma once
#ifdef TS_CUDA
#include "kernels/kernels_cuda.h"
#include "tensor/device.h"

namespace ts {
namespace cuda {

// ----- reductions ------------------------------------------------------------------------------
// Butterfly (xor) shuffles: every lane ends with the same bits, in an order fixed by the lane ids.

template <class R> __device__ __forceinline__ R warp_sum(R v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_max_int(int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_min_int(int v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ----- attention -------------------------------------------------------------------------------
// q, out [B, Sq, H, hd]; k, v [B, Sk, KVH, hd]; lse [B, H, Sq]; scores are scale · q·k.
struct AttnDims {
  int B, Sq, Sk, H, KVH, hd;
  float scale;
};
AttnDims attn_dims(const Tensor& q, const Tensor& k);
// Dsum_i = rowsum(dO_i ∘ O_i), laid out like lse, in a device buffer valid until the next call
// (the backward's first step, shared by both rungs).
const float* attention_row_dots(const Tensor& dout, const Tensor& out, const AttnDims& a);

}  // namespace cuda
}  // namespace ts
#endif  // TS_CUDA
