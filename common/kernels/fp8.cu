// fp8.cu — the FP8 substrate of fp8.h: amax, scales, quantization and the scaled GEMM, on the CPU
// and (TS_CUDA) on a GPU.
//
// The per-element math is shared by both devices and written once, TS_HD: the OCP codes of fp8.h,
// scale_of, the operand views and the accumulator emulation (emulate_element). So the two devices
// give the same amax, scales and codes bit for bit, and the same emulated sums.
//
// The default GEMM path is one device-agnostic loop over the K-chunks (gemm_decoded): the chunk of
// each operand is decoded to fp32 (exact: every code is an fp32 value), multiplied by ts::matmul,
// which is OpenBLAS sgemm on panels fixed by the shape on the CPU (bitwise identical at any thread
// count) and cuBLAS's fp32 GEMM without TF32 on CUDA; the products of two codes are exact in fp32
// (at most 4 x 4 significant bits) and are summed in fp32, as an FP8 tensor core's promoted sums
// are. The chunk's sum is then scaled by its dequantization factor and added to the fp32 result
// (scale_add): DeepSeek-V3 §3.3.2's promotion, where the scales are applied on the CUDA cores.
//
// On CUDA with per-tensor scales and an sm_89+ device the GEMM goes to cuBLASLt's FP8 tensor
// cores instead (native_gemm, fp8_cublaslt.cu); everything else, blockwise scales and the Accum
// emulation included, takes the decode path, whose CUDA result follows the CPU's arithmetic and
// differs only in the fp32 GEMM's summation order.
#include "kernels/fp8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "tensor/device.h"

