// kernels_cpu.cu — the tuned CPU kernels (kernels_cpu.h): embedding backward, RMSNorm, RoPE,
// matmul, attention, cross-entropy (fused and vocabulary-parallel) and the sum of squares, each as
// fast as plain C++ on one core allows and shared by OpenMP threads.
//
// Each kernel is templated on the activation storage type T (float or bf16, loaded with ld() and
// stored with st<T>()) and accumulates in fp32 (double where it costs little). Threads split work
// by rows, heads or panels with static schedules; every reduction that crosses rows runs in a
// fixed order, so results are bitwise identical for any OMP_NUM_THREADS. The plain-loop reference
// of each, the oracle the tests hold it to, is in kernels_ref.cu.
#include "kernels/kernels_cpu.h"
#include "kernels/kernels.h"
#include "kernels/kernels_bf16.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/kernels_internal.h"
#include "tensor/device.h"

namespace ts {
namespace cpu {
namespace {

using detail::by_dtype;

Tensor workspace(int64_t n) { return Tensor::empty({n}, DType::F32, Device::CPU, Tag::Workspace); }

using detail::round_up;

template <class T> void widen(float* dst, const T* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) dst[i] = ld(src[i]);
}

// A tensor's data as fp32: the tensor itself, or a widened copy in tmp.
const float* as_f32(const Tensor& t, Tensor& tmp) {
  if (t.dtype == DType::F32) return t.f32();
  tmp = workspace(t.numel());
  widen(tmp.f32(), t.b16(), t.numel());
  return tmp.f32();
}

// ===== embedding ================================================================================

// Threads own disjoint ranges of table rows and each scans the tokens in order, so every row
// accumulates its tokens in token order whatever the thread count — no atomics, no partials.
template <class T>
void embedding_backward_cpu(float* dtable, const T* dout, const int32_t* tok, int64_t N, int64_t V, int64_t D,
                            int64_t vocab_start) {
  const int64_t nblocks = std::min<int64_t>(V, 64), per = (V + nblocks - 1) / nblocks;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const int64_t r0 = blk * per, r1 = std::min(V, r0 + per);
    for (int64_t n = 0; n < N; n++) {
      const int64_t row = int64_t(tok[n]) - vocab_start;
      if (row < r0 || row >= r1) continue;
      float* __restrict dt = dtable + row * D;
      const T* __restrict g = dout + n * D;
      for (int64_t d = 0; d < D; d++) dt[d] += ld(g[d]);
    }
  }
}

// ===== RMSNorm ==================================================================================

// y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
template <class T>
void rmsnorm_forward_cpu(T* y, float* rstd, const T* x, const float* w, float eps, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* __restrict xr = x + n * D;
    T* __restrict yr = y + n * D;
    double ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += double(ld(xr[d])) * ld(xr[d]);
    const float r = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
    rstd[n] = r;
    for (int64_t d = 0; d < D; d++) yr[d] = st<T>(ld(xr[d]) * r * w[d]);
  }
}

// With xhat = x*rstd: dx = rstd * (w*dy - xhat * mean(w*dy*xhat)); dw += sum_n dy * xhat.
template <class T>
void rmsnorm_backward_cpu(T* dx, float* dw, const T* dy, const T* x, const float* w, const float* rstd,
                          int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const T* __restrict dyr = dy + n * D;
    const T* __restrict xr = x + n * D;
    const float r = rstd[n];
    double dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; d++) dot += double(w[d] * ld(dyr[d])) * (ld(xr[d]) * r);
    const float c = float(dot / double(D));
    T* __restrict dxr = dx + n * D;
    for (int64_t d = 0; d < D; d++) dxr[d] = st<T>(r * (w[d] * ld(dyr[d]) - ld(xr[d]) * r * c));
  }
  // dw: threads own column ranges and walk the rows in order (fixed order for any thread count).
  constexpr int64_t kCols = 64;
  const int64_t nblocks = (D + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const int64_t c0 = blk * kCols, nc = std::min(D - c0, kCols);
    float acc[kCols];  // dw's columns stay in registers across the rows
    std::copy(dw + c0, dw + c0 + nc, acc);
    for (int64_t n = 0; n < N; n++) {
      const float r = rstd[n];
      const T* __restrict dyr = dy + n * D + c0;
      const T* __restrict xr = x + n * D + c0;
      for (int64_t d = 0; d < nc; d++) acc[d] += ld(dyr[d]) * (ld(xr[d]) * r);
    }
    std::copy(acc, acc + nc, dw + c0);
  }
}

// ===== RoPE =====================================================================================

// cos/sin of pos[s] * inv_freq_j, inv_freq_j = theta^(-2j/hd), as [S, hd/2] tables. The angle
// is formed in double: at positions of thousands an fp32 angle is already off by ~1e-4 rad.
// Every rotation of a step (q and k of each layer, forward and backward) uses the same positions,
// so the tables are kept and rebuilt only when the positions, hd or theta change: their S * hd
// sines and cosines cost more than the rotation itself.
struct RopeTable {
  std::vector<int32_t> pos;
  int64_t hd = 0;
  float theta = 0;
  std::vector<float> cs, sn;
};

