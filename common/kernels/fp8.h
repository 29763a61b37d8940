// fp8.h — the OCP 8-bit floating-point formats and the pieces of an FP8 GEMM: amax, scales,
// quantization (per tensor or per tile/block), and the scaled GEMM with fp32 accumulation.
//
// The formats (OCP "8-bit Floating Point Specification", 2023):
//   e4m3fn  1 sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; S.1111.111 is NaN,
//           so the largest finite value is S.1111.110 = ±448. Smallest subnormal 2^-9.
//   e5m2    1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is ±inf,
//           S.11111.{01,10,11} NaN; largest finite ±57344; smallest subnormal 2^-16.
// Encoding rounds to nearest, ties to even (subnormals included). Saturation rule: a value whose
// magnitude rounds above the largest finite one, and ±inf, become ±max (the `satfinite`
// conversion of CUDA and of Transformer Engine's casts); NaN stays NaN (e4m3fn: 0x7f with the
// sign; e5m2: 0x7e with the sign); -0 keeps its sign.
//
// A quantized tensor holds codes q and one scale per tile of tr × tc elements: its value is
// decode(q[r, c]) / scales[r / tr, c / tc]. A per-tensor scale is the tile R × C (scales 1 × 1);
// any tile at least as large as the matrix (kWhole × kWhole) is that one tile. DeepSeek-V3's
// fine-grained recipe (§3.3.1) uses 1 × 128 tiles (activations, gradients along K) and
// 128 × 128 blocks (weights).
#pragma once
#include "tensor/core.h"
#include "tensor/device.h"