namespace ts::fp8 {
namespace {

bool is_fp8(DType t) { return t == DType::F8E4M3 || t == DType::F8E5M2; }

// A tensor as the matrix [numel / last dim, last dim] (fp8.h's view of higher ranks).
struct Mat {
  int64_t rows, cols;
};
Mat as_mat(const char* op, const char* name, const Tensor& t) {
  detail::check_defined(op, name, t);
  TS_CHECK(t.dim() >= 1, "%s: %s must have at least one dimension, got %s", op, name, t.str().c_str());
  int64_t rows = 1;  // every dimension but the last, so that an empty K still leaves [M, 0]
  for (int d = 0; d + 1 < t.dim(); d++) rows *= t.size(d);
  return {rows, t.size(-1)};
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A [rows, cols] matrix cut into tiles tr x tc: the scale (or amax) grid is [gr, gc]; the last
// tile of a row or column may be ragged.
struct Grid {
  int64_t rows, cols, tr, tc, gr, gc;
};
Grid grid_of(const char* op, Mat m, int tr, int tc) {
  TS_CHECK(tr >= 1 && tc >= 1, "%s: tile sizes must be >= 1, got %d x %d", op, tr, tc);
  return {m.rows, m.cols, tr, tc, ceil_div(m.rows, tr), ceil_div(m.cols, tc)};
}

// ----- the per-element math, shared by the CPU loops and the CUDA kernels ----------------------

TS_HD uint8_t encode(bool e5m2, float x) { return e5m2 ? encode_e5m2(x) : encode_e4m3(x); }
TS_HD float decode(bool e5m2, uint8_t b) { return e5m2 ? decode_e5m2(b) : decode_e4m3(b); }

// The running max of |x| that keeps a NaN once it has seen one (fmaxf would drop it), so a NaN
// in a tile reaches its scale and from there the output. Exact, so any reduction order agrees.
TS_HD float amax_step(float m, float v) { return (v > m || v != v) ? v : m; }

// scale_for's contract (fp8.h), with pow2_margin = 2^margin computed on the host.
TS_HD float scale_of(float amax, float maxv, float pow2_margin) {
  if (amax == 0.f) return 1.f;  // an all-zero tile: any scale encodes it exactly
  if (!(amax <= FLT_MAX)) return bits_float(ocp::kQuietNaN);  // inf or NaN: poison the output
  const float s = maxv / amax / pow2_margin;
  return s > FLT_MAX ? FLT_MAX : s;  // a tiny amax: Transformer Engine's clamp, never inf
}

// op(X) of a quantized operand as a matrix, X stored [R, ld] with scales [., gc] per tr x tc tile:
// element (i, k) of op(X) is X[i, k], or X[k, i] when trans.
struct OpView {
  const uint8_t* q;
  const float* s;
  int64_t ld, gc, tr, tc;
  bool trans, e5m2;
  TS_HD uint8_t code(int64_t i, int64_t k) const { return trans ? q[k * ld + i] : q[i * ld + k]; }
  TS_HD float scale(int64_t i, int64_t k) const {
    return trans ? s[(k / tr) * gc + i / tc] : s[(i / tr) * gc + k / tc];
  }
};

// The factor that dequantizes the product of A's row m and B's column n over the chunk at k0:
// 1/sA times 1/sB, each reciprocal and the product rounded to fp32 (fp8.h).
TS_HD float dequant(const OpView& A, const OpView& B, int64_t m, int64_t k0, int64_t n) {
  return (1.f / A.scale(m, k0)) * (1.f / B.scale(k0, n));
}

// x rounded to `mbits` fraction bits, to nearest, ties to even: the emulated accumulator's
// register after each addition. On the double's bits, so host and device agree; x is normal or 0
// (sums of products of codes are multiples of 2^-32, far above double's subnormals), and a carry
// out of the fraction correctly bumps the exponent.
TS_HD double round_to_bits(double x, int mbits) {
  if (x == 0.0 || !(fabs(x) <= DBL_MAX)) return x;  // zero, inf, NaN pass through
  uint64_t u;
  memcpy(&u, &x, 8);
  const int drop = 52 - mbits;
  const uint64_t half = uint64_t(1) << (drop - 1), rem = u & ((half << 1) - 1);
  u -= rem;
  if (rem > half || (rem == half && ((u >> drop) & 1u))) u += half << 1;
  memcpy(&x, &u, 8);
  return x;
}

// C[m, n] (its fp32 value `out`, beta already applied) plus the emulated accumulation of fp8.h's
// Accum: per chunk of kc, a running sum of products of codes, exact in double and then rounded to
// mantissa_bits; every promote_every products and at the chunk's end it is added into an fp32
// accumulator (DeepSeek-V3 §3.3.2, N_C = 128 there), which is dequantized and added to out.
TS_HD float emulate_element(const OpView& A, const OpView& B, int64_t m, int64_t n, int64_t K, int64_t kc,
                            Accum acc, float out) {
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t k1 = k0 + kc < K ? k0 + kc : K;
    float promoted = 0.f;
    double part = 0.0;
    int count = 0;
    for (int64_t k = k0; k < k1; k++) {
      const float p = decode(A.e5m2, A.code(m, k)) * decode(B.e5m2, B.code(k, n));  // exact in fp32
      part = round_to_bits(part + double(p), acc.mantissa_bits);
      if (++count == acc.promote_every) {
        promoted += float(part);  // part has <= 24 significant bits: exact as a float
        part = 0.0;
        count = 0;
      }
    }
    if (count) promoted += float(part);
    out = fmaf(promoted, dequant(A, B, m, k0, n), out);
  }
  return out;
}

// ----- the CPU ---------------------------------------------------------------------------------
namespace on_cpu {

// The 256 values of a format, decoded once: the GEMM's chunks decode by lookup.
const float* decode_table(bool e5m2) {
  static const auto make = [](bool f) {
    std::vector<float> t(256);
    for (int c = 0; c < 256; c++) t[c] = decode(f, uint8_t(c));
    return t;
  };
  static const std::vector<float> e4 = make(false), e5 = make(true);
  return e5m2 ? e5.data() : e4.data();
}

void block_amax(float* out, const Tensor& x, const Grid& g) {
  detail::by_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t bi = 0; bi < g.gr; bi++) {
      float* o = out + bi * g.gc;
      for (int64_t bj = 0; bj < g.gc; bj++) o[bj] = 0.f;
      for (int64_t r = bi * g.tr; r < std::min(g.rows, (bi + 1) * g.tr); r++)
        for (int64_t bj = 0; bj < g.gc; bj++) {
          float m = o[bj];
          for (int64_t c = bj * g.tc; c < std::min(g.cols, (bj + 1) * g.tc); c++)
            m = amax_step(m, std::fabs(ld(px[r * g.cols + c])));
          o[bj] = m;
        }
    }
  });
}

void to_scales(float* s, int64_t n, float maxv, float pow2_margin) {
  for (int64_t i = 0; i < n; i++) s[i] = scale_of(s[i], maxv, pow2_margin);
}

