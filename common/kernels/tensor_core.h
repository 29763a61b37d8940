// tensor_core.h — one warp's tensor-core instructions, for kernels that run on nvcc's GPU and on
// the emulated GPU alike: mma.sync (D = A·B + C on a 16 × 8 × 16 tile, bf16 operands, fp32
// accumulators) and ldmatrix (four 8 × 8 b16 matrices from shared memory into the fragments mma
// takes; .trans delivers each matrix transposed). Each is warp-wide: all 32 lanes execute it together, each holding the registers the PTX
// ISA assigns it ("Matrix Fragments for mma.m16n8k16 with floating point type"; common/emu/kernel.cu
// draws the same map). On the GPU they are inline PTX (sm_80 and later); under the emulated GPU,
// warp operations that check every lane arrives and that ldmatrix reads aligned shared memory.
#pragma once
#ifdef TS_CUDA
#include <cstdint>
#include "tensor/device.h"

#ifdef TS_CUDA_EMU
#define TS_MMA_M16N8K16_BF16(d, a, b, c) ::emu::mma_m16n8k16_bf16(__FILE__, __LINE__, d, a, b, c)
#define TS_LDMATRIX_X4(r, row) ::emu::ldmatrix_x4(__FILE__, __LINE__, r, row, false)
#define TS_LDMATRIX_X4_TRANS(r, row) ::emu::ldmatrix_x4(__FILE__, __LINE__, r, row, true)
#else
namespace ts::cuda {
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  const unsigned addr = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  const unsigned addr = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
}  // namespace ts::cuda
#define TS_MMA_M16N8K16_BF16(d, a, b, c) ::ts::cuda::mma_m16n8k16_bf16(d, a, b, c)
#define TS_LDMATRIX_X4(r, row) ::ts::cuda::ldmatrix_x4(r, row)
#define TS_LDMATRIX_X4_TRANS(r, row) ::ts::cuda::ldmatrix_x4_trans(r, row)
#endif

#endif  // TS_CUDA