const RopeTable& rope_table(const int32_t* pos, int64_t S, int64_t hd, float theta) {
  thread_local RopeTable t;
  if (t.hd == hd && t.theta == theta && t.pos.size() == size_t(S) && std::equal(pos, pos + S, t.pos.begin()))
    return t;
  t.pos.assign(pos, pos + S);
  t.hd = hd;
  t.theta = theta;
  const int64_t half = hd / 2;
  std::vector<double> inv_freq(half);
  for (int64_t j = 0; j < half; j++) inv_freq[j] = std::pow(double(theta), -2.0 * double(j) / double(hd));
  t.cs.resize(S * half);
  t.sn.resize(S * half);
  for (int64_t s = 0; s < S; s++)
    for (int64_t j = 0; j < half; j++) {
      const double angle = double(pos[s]) * inv_freq[j];
      t.cs[s * half + j] = float(std::cos(angle));
      t.sn[s * half + j] = float(std::sin(angle));
    }
  return t;
}

// x' = x*cos + rotate_half(x)*sin on pairs (j, j + hd/2): (a, b) -> (a cos - b sin, b cos + a sin).
// sign = -1 applies the inverse rotation (the backward pass: R^T = R(-angle)).
template <class T>
void rope_cpu(T* x, const int32_t* pos, float theta, float sign, int64_t B, int64_t S, int64_t H, int64_t hd) {
  const RopeTable& t = rope_table(pos, S, hd, theta);
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bs = 0; bs < B * S; bs++) {
    const float* c = t.cs.data() + (bs % S) * half;
    const float* s = t.sn.data() + (bs % S) * half;
    for (int64_t h = 0; h < H; h++) {
      T* __restrict xh = x + (bs * H + h) * hd;
      for (int64_t j = 0; j < half; j++) {
        const float a = ld(xh[j]), b = ld(xh[j + half]), sj = sign * s[j];
        xh[j] = st<T>(a * c[j] - b * sj);
        xh[j + half] = st<T>(b * c[j] + a * sj);
      }
    }
  }
}

// ===== matmul ===================================================================================

// Threads share a matmul by blocks of C, each one single-threaded sgemm over the whole inner
// dimension K. The blocks come from the shape alone, never from the thread count, so every element
// of C is the same sum computed by the same kernel call at any OMP_NUM_THREADS: bitwise identical.
// C is cut along its larger side (token rows, or feature columns) into panels of at least
// kMinPanel, a power of two of them up to kMaxPanels: a small matmul stays one call, 2 or 4
// threads get equal shares, and each panel amortises the copy of the operand the panels share
// (OpenBLAS packs K x the other side per call: 1/(2 panel) extra element moves per FLOP; at 64
// rows that cost a one-thread step 20% of its GEMM time, at 128 about 8%).
// Calling sgemm from several threads at once is safe in Debian's libopenblas0-pthread (0.3.21): it
// is built with USE_THREAD=1, which compiles in the locks around OpenBLAS's buffer pool; the unsafe
// case is a build with USE_THREAD=0 and no USE_LOCKING (OpenBLAS issues #2126, #2164).
constexpr int64_t kMinPanel = 128, kMaxPanels = 8;

struct GemmPanels {
  bool rows;  // panels of rows of C (else of columns)
  int64_t size, count;
};

GemmPanels gemm_panels(int64_t M, int64_t N) {
  const bool rows = M >= N;
  const int64_t L = rows ? M : N;
  int64_t panels = 1;
  while (2 * panels <= std::min(L / kMinPanel, kMaxPanels)) panels *= 2;
  const int64_t size = round_up((L + panels - 1) / panels, 16);  // whole SIMD-kernel tiles per panel
  return {rows, size, (L + size - 1) / size};
}

void sgemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// C[M, N] = alpha op(A) op(B) + beta C, row-major, by the panels of gemm_panels.
// When OPENBLAS_NUM_THREADS asks for more than one thread, OpenBLAS splits the one call itself.
void sgemm_panels(bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c) {
  const GemmPanels p = openblas_get_num_threads() > 1 ? GemmPanels{true, M, 1} : gemm_panels(M, N);
#pragma omp parallel for schedule(dynamic, 1) if (p.count > 1)
  for (int64_t i = 0; i < p.count; i++) {
    const int64_t lo = i * p.size, n = std::min(p.size, (p.rows ? M : N) - lo);
    if (p.rows)  // rows lo.. of op(A): a row offset of A, or a column offset of A stored transposed
      sgemm(transA, transB, n, N, K, alpha, a + (transA ? lo : lo * lda), lda, b, ldb, beta, c + lo * N, N);
    else
      sgemm(transA, transB, M, n, K, alpha, a, lda, b + (transB ? lo * ldb : lo), ldb, beta, c + lo, N);
  }
}