void quantize(uint8_t* q, const Tensor& x, const float* scales, const Grid& g, bool e5m2) {
  detail::by_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < g.rows; r++)
      for (int64_t bj = 0; bj < g.gc; bj++) {
        const float s = scales[(r / g.tr) * g.gc + bj];
        for (int64_t c = bj * g.tc; c < std::min(g.cols, (bj + 1) * g.tc); c++)
          q[r * g.cols + c] = encode(e5m2, ld(px[r * g.cols + c]) * s);
      }
  });
}

// dst := the decoded codes of K-range [k0, k1) of q [R, C]: columns ([R, k1 - k0]) when K runs
// along q's rows' length, else rows ([k1 - k0, C], contiguous in q).
void decode_chunk(float* dst, const uint8_t* q, int64_t R, int64_t C, bool k_is_cols, int64_t k0, int64_t k1,
                  bool e5m2) {
  const float* lut = decode_table(e5m2);
  const int64_t kw = k1 - k0;
  if (k_is_cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++)
      for (int64_t j = 0; j < kw; j++) dst[r * kw + j] = lut[q[r * C + k0 + j]];
  } else {
    const uint8_t* src = q + k0 * C;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < kw * C; i++) dst[i] = lut[src[i]];
  }
}

// out [M, N] += P · dequant, P the chunk at k0's sum of products of codes (one rounding: an fma).
void scale_add(float* out, const float* P, const OpView& A, const OpView& B, int64_t M, int64_t N, int64_t k0) {
  std::vector<float> ia(M), ib(N);
  for (int64_t m = 0; m < M; m++) ia[m] = 1.f / A.scale(m, k0);
  for (int64_t n = 0; n < N; n++) ib[n] = 1.f / B.scale(k0, n);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) out[m * N + n] = std::fma(P[m * N + n], ia[m] * ib[n], out[m * N + n]);
}

void emulate(float* out, const OpView& A, const OpView& B, int64_t M, int64_t N, int64_t K, int64_t kc,
             const Accum& acc) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) out[m * N + n] = emulate_element(A, B, m, n, K, kc, acc, out[m * N + n]);
}

void transpose_codes(uint8_t* dst, const uint8_t* src, int64_t R, int64_t C) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) dst[c * R + r] = src[r * C + c];
}

}  // namespace on_cpu

// ----- CUDA ------------------------------------------------------------------------------------
#ifdef TS_CUDA
namespace on_gpu {

constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n items, at least one, capped so a huge n loops.
unsigned blocks_for(int64_t n) { return unsigned(std::min<int64_t>(std::max<int64_t>(ceil_div(n, kThreads), 1), 16384)); }

// One block per tile (grid-stride over tiles): a strided max over the tile, then a tree in shared
// memory. The max is exact, so the result equals the CPU's bit for bit.
template <class T> __global__ void block_amax_kernel(float* out, const T* x, Grid g) {
  __shared__ float red[kThreads];
  for (int64_t t = blockIdx.x; t < g.gr * g.gc; t += gridDim.x) {
    const int64_t r0 = (t / g.gc) * g.tr, c0 = (t % g.gc) * g.tc;
    const int64_t h = min(g.tr, g.rows - r0), w = min(g.tc, g.cols - c0);
    float m = 0.f;
    for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) m = amax_step(m, fabsf(ld(x[(r0 + i / w) * g.cols + c0 + i % w])));
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (int(threadIdx.x) < s) red[threadIdx.x] = amax_step(red[threadIdx.x], red[threadIdx.x + s]);
      __syncthreads();
    }
    if (threadIdx.x == 0) out[t] = red[0];
    __syncthreads();  // red is reused by the next tile
  }
}

void block_amax(float* out, const Tensor& x, const Grid& g) {
  detail::by_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    TS_LAUNCH(blocks_for(g.gr * g.gc * kThreads), kThreads, 0, compute_stream(), block_amax_kernel<T>)(out, x.data<T>(), g);
    KERNEL_CHECK();
  });
}

__global__ void to_scales_kernel(float* s, int64_t n, float maxv, float pow2_margin) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s[i] = scale_of(s[i], maxv, pow2_margin);
}

void to_scales(float* s, int64_t n, float maxv, float pow2_margin) {
  TS_LAUNCH(blocks_for(n), kThreads, 0, compute_stream(), to_scales_kernel)(s, n, maxv, pow2_margin);
  KERNEL_CHECK();
}

