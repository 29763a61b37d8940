// kernels_bf16.h — bf16 × bf16 → fp32 GEMMs on the CPU's bf16 instructions (kernels_bf16.cu), for
// the bf16 linears of kernels_cpu.cu's matmul. Where the CPU has them, the products of two bf16
// values are formed exactly and summed in fp32 by the hardware, so a bf16 matmul moves half the
// bytes and runs at two (AVX512-BF16) to sixteen (AMX-BF16) times fp32's multiply-add rate instead
// of widening both operands to fp32 for sgemm.
#pragma once
#include <cstdint>

#include "tensor/core.h"

namespace ts {
namespace cpu {

// How a CPU bf16 matmul with two bf16 operands runs:
//  * Widen: both operands widened to fp32, then OpenBLAS sgemm (every CPU; the reference path);
//  * Avx512Bf16: VDPBF16PS, 16 columns × 2 products per instruction (Cooper Lake, Sapphire Rapids
//    and later Xeons, AMD Zen 4 and later);
//  * Amx: TDPBF16PS on 16 × 16 fp32 tiles of C (Sapphire Rapids and later Xeons).
enum class Bf16Gemm { Widen, Avx512Bf16, Amx };
const char* bf16_gemm_name(Bf16Gemm p);  // "widen", "avx512-bf16", "amx"

// Whether this CPU (and, for AMX, the kernel: Linux 5.16+ grants the tile state on request) runs p.
bool bf16_gemm_available(Bf16Gemm p);
// The path bf16 matmuls take: the environment's TS_BF16_GEMM (auto | amx | avx512-bf16 | widen;
// a path this CPU cannot run is a config_error); auto is AMX where it runs, else AVX512-BF16 on
// AMD's cores (Zen 4 and later, where it issues at FMA's rate), else Widen. Chosen
// once per process, never by timing, so a run's bits do not depend on the machine's load.
Bf16Gemm bf16_gemm_path();
// "bf16 GEMM amx" (and "(TS_BF16_GEMM)" when the environment chose it), for the start-up line.
std::string bf16_gemm_note();

// C[M, N] (fp32, row-major, leading dimension N) = alpha · op(A) · op(B) + beta · C, where A and B are
// bf16 row-major with leading dimensions lda and ldb, op(X) = Xᵀ when transX. beta == 0 never
// reads C. Each element of C is the same sum in the same order at any thread count and whatever
// the matrix's size around it (threads share blocks of C; the inner dimension is never split).
// path must be available (Widen is not a path of this function: see kernels_cpu.cu's matmul).
void bf16_gemm(Bf16Gemm path, bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha, const bf16* a,
               int64_t lda, const bf16* b, int64_t ldb, float beta, float* c);

// Attention's score-shaped products (Q Kᵀ, dO Vᵀ) on VDPBF16PS: C[M, N] (fp32, row stride ldc) =
// Σ_k A[i, k] · B[k, j] over K = 2·pairs, with A row-major bf16 (row stride lda, K zero-padded to
// even) and B by pairs of k: for each q, the N columns' values 2q and 2q+1 side by side, B[k, j]
// at b[q·ldb + 2j + k mod 2] (ldb ≥ 2N). M a multiple of 8, N of 16. As bf16_gemm, each product is
// exact and each C element sums them in fp32 in a fixed order. The CPU must run Avx512Bf16.
void bf16_pair_products(int64_t M, int64_t N, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                        float* c, int64_t ldc);

}  // namespace cpu
}  // namespace ts