// C = alpha * op(A) @ op(B) + beta * C. Two bf16 operands go to the CPU's bf16 instructions where it
// has them (kernels_bf16.h: bf16_gemm_path); otherwise bf16 operands are widened into fp32
// workspace for OpenBLAS. A bf16 C is accumulated in fp32 workspace and rounded back at the end.
void matmul_cpu(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha,
                float beta, int64_t M, int64_t N, int64_t K) {
  Tensor tc;
  float* c = C.dtype == DType::F32 ? C.f32() : nullptr;
  if (!c) {
    tc = workspace(M * N);
    c = tc.f32();
    if (beta != 0.0f) widen(c, C.b16(), M * N);
  }
  const Bf16Gemm path = A.dtype == DType::BF16 && B.dtype == DType::BF16 ? bf16_gemm_path() : Bf16Gemm::Widen;
  if (K == 0) {  // BLAS needs lda >= 1; an empty sum leaves beta * C
    for (int64_t i = 0; i < M * N; i++) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
  } else if (path != Bf16Gemm::Widen) {
    bf16_gemm(path, transA, transB, M, N, K, alpha, A.b16(), A.size(-1), B.b16(), B.size(-1), beta, c);
  } else {
    Tensor ta, tb;
    const float* a = as_f32(A, ta);
    const float* b = as_f32(B, tb);
    sgemm_panels(transA, transB, M, N, K, alpha, a, A.size(-1), b, B.size(-1), beta, c);
  }
  if (tc.defined()) detail::convert_n(C.b16(), c, M * N);
}

// ===== attention ================================================================================

// The per-head products are small (S x hd, hd ~ 32): a BLAS call each would cost more in overhead
// than in arithmetic, so attention has its own register-tiled kernel on GCC vector types (one
// vfloat = one AVX-512 register). Operands are gathered into zero-padded fp32 buffers — rows and
// keys to a multiple of kPad, the head dim to a multiple of kLanes — so the kernel has no ragged
// edges: padded head columns are zeros and add exact zeros, padded keys are masked, padded query
// rows are computed and dropped.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int kMR = 8;  // rows of a register tile: 8 x 2 vectors = 16 accumulators
constexpr int64_t kPad = 16;
constexpr int64_t kQTile = 32;  // backward query rows per tile (16 and 64 measured slower)
static_assert(kPad % kMR == 0 && kPad % kLanes == 0 && kQTile % kPad == 0, "tiles must nest");

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline vfloat splat(float x) {  // not vfloat{} + x: that crashes the host front end of nvcc 13
  vfloat v = {};
  return v + x;
}

// C[kMR, NV vectors] (+)= sum_k A(r, k) B[k, :], A(r, k) = A[r*a_rs + k*a_cs]. The C tile stays in
// registers for the whole k loop: per k, NV + kMR loads feed NV * kMR FMAs. Each element of C
// sums k in order.
template <int NV>
void tile_gemm(int64_t K, const float* __restrict A, int64_t a_rs, int64_t a_cs, const float* __restrict B,
               int64_t ldb, float* __restrict C, int64_t ldc, bool accumulate) {
  vfloat acc[kMR][NV];
  for (int r = 0; r < kMR; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = accumulate ? vload(C + r * ldc + v * kLanes) : vfloat{};
  for (int64_t k = 0; k < K; k++) {
    vfloat b[NV];
    for (int v = 0; v < NV; v++) b[v] = vload(B + k * ldb + v * kLanes);
    for (int r = 0; r < kMR; r++) {
      const float a = A[r * a_rs + k * a_cs];
      for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < kMR; r++)
    for (int v = 0; v < NV; v++) vstore(C + r * ldc + v * kLanes, acc[r][v]);
}

// C[M, N] (+)= A B (A as in tile_gemm, B and C row-major) for M a multiple of kMR, N of kLanes.
void tiled_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += kMR) {
    const float* Am = A + m * a_rs;
    float* Cm = C + m * ldc;
    int64_t n = 0;
    for (; n + 2 * kLanes <= N; n += 2 * kLanes)
      tile_gemm<2>(K, Am, a_rs, a_cs, B + n, ldb, Cm + n, ldc, accumulate);
    if (n < N) tile_gemm<1>(K, Am, a_rs, a_cs, B + n, ldb, Cm + n, ldc, accumulate);
  }
}

struct AttnShape {
  int64_t B, S, H, KVH, hd;
  int64_t group() const { return H / KVH; }
  int64_t Sp() const { return round_up(S, kPad); }
  int64_t Dp() const { return round_up(hd, kLanes); }
};