namespace ts::fp8 {

constexpr float kMaxE4M3 = 448.f;
constexpr float kMaxE5M2 = 57344.f;
float max_finite(DType format);  // F8E4M3: 448, F8E5M2: 57344
// A tile size that covers any dimension: tr = tc = kWhole is the per-tensor scale.
constexpr int kWhole = 1 << 30;

// ----- the codes, bit for bit (OCP FP8 spec §4: encodings; §5: conversion, round to nearest even
// and the saturating mode). Integer arithmetic on the fp32 bits, so host and device give the same
// code for every input, with no dependence on the compiler's float conversions.
namespace ocp {

// The code of a finite, non-negative x (its fp32 bits a) in a format with M mantissa bits and
// exponent bias `bias`, rounded to nearest, ties to even, before saturation: a value past the
// largest finite one gives a code past it (the caller saturates), the codes being monotone in the
// value.
TS_HD uint32_t round_magnitude(uint32_t a, int M, int bias) {
  // Zero, and fp32 subnormals (< 2^-126): far below half the smallest fp8 subnormal.
  if (a < 0x00800000u) return 0;
  const int e = int(a >> 23) - 127;                   // x = 1.f · 2^e
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u;   // x = sig · 2^(e - 23), sig with its implicit 1
  const int emin = 1 - bias;                          // the exponent of the smallest normal binade
  // The representable values near x are spaced 2^(max(e, emin) - M): the subnormals keep the
  // spacing of the smallest normal binade. That spacing is 2^drop units of sig.
  const int drop = 23 - M + (e < emin ? emin - e : 0);
  if (drop > 24) return 0;  // x < 2^(emin - M - 1), half the smallest subnormal: rounds to 0
  uint32_t q = sig >> drop;  // x in spacings, truncated
  const uint32_t rem = sig & ((1u << drop) - 1), half = 1u << (drop - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;  // nearest; a tie goes to the even q
  // A normal's code is (exponent field e + bias) << M | fraction, with q = 2^M + fraction: that is
  // ((e + bias - 1) << M) + q, and a carry out of the fraction (q = 2^(M+1)) lands in the exponent
  // field as it should. A subnormal has exponent field 0 and q = fraction: the same sum at
  // e = emin, where q = 2^M becomes the smallest normal.
  const int field = (e < emin ? emin : e) + bias - 1;
  return (uint32_t(field) << M) + q;
}

// x's code in a format whose largest finite magnitude code is max_code and whose NaN is nan_code.
TS_HD uint8_t encode(float x, int M, int bias, uint32_t max_code, uint32_t nan_code) {
  const uint32_t u = float_bits(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | nan_code);  // NaN stays NaN, with its sign
  if (a == 0x7f800000u) return uint8_t(sign | max_code);  // ±inf saturate (satfinite)
  const uint32_t code = round_magnitude(a, M, bias);     // -0 gives the code 0x80: the sign stays
  return uint8_t(sign | (code > max_code ? max_code : code));
}

// The fp32 bits of a finite magnitude code c (exponent field and fraction, no sign).
TS_HD uint32_t magnitude_bits(uint32_t c, int M, int bias) {
  const uint32_t mask = (1u << M) - 1;
  uint32_t field = c >> M, frac = c & mask;
  if (field != 0) return (uint32_t(int(field) - bias + 127) << 23) | (frac << (23 - M));
  if (frac == 0) return 0;
  // A subnormal, frac · 2^(1 - bias - M), is a normal fp32: shift the fraction up until its
  // leading 1 sits on the implicit bit, lowering the exponent by one per shift.
  int e = 1 - bias;
  while (!(frac & (1u << M))) {
    frac <<= 1;
    e--;
  }
  return (uint32_t(e + 127) << 23) | ((frac & mask) << (23 - M));
}

constexpr uint32_t kQuietNaN = 0x7fc00000u;
constexpr uint32_t kInfinity = 0x7f800000u;

}  // namespace ocp

// e4m3fn: M = 3, bias 7; largest finite S.1111.110 (0x7e); NaN S.1111.111.
TS_HD uint8_t encode_e4m3(float x) { return ocp::encode(x, 3, 7, 0x7e, 0x7f); }
// e5m2: M = 2, bias 15; largest finite S.11110.11 (0x7b); 0x7e is the NaN it produces.
TS_HD uint8_t encode_e5m2(float x) { return ocp::encode(x, 2, 15, 0x7b, 0x7e); }

TS_HD float decode_e4m3(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  if ((b & 0x7fu) == 0x7fu) return bits_float(sign | ocp::kQuietNaN);  // the only NaN; no infinities
  return bits_float(sign | ocp::magnitude_bits(b & 0x7fu, 3, 7));
}

TS_HD float decode_e5m2(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  if ((b & 0x7cu) == 0x7cu)  // exponent field all ones, as in IEEE 754: inf, or NaN if any fraction bit
    return bits_float(sign | ((b & 0x03u) ? ocp::kQuietNaN : ocp::kInfinity));
  return bits_float(sign | ocp::magnitude_bits(b & 0x7fu, 2, 15));
}

// The scale that maps amax onto the format's largest value, divided by 2^margin (Transformer
// Engine's margin): max_finite / amax / 2^margin, in fp32. amax 0 (an all-zero tile) gives 1; a
// non-finite amax gives NaN, so the NaN reaches the output and the run's finiteness check. A tiny
// amax whose quotient overflows gives FLT_MAX, as in Transformer Engine's current scaling (an
// infinite scale would turn the tile's zeros into NaN: 0 · inf). |margin| <= 100.
float scale_for(float amax, DType format, int margin = 0);

// amax [ceil(R/tr), ceil(C/tc)] fp32 := max |x| over each tile of x [R, C] (fp32 or bf16; a
// higher-rank x is viewed as [numel / last dim, last dim]). Any NaN in a tile makes its amax NaN.
void block_amax(const Tensor& amax, const Tensor& x, int tr, int tc);
// The whole tensor's max |x| (one tile), read to the host.
float amax(const Tensor& x);

// A quantized operand: codes q [R, C] (F8E4M3 or F8E5M2; a higher-rank q viewed as above),
// scales fp32 [ceil(R/tr), ceil(C/tc)], tr, tc >= 1.
struct Quantized {
  Tensor q, scales;
  int tr = 0, tc = 0;
};
// q := encode(x · scales[r / tr, c / tc]) for x [R, C] fp32 or bf16 (the product rounded to fp32,
// then encoded); q's dtype is the format, its element count and last dim x's.
void quantize(Quantized& out, const Tensor& x);
// Allocates out.q (x's shape, the format) and out.scales (both Tag::Workspace, on x's device) and
// computes the scales from the tiles' amax (scale_for(block_amax)), then quantizes: the
// current-scaling recipe in one call.
Quantized quantize_current(const Tensor& x, DType format, int tr, int tc, int margin = 0);

// How partial sums accumulate. The default is fp32 throughout. mantissa_bits < 23 emulates an
// accumulator with fewer bits (Hopper's FP8 tensor cores keep about 14, DeepSeek-V3 §3.3.2): the
// running sum is rounded to that many mantissa bits (nearest even) after every addition, and every
// promote_every products (N_C; 0: never) the partial sum is added into an fp32 accumulator and
// restarted, DeepSeek-V3's promotion to CUDA cores. Each addition is exact before the rounding
// (the running sum and a product of codes, added in double), so mantissa_bits 23 with
// promote_every 0 is plain fp32 accumulation in k order. A scale chunk's end also promotes (its
// scale ends there). 1 <= mantissa_bits <= 23; an emulation, a scalar loop on either device.
struct Accum {
  int mantissa_bits = 23;
  int promote_every = 0;
};

// C [M, N] (fp32 or bf16) := Σ_k op(A)[m, k] · op(B)[k, n] (values as dequantized above)
//                            + beta · C,
// op(X) = X^T when trans. Each K-chunk over which both operands' scales are constant is
// multiplied exactly as an FP8 tensor core does — products of codes, summed in fp32 (or as
// `acc` says) — and the chunk's sum is then multiplied by the two dequantization factors
// 1/sA and 1/sB (their fp32 product) and added to the fp32 result. The scale tiles of A and B
// along K must be equal or cover all of K (checked). On the CPU the chunk products are an sgemm
// of the decoded codes (exact: a code times a code fits fp32's mantissa); on CUDA, cuBLASLt's FP8
// GEMM when native_gemm takes it (per-tensor scales, sm_89 or later), and otherwise the decoded
// codes through cuBLAS's fp32 GEMM, chunk by chunk as on the CPU. beta 0 ignores C's old contents.
void gemm(const Tensor& C, const Quantized& A, bool transA, const Quantized& B, bool transB, float beta = 0.f,
          const Accum& acc = {});

// dst [C, R] := src [R, C]^T, for FP8 codes (the dtype of both), on either device.
void transpose_codes(const Tensor& dst, const Tensor& src);

// fp8_cublaslt.cu: out [M, N] fp32 += op(A) op(B) dequantized, by cuBLASLt's FP8 tensor-core GEMM.
// It takes per-tensor scales only (both scale grids 1 × 1), CUDA tensors on an sm_89+ device,
// M, N, K multiples of 16 and not two e5m2 operands; returns false, doing nothing, otherwise
// (and when TS_FP8_GEMM=decode asks for the decode path). cuBLASLt wants both operands with K
// contiguous ("TN"); an operand stored the other way is transposed first (transpose_codes). The
// scales never leave the device: the dequantization factor reaches cuBLASLt as a device pointer,
// so the call makes no device-to-host copy and never waits for the GPU.
bool native_gemm(const Tensor& out, const Quantized& A, bool transA, const Quantized& B, bool transB, int64_t M,
                 int64_t N, int64_t K);

}  // namespace ts::fp8