template <class T> __global__ void quantize_kernel(uint8_t* q, const T* x, const float* scales, Grid g, bool e5m2) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < g.rows * g.cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / g.cols, c = i % g.cols;
    q[i] = encode(e5m2, ld(x[i]) * scales[(r / g.tr) * g.gc + c / g.tc]);
  }
}

void quantize(uint8_t* q, const Tensor& x, const float* scales, const Grid& g, bool e5m2) {
  detail::by_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    TS_LAUNCH(blocks_for(g.rows * g.cols), kThreads, 0, compute_stream(), quantize_kernel<T>)(q, x.data<T>(), scales, g, e5m2);
    KERNEL_CHECK();
  });
}

// on_cpu::decode_chunk's layout, one element per thread (grid-stride).
__global__ void decode_chunk_kernel(float* dst, const uint8_t* q, int64_t R, int64_t C, bool k_is_cols, int64_t k0,
                                    int64_t kw, bool e5m2) {
  const int64_t n = k_is_cols ? R * kw : kw * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = decode(e5m2, k_is_cols ? q[(i / kw) * C + k0 + i % kw] : q[k0 * C + i]);
}

void decode_chunk(float* dst, const uint8_t* q, int64_t R, int64_t C, bool k_is_cols, int64_t k0, int64_t k1,
                  bool e5m2) {
  TS_LAUNCH(blocks_for((k1 - k0) * (k_is_cols ? R : C)), kThreads, 0, compute_stream(), decode_chunk_kernel)(
      dst, q, R, C, k_is_cols, k0, k1 - k0, e5m2);
  KERNEL_CHECK();
}

__global__ void scale_add_kernel(float* out, const float* P, OpView A, OpView B, int64_t M, int64_t N, int64_t k0) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = fmaf(P[i], dequant(A, B, i / N, k0, i % N), out[i]);
}

void scale_add(float* out, const float* P, const OpView& A, const OpView& B, int64_t M, int64_t N, int64_t k0) {
  TS_LAUNCH(blocks_for(M * N), kThreads, 0, compute_stream(), scale_add_kernel)(out, P, A, B, M, N, k0);
  KERNEL_CHECK();
}

// One thread per element of C, each the scalar loop of the CPU: the emulation is a model of the
// accumulator, not a fast path.
__global__ void emulate_kernel(float* out, OpView A, OpView B, int64_t M, int64_t N, int64_t K, int64_t kc, Accum acc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = emulate_element(A, B, i / N, i % N, K, kc, acc, out[i]);
}

void emulate(float* out, const OpView& A, const OpView& B, int64_t M, int64_t N, int64_t K, int64_t kc,
             const Accum& acc) {
  TS_LAUNCH(blocks_for(M * N), kThreads, 0, compute_stream(), emulate_kernel)(out, A, B, M, N, K, kc, acc);
  KERNEL_CHECK();
}

// A grid-stride loop over dst's elements: reads are strided, writes coalesced; one byte each, so
// a tiled transpose would gain little next to the GEMM that follows.
__global__ void transpose_kernel(uint8_t* dst, const uint8_t* src, int64_t R, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R * C; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[(i % R) * C + i / R];  // dst[c, r] = src[r, c] with i = c·R + r
}

void transpose_codes(uint8_t* dst, const uint8_t* src, int64_t R, int64_t C) {
  TS_LAUNCH(blocks_for(R * C), kThreads, 0, compute_stream(), transpose_kernel)(dst, src, R, C);
  KERNEL_CHECK();
}

}  // namespace on_gpu
#define FP8_ON(dev, call) ((dev) == Device::CUDA ? on_gpu::call : on_cpu::call)
#else
#define FP8_ON(dev, call) ((dev) == Device::CUDA ? fatal("fp8: a CUDA tensor in a CPU-only build") : on_cpu::call)
#endif

// ----- checks shared by the public functions ---------------------------------------------------

// X's codes and scales are consistent; returns the grid of its stored matrix.
Grid check_quantized(const char* op, const char* name, const Quantized& X) {
  const std::string qn = std::string(name) + ".q", sn = std::string(name) + ".scales";
  const Mat m = as_mat(op, qn.c_str(), X.q);
  TS_CHECK(is_fp8(X.q.dtype), "%s: %s must be f8e4m3 or f8e5m2, got %s", op, qn.c_str(), X.q.str().c_str());
  const Grid g = grid_of(op, m, X.tr, X.tc);
  detail::check_dtype(op, sn.c_str(), X.scales, DType::F32);
  detail::check_shape(op, sn.c_str(), X.scales, {g.gr, g.gc});
  return g;
}