// One head's slice of a [B, S, heads, hd] tensor as fp32 (times mul), zero-padded to [Sp, Dp], or
// transposed to [Dp, Sp] for the products whose output columns are keys (Q K^T, dO V^T).
template <class T>
void gather_head(float* dst, const T* src, int64_t heads, int64_t b, int64_t h, const AttnShape& a, float mul,
                 bool transpose) {
  const int64_t S = a.S, hd = a.hd, Sp = a.Sp(), Dp = a.Dp();
  if (S < Sp || hd < Dp) std::fill(dst, dst + Sp * Dp, 0.0f);  // the padding, where there is any
  for (int64_t s = 0; s < S; s++) {
    const T* row = src + ((b * S + s) * heads + h) * hd;
    for (int64_t d = 0; d < hd; d++) {
      if (transpose)
        dst[d * Sp + s] = ld(row[d]) * mul;
      else
        dst[s * Dp + d] = ld(row[d]) * mul;
    }
  }
}

// bf16 operands of the score-shaped products (Q Kᵀ, dO Vᵀ) on a CPU whose bf16 path is AVX512-BF16
// go to VDPBF16PS as they are (kernels_bf16.h, bf16_pair_products): the products are exact and sum
// in fp32, so against the widened fp32 tiles only the order of the additions differs, and the
// instruction does two multiply-adds per lane. The other five products take P or dS, fp32 here.
template <class T> bool pair_scores() {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_gemm_path() == Bf16Gemm::Avx512Bf16;
  else
    return false;
}

// One head's slice of a bf16 [B, S, heads, hd] tensor, zero-padded, as bf16 rows [Sp, Dp]
// (by_key false: bf16_pair_products' A) or by pairs of head components, each key's two values side
// by side: [Dp/2][2 Sp] (by_key true: its B).
void gather_pairs(bf16* dst, const bf16* src, int64_t heads, int64_t b, int64_t h, const AttnShape& a, bool by_key) {
  const int64_t S = a.S, hd = a.hd, Sp = a.Sp(), Dp = a.Dp();
  if (S < Sp || hd < Dp) std::fill(dst, dst + Sp * Dp, bf16{0});
  for (int64_t s = 0; s < S; s++) {
    const bf16* row = src + ((b * S + s) * heads + h) * hd;
    if (!by_key)
      std::copy(row, row + hd, dst + s * Dp);
    else
      for (int64_t d = 0; d < hd; d++) dst[(d / 2) * 2 * Sp + 2 * s + d % 2] = row[d];
  }
}

// C[rows, n] = mul · A Bᵀ for query-side rows A (Q or dO) and key-side rows B (K or V) of one
// head: fp32 register tiles on A [Sp, Dp] (mul already in it) and Bᵀ [Dp, Sp], or VDPBF16PS on
// gather_pairs' layouts, C scaled by mul after the sum.
struct ScoreOperands {
  float* a32 = nullptr;   // A [Sp, Dp], fp32, mul applied as it is gathered
  float* bt32 = nullptr;  // Bᵀ [Dp, Sp], fp32
  bf16* a16 = nullptr;    // A [Sp, Dp], bf16 (pair path)
  bf16* b16 = nullptr;    // B by pairs [Dp/2][2 Sp], bf16 (pair path)
  float mul = 1.0f;       // on the pair path, applied to C after the sum
};

// The key side (K or V of kv head h) into o's buffer.
template <class T>
void gather_key_side(const ScoreOperands& o, const T* src, int64_t heads, int64_t b, int64_t h, const AttnShape& a) {
  if constexpr (std::is_same_v<T, bf16>)
    if (o.b16) return gather_pairs(o.b16, src, heads, b, h, a, true);
  gather_head(o.bt32, src, heads, b, h, a, 1.0f, true);
}

// The query side (Q or dO of head h) into o's buffer.
template <class T>
void gather_query_side(const ScoreOperands& o, const T* src, int64_t heads, int64_t b, int64_t h, const AttnShape& a) {
  if constexpr (std::is_same_v<T, bf16>)
    if (o.a16) return gather_pairs(o.a16, src, heads, b, h, a, false);
  gather_head(o.a32, src, heads, b, h, a, o.mul, false);
}

void score_products(const ScoreOperands& o, const AttnShape& a, int64_t i0, int64_t rows, int64_t n, float* c) {
  const int64_t Sp = a.Sp(), Dp = a.Dp();
  if (!o.a16) return tiled_gemm(rows, n, Dp, o.a32 + i0 * Dp, Dp, 1, o.bt32, Sp, c, Sp, false);
  bf16_pair_products(rows, n, Dp / 2, o.a16 + i0 * Dp, Dp, o.b16, 2 * Sp, c, Sp);
  if (o.mul != 1.0f)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t j = 0; j < n; j += kLanes) vstore(c + r * Sp + j, vload(c + r * Sp + j) * o.mul);
}

// The keys a block of query rows needs. Scores are formed only for columns [0, end): end is past
// the last key visible to some row, rounded up to kPad (half the work for causal masks). Columns
// before mask_from are visible to every row of the block, so only [mask_from, end) is masked:
// the diagonal tiles for causal masks.
struct KeyRange {
  int64_t end, mask_from;
};

std::vector<KeyRange> key_ranges(const int32_t* qpos, const int32_t* kpos, const AttnShape& a, int64_t block) {
  std::vector<KeyRange> r;
  for (int64_t i0 = 0; i0 < a.S; i0 += block) {
    const int64_t i1 = std::min(a.S, i0 + block);
    const int32_t qmin = *std::min_element(qpos + i0, qpos + i1), qmax = *std::max_element(qpos + i0, qpos + i1);
    int64_t end = 0, mask_from = a.S;
    for (int64_t j = 0; j < a.S; j++) {
      if (kpos[j] <= qmax) end = j + 1;
      if (kpos[j] > qmin) mask_from = std::min(mask_from, j);
    }
    end = round_up(end, kPad);
    r.push_back({end, std::min(end, mask_from / kPad * kPad)});
  }
  return r;
}

// Scores of query rows [i0, i0 + rows) (row stride Sp) to -inf where kpos[j] > qpos[i] or j is padding.
void mask_scores(float* sc, int64_t Sp, const KeyRange& kr, const int32_t* qpos, const int32_t* kpos, int64_t i0,
                 int64_t rows, int64_t S) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows && i0 + r < S; r++) {
    const int32_t qp = qpos[i0 + r];
    float* row = sc + r * Sp;
    for (int64_t j = kr.mask_from; j < kr.end; j++)
      if (j >= S || kpos[j] > qp) row[j] = ninf;
  }
}

// exp_approx on kLanes floats at once: the same steps and constants.
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
inline vfloat exp_vec(vfloat x) {
  const vfloat lo = splat(-88.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfloat t = x * 1.44269504088896341f + 12582912.0f;
  const vint n = (vint)t - 0x4B400000;
  const vfloat fn = t - 12582912.0f;
  const vfloat r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vfloat p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * (vfloat)((n + 127) << 23);
}

// exp(row - lse) in place over n (a multiple of kLanes): the probabilities, recomputed from the
// saved statistic. A row with no visible key has lse = -inf; subtracting +inf instead makes
// that row exactly 0.
void probs_from_lse(float* row, float lse, int64_t n) {
  const float l = lse == -std::numeric_limits<float>::infinity() ? -lse : lse;
  for (int64_t j = 0; j < n; j += kLanes) vstore(row + j, exp_vec(vload(row + j) - l));
}

// Reduces t[0, W) with op as a balanced tree: log2 W dependent steps instead of W.
template <int W, class F, class Op> inline __attribute__((always_inline)) F tree_reduce(const F* t, Op op) {
  if constexpr (W == 1)
    return t[0];
  else
    return op(tree_reduce<W / 2>(t, op), tree_reduce<W / 2>(t + W / 2, op));
}

// Horizontal max and sum of a vector; the sum in double.
float lanes_max(vfloat v) {
  float t[kLanes];
  vstore(t, v);
  return tree_reduce<kLanes>(t, [](float x, float y) { return std::max(x, y); });
}

double lanes_sum(vfloat v) {
  double t[kLanes];
  for (int l = 0; l < kLanes; l++) t[l] = v[l];
  return tree_reduce<kLanes>(t, [](double x, double y) { return x + y; });
}

// exp(row - max(row)) in place for the kMR masked score rows of a block (stride Sp, n columns, a
// multiple of kLanes); sets each row's log-sum-exp and inv_sum = 1 / sum (-inf and 0 when no key
// is visible: the row is then all zeros). Each lane sums its n / kLanes terms in fp32, the lanes
// are added in double. Each pass runs over all rows so that their dependency chains overlap.
void softmax_block(float* sc, int64_t Sp, int64_t n, float* lse, float* inv_sum) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx[kMR];
  for (int r = 0; r < kMR; r++) {
    vfloat m = splat(ninf);
    for (int64_t j = 0; j < n; j += kLanes) {
      const vfloat x = vload(sc + r * Sp + j);
      m = x > m ? x : m;
    }
    mx[r] = lanes_max(m);
  }
  for (int r = 0; r < kMR; r++) {
    float* row = sc + r * Sp;
    const float m = mx[r] == ninf ? 0.0f : mx[r];  // an all -inf row: exp(-inf) = 0, sum 0
    vfloat sum{};
    for (int64_t j = 0; j < n; j += kLanes) {
      const vfloat e = exp_vec(vload(row + j) - m);
      vstore(row + j, e);
      sum += e;
    }
    const double s = lanes_sum(sum);
    inv_sum[r] = s > 0 ? float(1.0 / s) : 0.0f;
    lse[r] = s > 0 ? mx[r] + std::log(float(s)) : ninf;
  }
}