OpView view_of(const Quantized& X, const Grid& g, bool trans) {
  return {X.q.data<uint8_t>(), X.scales.f32(), g.cols, g.gc, g.tr, g.tc, trans, X.q.dtype == DType::F8E5M2};
}

// The K-chunk over which both operands' scales are constant, from their tiles along K (fp8.h:
// equal, or one covering all of K). At least 1, so an empty K loops zero times.
int64_t k_chunk(const char* op, int64_t tile_a, int64_t tile_b, int64_t K) {
  const bool a_all = tile_a >= K, b_all = tile_b >= K;
  TS_CHECK(a_all || b_all || tile_a == tile_b,
           "%s: the scale tiles of A and B along K must be equal or cover all of K = %lld; A's are %lld, B's %lld",
           op, (long long)K, (long long)tile_a, (long long)tile_b);
  return std::max<int64_t>(1, std::min(a_all ? K : tile_a, b_all ? K : tile_b));
}

// The default path: each chunk's codes decoded to fp32 and multiplied by ts::matmul, its sum
// dequantized into out (the file's header says why this is exact up to fp32 summation).
void gemm_decoded(const Tensor& out, const Quantized& A, const Grid& ga, bool transA, const Quantized& B,
                  const Grid& gb, bool transB, int64_t M, int64_t N, int64_t K, int64_t kc) {
  const Device dev = out.device();
  const OpView va = view_of(A, ga, transA), vb = view_of(B, gb, transB);
  Tensor ta = Tensor::empty({M * kc}, DType::F32, dev, Tag::Workspace);
  Tensor tb = Tensor::empty({kc * N}, DType::F32, dev, Tag::Workspace);
  Tensor P = Tensor::empty({M, N}, DType::F32, dev, Tag::Workspace);
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kw = std::min(kc, K - k0);
    const Tensor a = ta.view(0, transA ? std::vector<int64_t>{kw, M} : std::vector<int64_t>{M, kw});
    const Tensor b = tb.view(0, transB ? std::vector<int64_t>{N, kw} : std::vector<int64_t>{kw, N});
    // K runs along A's stored rows' length unless transA, along B's only when transB.
    FP8_ON(dev, decode_chunk(a.f32(), va.q, ga.rows, ga.cols, !transA, k0, k0 + kw, va.e5m2));
    FP8_ON(dev, decode_chunk(b.f32(), vb.q, gb.rows, gb.cols, transB, k0, k0 + kw, vb.e5m2));
    matmul(P, a, transA, b, transB);
    FP8_ON(dev, scale_add(out.f32(), P.f32(), va, vb, M, N, k0));
  }
}

}  // namespace

float max_finite(DType format) {
  TS_CHECK(is_fp8(format), "fp8::max_finite: %s is not an fp8 format", dtype_name(format));
  return format == DType::F8E4M3 ? kMaxE4M3 : kMaxE5M2;
}

float scale_for(float amax, DType format, int margin) {
  TS_CHECK(margin >= -100 && margin <= 100, "fp8::scale_for: margin %d outside [-100, 100]", margin);
  return scale_of(amax, max_finite(format), bits_float(uint32_t(127 + margin) << 23));
}

void block_amax(const Tensor& amax, const Tensor& x, int tr, int tc) {
  const char* op = "fp8::block_amax";
  detail::check_float(op, "x", x);
  const Grid g = grid_of(op, as_mat(op, "x", x), tr, tc);
  detail::check_dtype(op, "amax", amax, DType::F32);
  detail::check_shape(op, "amax", amax, {g.gr, g.gc});
  FP8_ON(detail::common_device(op, {&amax, &x}), block_amax(amax.f32(), x, g));
}

float amax(const Tensor& x) {
  Tensor m = Tensor::empty({1, 1}, DType::F32, x.device(), Tag::Workspace);
  block_amax(m, x, kWhole, kWhole);
  return to_host_f32(m)[0];
}

void quantize(Quantized& out, const Tensor& x) {
  const char* op = "fp8::quantize";
  detail::check_float(op, "x", x);
  const Grid g = check_quantized(op, "out", out);
  TS_CHECK(out.q.numel() == x.numel() && out.q.size(-1) == x.size(-1),
           "%s: out.q %s must hold x %s (its element count and last dimension)", op, out.q.str().c_str(),
           x.str().c_str());
  const Device dev = detail::common_device(op, {&x, &out.q, &out.scales});
  FP8_ON(dev, quantize(out.q.data<uint8_t>(), x, out.scales.f32(), g, out.q.dtype == DType::F8E5M2));
}