// Per (b, h): O = softmax(scale Q K^T + mask) V, lse = log sum_j exp(scale q.k_j) over visible j.
// Threads take (b, kv head) pairs, so K and V are gathered once for the heads of a GQA group.
// Each block of kMR query rows runs scores, softmax and P V back to back on an L1-resident row of
// scores (kMR x Sp), with the P V accumulators in registers across all its keys.
template <class T>
void attention_forward_cpu(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* qpos,
                           const int32_t* kpos, const AttnShape& a) {
  const int64_t S = a.S, hd = a.hd, Sp = a.Sp(), Dp = a.Dp(), per_thread = 3 * Sp * Dp + kMR * Sp + kMR * Dp;
  const float scale = 1.0f / std::sqrt(float(hd));
  const std::vector<KeyRange> ranges = key_ranges(qpos, kpos, a, kMR);
  const bool pairs = pair_scores<T>();
  Tensor ws = workspace(per_thread * omp_get_max_threads());
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < a.B * a.KVH; bg++) {
    const int64_t b = bg / a.KVH, kvh = bg % a.KVH;
    float* Kt = ws.f32() + per_thread * omp_get_thread_num();
    float *V = Kt + Sp * Dp, *Qs = V + Sp * Dp, *sc = Qs + Sp * Dp, *ob = sc + kMR * Sp;
    ScoreOperands qk{Qs, Kt, nullptr, nullptr, scale};  // Q Kᵀ; the pair path keeps bf16 in the same buffers
    if (pairs) qk = {nullptr, nullptr, reinterpret_cast<bf16*>(Qs), reinterpret_cast<bf16*>(Kt), scale};
    gather_key_side(qk, k, a.KVH, b, kvh, a);
    gather_head(V, v, a.KVH, b, kvh, a, 1.0f, false);
    for (int64_t h = kvh * a.group(); h < (kvh + 1) * a.group(); h++) {
      gather_query_side(qk, q, a.H, b, h, a);
      for (int64_t i0 = 0; i0 < S; i0 += kMR) {
        const KeyRange& kr = ranges[i0 / kMR];
        const int64_t rows = std::min<int64_t>(kMR, S - i0);
        score_products(qk, a, i0, kMR, kr.end, sc);
        mask_scores(sc, Sp, kr, qpos, kpos, i0, rows, S);
        float lse_b[kMR], inv_sum[kMR];
        softmax_block(sc, Sp, kr.end, lse_b, inv_sum);
        std::copy(lse_b, lse_b + rows, lse + (b * a.H + h) * S + i0);
        tiled_gemm(kMR, Dp, kr.end, sc, Sp, 1, V, Dp, ob, Dp, false);  // padded rows: garbage, dropped
        for (int64_t r = 0; r < rows; r++) {  // O = (exp(S - max) V) / sum: normalised once, at the end
          T* o = out + ((b * S + i0 + r) * a.H + h) * hd;
          for (int64_t d = 0; d < hd; d++) o[d] = st<T>(ob[r * Dp + d] * inv_sum[r]);
        }
      }
    }
  }
}

// Per (b, h), from P = exp(S - lse): dP = dO V^T, dS = P (dP - rowsum(dO * O)),
// dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. Threads take (b, kv head) pairs and run the
// group's heads in order, summing their dK, dV in fp32 buffers: the GQA sum in a fixed order.
// Per tile of kQTile query rows, P and dS (kQTile x Sp) are formed once and feed all three
// products; dK, dV accumulate over the tile's rows with their tiles in registers.
template <class T>
void attention_backward_cpu(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q,
                            const T* k, const T* v, const int32_t* qpos, const int32_t* kpos, const AttnShape& a) {
  const int64_t S = a.S, hd = a.hd, Sp = a.Sp(), Dp = a.Dp();
  const int64_t per_thread = 7 * Sp * Dp + Sp + 2 * kQTile * Sp + kQTile * Dp;
  const float scale = 1.0f / std::sqrt(float(hd));
  const std::vector<KeyRange> ranges = key_ranges(qpos, kpos, a, kQTile);
  const bool pairs = pair_scores<T>();
  Tensor ws = workspace(per_thread * omp_get_max_threads());
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < a.B * a.KVH; bg++) {
    const int64_t b = bg / a.KVH, kvh = bg % a.KVH;
    float* K = ws.f32() + per_thread * omp_get_thread_num();
    float *Kt = K + Sp * Dp, *Vt = Kt + Sp * Dp, *dK = Vt + Sp * Dp, *dV = dK + Sp * Dp, *Qs = dV + Sp * Dp;
    float *dO = Qs + Sp * Dp, *Drow = dO + Sp * Dp, *P = Drow + Sp, *dS = P + kQTile * Sp, *dQt = dS + kQTile * Sp;
    // Q Kᵀ and dO Vᵀ; the pair path keeps bf16 K, Q in Kt's buffer and V, dO in Vt's (half each).
    ScoreOperands qk{Qs, Kt, nullptr, nullptr, scale}, dov{dO, Vt, nullptr, nullptr, 1.0f};
    if (pairs) {
      bf16 *kt = reinterpret_cast<bf16*>(Kt), *vt = reinterpret_cast<bf16*>(Vt);
      qk = {nullptr, nullptr, kt + Sp * Dp, kt, scale};
      dov = {nullptr, nullptr, vt + Sp * Dp, vt, 1.0f};
    }
    gather_head(K, k, a.KVH, b, kvh, a, 1.0f, false);
    gather_key_side(qk, k, a.KVH, b, kvh, a);
    gather_key_side(dov, v, a.KVH, b, kvh, a);
    std::fill(dK, dK + 2 * Sp * Dp, 0.0f);  // dK and dV
    for (int64_t h = kvh * a.group(); h < (kvh + 1) * a.group(); h++) {
      const float* lse_h = lse + (b * a.H + h) * S;
      gather_head(Qs, q, a.H, b, h, a, scale, false);  // scale Q and dO as fp32 for dK, dV and D
      gather_head(dO, dout, a.H, b, h, a, 1.0f, false);
      if (pairs) {  // and as bf16 for the two score products
        gather_query_side(qk, q, a.H, b, h, a);
        gather_query_side(dov, dout, a.H, b, h, a);
      }
      std::fill(Drow, Drow + Sp, 0.0f);
      for (int64_t i = 0; i < S; i++) {  // D_i = rowsum(dO * O), the softmax-backward correction
        const T* o = out + ((b * S + i) * a.H + h) * hd;
        double dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; d++) dot += double(dO[i * Dp + d]) * ld(o[d]);
        Drow[i] = float(dot);
      }
      for (int64_t i0 = 0; i0 < S; i0 += kQTile) {
        const KeyRange& kr = ranges[i0 / kQTile];
        const int64_t rows = std::min(kQTile, Sp - i0), n = kr.end;
        score_products(qk, a, i0, rows, n, P);
        mask_scores(P, Sp, kr, qpos, kpos, i0, rows, S);
        for (int64_t r = 0; r < rows; r++)  // padded rows get lse -inf: P = 0
          probs_from_lse(P + r * Sp, i0 + r < S ? lse_h[i0 + r] : -std::numeric_limits<float>::infinity(), n);
        score_products(dov, a, i0, rows, n, dS);  // dP
        for (int64_t r = 0; r < rows; r++) {
          const float* p = P + r * Sp;
          float* ds = dS + r * Sp;
          const float Di = Drow[i0 + r];
          for (int64_t j = 0; j < n; j += kLanes) vstore(ds + j, vload(p + j) * (vload(ds + j) - Di));
        }
        tiled_gemm(rows, Dp, n, dS, Sp, 1, K, Dp, dQt, Dp, false);
        tiled_gemm(n, Dp, rows, dS, 1, Sp, Qs + i0 * Dp, Dp, dK, Dp, true);
        tiled_gemm(n, Dp, rows, P, 1, Sp, dO + i0 * Dp, Dp, dV, Dp, true);
        for (int64_t r = 0; r < rows && i0 + r < S; r++) {
          T* o = dq + ((b * S + i0 + r) * a.H + h) * hd;
          for (int64_t d = 0; d < hd; d++) o[d] = st<T>(dQt[r * Dp + d] * scale);
        }
      }
    }
    for (int64_t s = 0; s < S; s++) {
      T* dko = dk + ((b * S + s) * a.KVH + kvh) * hd;
      T* dvo = dv + ((b * S + s) * a.KVH + kvh) * hd;
      for (int64_t d = 0; d < hd; d++) {
        dko[d] = st<T>(dK[s * Dp + d]);
        dvo[d] = st<T>(dV[s * Dp + d]);
      }
    }
  }
}

// ===== cross-entropy ============================================================================

// loss = logsumexp(x) - x[t] with the row max subtracted; dlogits = (softmax(x) - onehot(t)) * scale,
// written over the row after it has been read (dlogits may alias logits; dl null: loss only).
template <class T>
void cross_entropy_cpu(float* losses, T* dl, const T* logits, const int32_t* tgt, float grad_scale, int64_t N,
                       int64_t V) {
  detail::for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    const int64_t t = tgt[n];
    const float mx = detail::row_max(x, V), xt = x[t];
    const double sum = detail::exp_sum(x, x, mx, V);  // x now holds exp(x - mx)
    losses[n] = detail::ce_loss(mx, sum, xt);
    if (dl) detail::ce_grad_row(dl + n * V, x, float(1.0 / sum), t, grad_scale, V);
  });
}