Quantized quantize_current(const Tensor& x, DType format, int tr, int tc, int margin) {
  const char* op = "fp8::quantize_current";
  detail::check_float(op, "x", x);
  TS_CHECK(margin >= -100 && margin <= 100, "%s: margin %d outside [-100, 100]", op, margin);
  const Grid g = grid_of(op, as_mat(op, "x", x), tr, tc);
  Quantized out;
  out.q = Tensor::empty(x.shape, format, x.device(), Tag::Workspace);
  out.scales = Tensor::empty({g.gr, g.gc}, DType::F32, x.device(), Tag::Workspace);
  out.tr = tr;
  out.tc = tc;
  block_amax(out.scales, x, tr, tc);  // the amax, turned into scales in place
  FP8_ON(x.device(), to_scales(out.scales.f32(), g.gr * g.gc, max_finite(format),
                               bits_float(uint32_t(127 + margin) << 23)));
  quantize(out, x);
  return out;
}

void gemm(const Tensor& C, const Quantized& A, bool transA, const Quantized& B, bool transB, float beta,
          const Accum& acc) {
  const char* op = "fp8::gemm";
  const Grid ga = check_quantized(op, "A", A), gb = check_quantized(op, "B", B);
  detail::check_float(op, "C", C);
  const Device dev = detail::common_device(op, {&C, &A.q, &A.scales, &B.q, &B.scales});
  const int64_t M = transA ? ga.cols : ga.rows, K = transA ? ga.rows : ga.cols;
  const int64_t Kb = transB ? gb.cols : gb.rows, N = transB ? gb.rows : gb.cols;
  const Mat c = as_mat(op, "C", C);
  TS_CHECK(K == Kb && c.rows == M && c.cols == N,
           "%s: shapes do not compose: C %s = op(A) %s%s @ op(B) %s%s", op, C.str().c_str(), A.q.str().c_str(),
           transA ? "^T" : "", B.q.str().c_str(), transB ? "^T" : "");
  TS_CHECK(acc.mantissa_bits >= 1 && acc.mantissa_bits <= 23 && acc.promote_every >= 0,
           "%s: Accum needs 1 <= mantissa_bits <= 23 and promote_every >= 0, got %d and %d", op, acc.mantissa_bits,
           acc.promote_every);
  const int64_t kc = k_chunk(op, transA ? ga.tr : ga.tc, transB ? gb.tc : gb.tr, K);
  if (M == 0 || N == 0) return;
  // The fp32 result: C itself, or workspace rounded into a bf16 C at the end.
  const Tensor out = C.dtype == DType::F32 ? C : Tensor::empty({M, N}, DType::F32, dev, Tag::Workspace);
  if (beta == 0.f) {
    fill(out, 0.f);  // C's old contents ignored, NaN included
  } else {
    if (C.dtype != DType::F32) convert(out, C);
    if (beta != 1.f) scale_inplace(out, beta);
  }
  const bool exact = acc.mantissa_bits == 23 && acc.promote_every == 0;
  if (!exact)
    FP8_ON(dev, emulate(out.f32(), view_of(A, ga, transA), view_of(B, gb, transB), M, N, K, kc, acc));
  else if (!native_gemm(out, A, transA, B, transB, M, N, K))
    gemm_decoded(out, A, ga, transA, B, gb, transB, M, N, K, kc);
  if (C.dtype != DType::F32) convert(C, out);
}

void transpose_codes(const Tensor& dst, const Tensor& src) {
  const char* op = "fp8::transpose_codes";
  const Mat m = as_mat(op, "src", src), d = as_mat(op, "dst", dst);
  TS_CHECK(is_fp8(src.dtype) && dst.dtype == src.dtype && d.rows == m.cols && d.cols == m.rows,
           "%s: dst must be src's fp8 codes transposed: dst %s, src %s", op, dst.str().c_str(), src.str().c_str());
  const Device dev = detail::common_device(op, {&dst, &src});
  FP8_ON(dev, transpose_codes(dst.data<uint8_t>(), src.data<uint8_t>(), m.rows, m.cols));
}

}  // namespace ts::fp8