// The vocabulary-parallel steps: the same row passes on a block of V columns whose first is
// vocabulary row vs, split where the caller's all-reduces go (kernels.h, vocab_ce_*).
template <class T> void vocab_ce_max_cpu(float* mx, const T* logits, int64_t N, int64_t V) {
  detail::for_rows_f32(logits, N, V, [&](int64_t n, float* x) { mx[n] = detail::row_max(x, V); });
}

template <class T>
void vocab_ce_stats_cpu(float* stats, const T* logits, const float* mx, const int32_t* tgt, int64_t vs, int64_t N,
                        int64_t V) {
  detail::for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    const int64_t t = tgt[n] - vs;
    stats[N + n] = t >= 0 && t < V ? x[t] : 0.0f;  // exact through the sum: every other rank adds 0
    stats[n] = float(detail::exp_sum(x, x, mx[n], V));
  });
}

template <class T>
void vocab_ce_finish_cpu(float* losses, T* dl, const T* logits, const float* mx, const float* stats,
                         const int32_t* tgt, int64_t vs, float grad_scale, int64_t N, int64_t V) {
  detail::for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    losses[n] = detail::ce_loss(mx[n], stats[n], stats[N + n]);
    if (!dl) return;
    detail::exp_shifted(x, x, mx[n], V);
    detail::ce_grad_row(dl + n * V, x, float(1.0 / double(stats[n])), tgt[n] - vs, grad_scale, V);
  });
}

// ===== sum of squares ===========================================================================

// Fixed chunks (not per thread) summed in chunk order: the same double for any thread count.
double sum_squares_cpu(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(nchunks);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; c++) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; i++) s += double(x[i]) * x[i];
    part[c] = s;
  }
  double total = 0;
  for (double s : part) total += s;
  return total;
}

}  // namespace

// ===== the ops over tensors =====================================================================

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start) {
  by_dtype(dout.dtype, [&](auto t) {
    embedding_backward_cpu(dtable.f32(), dout.data<decltype(t)>(), tokens.i32(), tokens.numel(), dtable.size(0),
                           dtable.size(1), vocab_start);
  });
}

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_forward_cpu(y.data<T>(), rstd.f32(), x.data<T>(), w.f32(), eps, rstd.numel(), w.numel());
  });
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_backward_cpu(dx.data<T>(), dw.f32(), dy.data<T>(), x.data<T>(), w.f32(), rstd.f32(), rstd.numel(),
                         w.numel());
  });
}

void rope_forward(const Tensor& x, const Tensor& pos, float theta) {
  by_dtype(x.dtype, [&](auto t) {
    rope_cpu(x.data<decltype(t)>(), pos.i32(), theta, 1.0f, x.size(0), x.size(1), x.size(2), x.size(3));
  });
}

void rope_backward(const Tensor& dx, const Tensor& pos, float theta) {
  by_dtype(dx.dtype, [&](auto t) {
    rope_cpu(dx.data<decltype(t)>(), pos.i32(), theta, -1.0f, dx.size(0), dx.size(1), dx.size(2), dx.size(3));
  });
}

void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta) {
  const auto [M, N, K] = detail::matmul_dims(C, A, transA);
  matmul_cpu(C, A, transA, B, transB, alpha, beta, M, N, K);
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& qpos, const Tensor& kpos) {
  const AttnShape a{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_forward_cpu(out.data<T>(), lse.f32(), q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(),
                          a);
  });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                        const Tensor& kpos) {
  const AttnShape a{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_backward_cpu(dq.data<T>(), dk.data<T>(), dv.data<T>(), dout.data<T>(), out.data<T>(), lse.f32(),
                           q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(), a);
  });
}

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale) {
  const int64_t V = logits.size(-1);
  by_dtype(logits.dtype, [&](auto t) {
    using T = decltype(t);
    cross_entropy_cpu(losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(),
                      targets.i32(), grad_scale, losses.numel(), V);
  });
}

void vocab_ce_max(const Tensor& max, const Tensor& logits) {
  const int64_t V = logits.size(-1);
  by_dtype(logits.dtype, [&](auto t) { vocab_ce_max_cpu(max.f32(), logits.data<decltype(t)>(), max.numel(), V); });
}

void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets,
                    int64_t vocab_start) {
  const int64_t V = logits.size(-1);
  by_dtype(logits.dtype, [&](auto t) {
    vocab_ce_stats_cpu(stats.f32(), logits.data<decltype(t)>(), max.f32(), targets.i32(), vocab_start, max.numel(), V);
  });
}

void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max,
                     const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale) {
  const int64_t V = logits.size(-1);
  by_dtype(logits.dtype, [&](auto t) {
    using T = decltype(t);
    vocab_ce_finish_cpu(losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(), max.f32(),
                        stats.f32(), targets.i32(), vocab_start, grad_scale, max.numel(), V);
  });
}

double sum_squares(const Tensor& x) { return sum_squares_cpu(x.f32(), x.numel()); }

}  // namespace cpu
}  // namespace ts
