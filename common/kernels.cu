// kernels.cu — the CPU implementation of every op in kernels.h, and the dispatch to the CUDA
// twins in kernels_cuda.cu.
//
// Each op is a readable reference templated on the activation storage type T (float or bf16,
// loaded with ld() and stored with st<T>()), accumulating in fp32 (double where it costs little),
// followed by the public function that validates its arguments and dispatches on the device.
// Threads split work by rows or heads with static schedules; every reduction that crosses rows
// runs in a fixed order, so results are bitwise identical for any OMP_NUM_THREADS.
#include "kernels.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>

#include "rng.h"
#include "trace.h"
#ifdef TS_CUDA
#include "kernels_cuda.h"
#endif

namespace ts {
namespace {

// ===== argument checks ==========================================================================

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); i++) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

void check_defined(const char* op, const char* name, const Tensor& t) {
  TS_CHECK(t.defined(), "%s: %s is an undefined tensor", op, name);
}

void check_shape(const char* op, const char* name, const Tensor& t, const std::vector<int64_t>& shape) {
  check_defined(op, name, t);
  TS_CHECK(t.shape == shape, "%s: %s must have shape %s, got %s", op, name, shape_str(shape).c_str(),
           t.str().c_str());
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType dt) {
  check_defined(op, name, t);
  TS_CHECK(t.dtype == dt, "%s: %s must be %s, got %s", op, name, dtype_name(dt), t.str().c_str());
}

// Activations: fp32 or bf16.
void check_float(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  TS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16, "%s: %s must be f32 or bf16, got %s", op, name,
           t.str().c_str());
}

void check_same_dtype(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  TS_CHECK(a.dtype == b.dtype, "%s: %s and %s must have the same dtype, got %s and %s", op, an, bn,
           a.str().c_str(), b.str().c_str());
}

// Every defined tensor of one call lives on one device; returns it.
Device common_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) first = t;
    TS_CHECK(t->device() == first->device(), "%s: tensors on different devices (%s and %s)", op,
             first->str().c_str(), t->str().c_str());
  }
  return first ? first->device() : Device::CPU;
}

// Runs f(T{}) for the activation dtype, so one templated reference serves fp32 and bf16.
template <class F> void by_dtype(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(bf16{});
}

Tensor workspace(int64_t n) { return Tensor::empty({n}, DType::F32, Device::CPU, Tag::Workspace); }

// ===== shared numerics ==========================================================================

// exp(x) in plain float arithmetic (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial,
// ~1 ulp) so that softmax loops vectorise. x below about -87.7 (results under FLT_MIN) gives 0,
// so exp(-inf) = 0; x is clamped at 88 above.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -88.0f), 88.0f);
  float t = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds x*log2(e) to an integer
  int32_t n = int32_t(float_bits(t) - 0x4B400000u);
  float fn = t - 12582912.0f;
  float r = x - fn * 0.693359375f + fn * 2.12194440e-4f;  // ln2 split in two for an exact product
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_float(uint32_t(n + 127) << 23);
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

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

// ===== elementwise ==============================================================================

template <class T> void add_cpu(T* y, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = st<T>(ld(a[i]) + ld(b[i]));
}

template <class T> void scale_cpu(T* y, float s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = st<T>(ld(y[i]) * s);
}

template <class D, class S> void convert_cpu(D* dst, const S* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) dst[i] = st<D>(ld(src[i]));
}

template <class T> void fill_cpu(T* y, float value, int64_t n) {
  const T v = st<T>(value);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = v;
}

// ===== embedding ================================================================================

template <class T>
void embedding_forward_cpu(T* out, const T* table, const int32_t* tok, int64_t N, int64_t V, int64_t D,
                           int64_t vocab_start) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const int64_t row = int64_t(tok[n]) - vocab_start;
    T* o = out + n * D;
    if (row < 0 || row >= V) {
      std::fill(o, o + D, st<T>(0.0f));  // owned by another vocab shard
      continue;
    }
    std::copy(table + row * D, table + (row + 1) * D, o);
  }
}

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

// A matrix view of a tensor: rows = numel / last dim, cols = last dim ([B, S, D] -> [B*S, D]).
struct Mat {
  int64_t rows, cols;
};
Mat as_matrix(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  TS_CHECK(t.dim() >= 2, "%s: %s must have at least 2 dimensions, got %s", op, name, t.str().c_str());
  const int64_t cols = t.size(-1);
  return {cols ? t.numel() / cols : 0, cols};
}

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

// C = alpha * op(A) @ op(B) + beta * C through OpenBLAS; bf16 operands are widened into fp32
// workspace first and a bf16 C is rounded back at the end.
void matmul_cpu(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha,
                float beta, int64_t M, int64_t N, int64_t K) {
  Tensor ta, tb, tc;
  const float* a = as_f32(A, ta);
  const float* b = as_f32(B, tb);
  float* c = C.dtype == DType::F32 ? C.f32() : nullptr;
  if (!c) {
    tc = workspace(M * N);
    c = tc.f32();
    if (beta != 0.0f) widen(c, C.b16(), M * N);
  }
  if (K == 0) {  // BLAS needs lda >= 1; an empty sum leaves beta * C
    for (int64_t i = 0; i < M * N; i++) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
  } else {
    sgemm_panels(transA, transB, M, N, K, alpha, a, A.size(-1), b, B.size(-1), beta, c);
  }
  if (tc.defined()) convert_cpu(C.b16(), c, M * N);
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
  std::fill(dst, dst + Sp * Dp, 0.0f);
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

// The max, exp and sum passes of a softmax row. Three plain loops: fused into one, the compiler
// no longer vectorises them (~4x slower).
float row_max(const float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; j++) mx = mx > row[j] ? mx : row[j];
  return mx;
}

void exp_shifted(float* e, const float* row, float mx, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; j++) e[j] = exp_approx(row[j] - mx);
}

double exp_sum(float* e, const float* row, float mx, int64_t n) {
  exp_shifted(e, row, mx, n);
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += e[j];
  return sum;
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
  Tensor ws = workspace(per_thread * omp_get_max_threads());
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < a.B * a.KVH; bg++) {
    const int64_t b = bg / a.KVH, kvh = bg % a.KVH;
    float* Kt = ws.f32() + per_thread * omp_get_thread_num();
    float *V = Kt + Sp * Dp, *Qs = V + Sp * Dp, *sc = Qs + Sp * Dp, *ob = sc + kMR * Sp;
    gather_head(Kt, k, a.KVH, b, kvh, a, 1.0f, true);
    gather_head(V, v, a.KVH, b, kvh, a, 1.0f, false);
    for (int64_t h = kvh * a.group(); h < (kvh + 1) * a.group(); h++) {
      gather_head(Qs, q, a.H, b, h, a, scale, false);
      for (int64_t i0 = 0; i0 < S; i0 += kMR) {
        const KeyRange& kr = ranges[i0 / kMR];
        const int64_t rows = std::min<int64_t>(kMR, S - i0);
        tiled_gemm(kMR, kr.end, Dp, Qs + i0 * Dp, Dp, 1, Kt, Sp, sc, Sp, false);
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
  Tensor ws = workspace(per_thread * omp_get_max_threads());
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < a.B * a.KVH; bg++) {
    const int64_t b = bg / a.KVH, kvh = bg % a.KVH;
    float* K = ws.f32() + per_thread * omp_get_thread_num();
    float *Kt = K + Sp * Dp, *Vt = Kt + Sp * Dp, *dK = Vt + Sp * Dp, *dV = dK + Sp * Dp, *Qs = dV + Sp * Dp;
    float *dO = Qs + Sp * Dp, *Drow = dO + Sp * Dp, *P = Drow + Sp, *dS = P + kQTile * Sp, *dQt = dS + kQTile * Sp;
    gather_head(K, k, a.KVH, b, kvh, a, 1.0f, false);
    gather_head(Kt, k, a.KVH, b, kvh, a, 1.0f, true);
    gather_head(Vt, v, a.KVH, b, kvh, a, 1.0f, true);
    std::fill(dK, dK + 2 * Sp * Dp, 0.0f);  // dK and dV
    for (int64_t h = kvh * a.group(); h < (kvh + 1) * a.group(); h++) {
      const float* lse_h = lse + (b * a.H + h) * S;
      gather_head(Qs, q, a.H, b, h, a, scale, false);
      gather_head(dO, dout, a.H, b, h, a, 1.0f, false);
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
        tiled_gemm(rows, n, Dp, Qs + i0 * Dp, Dp, 1, Kt, Sp, P, Sp, false);
        mask_scores(P, Sp, kr, qpos, kpos, i0, rows, S);
        for (int64_t r = 0; r < rows; r++)  // padded rows get lse -inf: P = 0
          probs_from_lse(P + r * Sp, i0 + r < S ? lse_h[i0 + r] : -std::numeric_limits<float>::infinity(), n);
        tiled_gemm(rows, n, Dp, dO + i0 * Dp, Dp, 1, Vt, Sp, dS, Sp, false);  // dP
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

// ===== SwiGLU ===================================================================================

// h = silu(g) * u, silu(g) = g * sigmoid(g).
template <class T> void swiglu_forward_cpu(T* h, const T* g, const T* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float gi = ld(g[i]);
    h[i] = st<T>(gi * sigmoid(gi) * ld(u[i]));
  }
}

// dg = dh * u * silu'(g), silu'(g) = sig(g) * (1 + g * (1 - sig(g))); du = dh * silu(g).
template <class T> void swiglu_backward_cpu(T* dg, T* du, const T* dh, const T* g, const T* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float gi = ld(g[i]), sg = sigmoid(gi), d = ld(dh[i]);
    dg[i] = st<T>(d * ld(u[i]) * sg * (1.0f + gi * (1.0f - sg)));
    du[i] = st<T>(d * gi * sg);
  }
}

// ===== cross-entropy ============================================================================

// Runs f(n, x) for every row n of logits [N, V], x the row widened to fp32 in a per-thread buffer
// that f may overwrite; rows are split over the threads.
template <class T, class F> void for_rows_f32(const T* logits, int64_t N, int64_t V, F&& f) {
#pragma omp parallel
  {
    std::vector<float> x(V);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const T* xr = logits + n * V;
      for (int64_t j = 0; j < V; j++) x[j] = ld(xr[j]);
      f(n, x.data());
    }
  }
}

// logsumexp - x[t] from the max and the sum of exp(x - max), in double.
inline float ce_loss(float mx, double sum, float xt) { return float(double(mx) + std::log(sum) - double(xt)); }

// A row of dlogits = (softmax - onehot(t)) * scale from e = exp(x - max) and inv = 1 / sum; t may
// lie outside [0, V) (another rank owns the target).
template <class T> void ce_grad_row(T* d, const float* e, float inv, int64_t t, float scale, int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < V; j++) d[j] = st<T>((e[j] * inv - float(j == t)) * scale);
}

// loss = logsumexp(x) - x[t] with the row max subtracted; dlogits = (softmax(x) - onehot(t)) * scale,
// written over the row after it has been read (dlogits may alias logits; dl null: loss only).
template <class T>
void cross_entropy_cpu(float* losses, T* dl, const T* logits, const int32_t* tgt, float grad_scale, int64_t N,
                       int64_t V) {
  for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    const int64_t t = tgt[n];
    const float mx = row_max(x, V), xt = x[t];
    const double sum = exp_sum(x, x, mx, V);  // x now holds exp(x - mx)
    losses[n] = ce_loss(mx, sum, xt);
    if (dl) ce_grad_row(dl + n * V, x, float(1.0 / sum), t, grad_scale, V);
  });
}

// The vocabulary-parallel steps on a local block [N, V] whose first column is vocabulary row vs.
template <class T> void vocab_ce_max_cpu(float* mx, const T* logits, int64_t N, int64_t V) {
  for_rows_f32(logits, N, V, [&](int64_t n, float* x) { mx[n] = row_max(x, V); });
}

template <class T>
void vocab_ce_stats_cpu(float* stats, const T* logits, const float* mx, const int32_t* tgt, int64_t vs, int64_t N,
                        int64_t V) {
  for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    const int64_t t = tgt[n] - vs;
    stats[N + n] = t >= 0 && t < V ? x[t] : 0.0f;  // exact through the sum: every other rank adds 0
    stats[n] = float(exp_sum(x, x, mx[n], V));
  });
}

template <class T>
void vocab_ce_finish_cpu(float* losses, T* dl, const T* logits, const float* mx, const float* stats,
                         const int32_t* tgt, int64_t vs, float grad_scale, int64_t N, int64_t V) {
  for_rows_f32(logits, N, V, [&](int64_t n, float* x) {
    losses[n] = ce_loss(mx[n], stats[n], stats[N + n]);
    if (!dl) return;
    exp_shifted(x, x, mx[n], V);
    ce_grad_row(dl + n * V, x, float(1.0 / double(stats[n])), tgt[n] - vs, grad_scale, V);
  });
}

// ===== optimizer and norms ======================================================================

// AdamW (Loshchilov & Hutter): m, v moments with bias correction 1 - beta^step, decoupled decay.
void adamw_cpu(float* p, const float* grad, float* m, float* v, const AdamWParams& hp, bool decay,
               float grad_scale, const Tensor& param_copy, int64_t n) {
  const float bc1 = float(1.0 - std::pow(double(hp.beta1), double(hp.step)));
  const float bc2 = float(1.0 - std::pow(double(hp.beta2), double(hp.step)));
  const float wd = decay ? hp.weight_decay : 0.0f, b1 = hp.beta1, b2 = hp.beta2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= hp.lr * (mhat / (std::sqrt(vhat) + hp.eps) + wd * p[i]);
  }
  if (param_copy.defined())  // the compute copy of the weights, rounded once from the master
    by_dtype(param_copy.dtype, [&](auto t) { convert_cpu(param_copy.data<decltype(t)>(), p, n); });
}

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

// ===== counter-based init =======================================================================

// Element (r, c) of the slice is element (row0 + r, col0 + c) of the global matrix: its value
// depends on that global index only, so any sharding reproduces the full tensor's slice.
void init_normal_cpu(float* t, uint64_t key, float stdev, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                     int64_t global_cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++)
      t[r * cols + c] = stdev * rng_normal(key, uint64_t((row0 + r) * global_cols + col0 + c));
}

// The leading dimensions of a [..., D] tensor flattened: its row count.
int64_t rows_of(const char* op, const char* name, const Tensor& t, int64_t D) {
  check_defined(op, name, t);
  TS_CHECK(t.dim() >= 1 && t.size(-1) == D, "%s: %s must be [..., %lld], got %s", op, name, (long long)D,
           t.str().c_str());
  return D ? t.numel() / D : 0;
}

void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* refname) {
  check_defined(op, name, t);
  TS_CHECK(t.shape == ref.shape && t.dtype == ref.dtype, "%s: %s must match %s (%s), got %s", op, name, refname,
           ref.str().c_str(), t.str().c_str());
}

void check_numel(const char* op, const char* name, const Tensor& t, int64_t n, DType dt) {
  check_dtype(op, name, t, dt);
  TS_CHECK(t.numel() == n, "%s: %s must have %lld elements, got %s", op, name, (long long)n, t.str().c_str());
}

// The arguments the vocab_ce steps share: logits [N, Vl] (T) and max [N] fp32, then for steps 2
// and 3 (stats defined) stats [2, N] fp32 and targets int32 [N]. Returns N and sets Vl.
int64_t check_vocab_ce(const char* op, const Tensor& logits, const Tensor& max, const Tensor& stats,
                       const Tensor& targets, int64_t& Vl) {
  check_float(op, "logits", logits);
  TS_CHECK(logits.dim() >= 1, "%s: logits must be [N, Vl], got %s", op, logits.str().c_str());
  Vl = logits.size(-1);
  const int64_t N = rows_of(op, "logits", logits, Vl);
  check_numel(op, "max", max, N, DType::F32);
  if (!stats.defined()) return N;
  check_dtype(op, "stats", stats, DType::F32);
  check_shape(op, "stats", stats, {2, N});
  check_numel(op, "targets", targets, N, DType::I32);
  return N;
}

}  // namespace

// A CUDA tensor reaches the CUDA twin; in a CPU-only build no CUDA tensor can exist.
#ifdef TS_CUDA
#define CUDA_TWIN(call) cuda::call
#else
#define CUDA_TWIN(call) fatal("CUDA tensor in a CPU-only build")
#endif

// ===== public ops ===============================================================================

void add(const Tensor& y, const Tensor& a, const Tensor& b) {
  TS_PROFILE_OP("add", y);
  check_float("add", "y", y);
  check_like("add", "a", a, y, "y");
  check_like("add", "b", b, y, "y");
  if (common_device("add", {&y, &a, &b}) == Device::CUDA) return CUDA_TWIN(add(y, a, b));
  by_dtype(y.dtype, [&](auto t) {
    using T = decltype(t);
    add_cpu(y.data<T>(), a.data<T>(), b.data<T>(), y.numel());
  });
}

void add_inplace(const Tensor& y, const Tensor& x) {
  TS_PROFILE_OP("add_inplace", y);
  check_float("add_inplace", "y", y);
  check_like("add_inplace", "x", x, y, "y");
  if (common_device("add_inplace", {&y, &x}) == Device::CUDA) return CUDA_TWIN(add_inplace(y, x));
  by_dtype(y.dtype, [&](auto t) {
    using T = decltype(t);
    add_cpu(y.data<T>(), y.data<T>(), x.data<T>(), y.numel());
  });
}

void scale_inplace(const Tensor& y, float s) {
  TS_PROFILE_OP("scale_inplace", y);
  check_float("scale_inplace", "y", y);
  if (y.device() == Device::CUDA) return CUDA_TWIN(scale_inplace(y, s));
  by_dtype(y.dtype, [&](auto t) {
    using T = decltype(t);
    scale_cpu(y.data<T>(), s, y.numel());
  });
}

void convert(const Tensor& dst, const Tensor& src) {
  TS_PROFILE_OP("convert", dst);
  check_float("convert", "dst", dst);
  check_float("convert", "src", src);
  TS_CHECK(dst.numel() == src.numel(), "convert: %s <- %s: element counts differ", dst.str().c_str(),
           src.str().c_str());
  if (common_device("convert", {&dst, &src}) == Device::CUDA) return CUDA_TWIN(convert(dst, src));
  by_dtype(dst.dtype, [&](auto dt) {
    by_dtype(src.dtype, [&](auto s) {
      convert_cpu(dst.data<decltype(dt)>(), src.data<decltype(s)>(), dst.numel());
    });
  });
}

void fill(const Tensor& t, float value) {
  TS_PROFILE_OP("fill", t);
  check_float("fill", "t", t);
  if (t.device() == Device::CUDA) return CUDA_TWIN(fill(t, value));
  by_dtype(t.dtype, [&](auto tag) { fill_cpu(t.data<decltype(tag)>(), value, t.numel()); });
}

void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start) {
  TS_PROFILE_OP("embedding_forward", out);
  const char* op = "embedding_forward";
  check_float(op, "table", table);
  TS_CHECK(table.dim() == 2, "%s: table must be [V, D], got %s", op, table.str().c_str());
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t V = table.size(0), D = table.size(1), N = tokens.numel();
  TS_CHECK(rows_of(op, "out", out, D) == N, "%s: out %s must hold one row per token (%lld tokens)", op,
           out.str().c_str(), (long long)N);
  check_same_dtype(op, out, "out", table, "table");
  if (common_device(op, {&out, &table, &tokens}) == Device::CUDA)
    return CUDA_TWIN(embedding_forward(out, table, tokens, vocab_start));
  by_dtype(table.dtype, [&](auto t) {
    using T = decltype(t);
    embedding_forward_cpu(out.data<T>(), table.data<T>(), tokens.i32(), N, V, D, vocab_start);
  });
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start) {
  TS_PROFILE_OP("embedding_backward", dtable);
  const char* op = "embedding_backward";
  check_dtype(op, "dtable", dtable, DType::F32);
  TS_CHECK(dtable.dim() == 2, "%s: dtable must be [V, D], got %s", op, dtable.str().c_str());
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t V = dtable.size(0), D = dtable.size(1), N = tokens.numel();
  check_float(op, "dout", dout);
  TS_CHECK(rows_of(op, "dout", dout, D) == N, "%s: dout %s must hold one row per token (%lld tokens)", op,
           dout.str().c_str(), (long long)N);
  if (common_device(op, {&dtable, &dout, &tokens}) == Device::CUDA)
    return CUDA_TWIN(embedding_backward(dtable, dout, tokens, vocab_start));
  by_dtype(dout.dtype, [&](auto t) {
    using T = decltype(t);
    embedding_backward_cpu(dtable.f32(), dout.data<T>(), tokens.i32(), N, V, D, vocab_start);
  });
}

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  TS_PROFILE_OP("rmsnorm_forward", y);
  const char* op = "rmsnorm_forward";
  check_float(op, "x", x);
  check_dtype(op, "w", w, DType::F32);
  TS_CHECK(w.dim() == 1, "%s: w must be [D], got %s", op, w.str().c_str());
  const int64_t D = w.size(0), N = rows_of(op, "x", x, D);
  check_like(op, "y", y, x, "x");
  check_numel(op, "rstd", rstd, N, DType::F32);
  if (common_device(op, {&y, &rstd, &x, &w}) == Device::CUDA) return CUDA_TWIN(rmsnorm_forward(y, rstd, x, w, eps));
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_forward_cpu(y.data<T>(), rstd.f32(), x.data<T>(), w.f32(), eps, N, D);
  });
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  TS_PROFILE_OP("rmsnorm_backward", dx);
  const char* op = "rmsnorm_backward";
  check_float(op, "x", x);
  check_dtype(op, "w", w, DType::F32);
  TS_CHECK(w.dim() == 1, "%s: w must be [D], got %s", op, w.str().c_str());
  const int64_t D = w.size(0), N = rows_of(op, "x", x, D);
  check_like(op, "dx", dx, x, "x");
  check_like(op, "dy", dy, x, "x");
  check_shape(op, "dw", dw, w.shape);
  check_dtype(op, "dw", dw, DType::F32);
  check_numel(op, "rstd", rstd, N, DType::F32);
  if (common_device(op, {&dx, &dw, &dy, &x, &w, &rstd}) == Device::CUDA)
    return CUDA_TWIN(rmsnorm_backward(dx, dw, dy, x, w, rstd));
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_backward_cpu(dx.data<T>(), dw.f32(), dy.data<T>(), x.data<T>(), w.f32(), rstd.f32(), N, D);
  });
}

namespace {
void check_rope(const char* op, const Tensor& x, const Tensor& pos) {
  check_float(op, "x", x);
  TS_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "%s: x must be [B, S, H, hd] with even hd, got %s", op,
           x.str().c_str());
  check_shape(op, "pos", pos, {x.size(1)});
  check_dtype(op, "pos", pos, DType::I32);
}
}  // namespace

void rope_forward(const Tensor& x, const Tensor& pos, float theta) {
  TS_PROFILE_OP("rope_forward", x);
  check_rope("rope_forward", x, pos);
  if (common_device("rope_forward", {&x, &pos}) == Device::CUDA) return CUDA_TWIN(rope_forward(x, pos, theta));
  by_dtype(x.dtype, [&](auto t) {
    rope_cpu(x.data<decltype(t)>(), pos.i32(), theta, 1.0f, x.size(0), x.size(1), x.size(2), x.size(3));
  });
}

void rope_backward(const Tensor& dx, const Tensor& pos, float theta) {
  TS_PROFILE_OP("rope_backward", dx);
  check_rope("rope_backward", dx, pos);
  if (common_device("rope_backward", {&dx, &pos}) == Device::CUDA) return CUDA_TWIN(rope_backward(dx, pos, theta));
  by_dtype(dx.dtype, [&](auto t) {
    rope_cpu(dx.data<decltype(t)>(), pos.i32(), theta, -1.0f, dx.size(0), dx.size(1), dx.size(2), dx.size(3));
  });
}

void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta) {
  TS_PROFILE_OP("matmul", C);
  const char* op = "matmul";
  check_float(op, "A", A);
  check_same_dtype(op, A, "A", B, "B");
  check_float(op, "C", C);
  TS_CHECK(C.dtype == DType::F32 || C.dtype == A.dtype, "%s: C must be f32 or %s, got %s", op,
           dtype_name(A.dtype), C.str().c_str());
  const Mat a = as_matrix(op, "A", A), b = as_matrix(op, "B", B), c = as_matrix(op, "C", C);
  const int64_t M = transA ? a.cols : a.rows, K = transA ? a.rows : a.cols;
  const int64_t Kb = transB ? b.cols : b.rows, N = transB ? b.rows : b.cols;
  TS_CHECK(K == Kb && c.rows == M && c.cols == N,
           "%s: shapes do not compose: C %s = op(A) %s%s @ op(B) %s%s (as [M, K] @ [K, N] = [%lld, %lld] @ "
           "[%lld, %lld])",
           op, C.str().c_str(), A.str().c_str(), transA ? "^T" : "", B.str().c_str(), transB ? "^T" : "",
           (long long)M, (long long)K, (long long)Kb, (long long)N);
  if (common_device(op, {&C, &A, &B}) == Device::CUDA) return CUDA_TWIN(matmul(C, A, transA, B, transB, alpha, beta));
  matmul_cpu(C, A, transA, B, transB, alpha, beta, M, N, K);
}

void linear_forward(const Tensor& y, const Tensor& x, const Tensor& W) {
  TS_PROFILE_OP("linear_forward", x);
  matmul(y, x, false, W, true);
}

void linear_backward(const Tensor& dx, const Tensor& dW, const Tensor& dy, const Tensor& x, const Tensor& W,
                     bool accumulate_dx) {
  TS_PROFILE_OP("linear_backward", dy);
  if (dx.defined()) matmul(dx, dy, false, W, false, 1.0f, accumulate_dx ? 1.0f : 0.0f);  // dx = dy W
  if (dW.defined()) {
    check_dtype("linear_backward", "dW", dW, DType::F32);
    matmul(dW, dy, true, x, false, 1.0f, 1.0f);  // dW += dy^T x: gradient accumulation in fp32
  }
}

namespace {
AttnShape check_attention(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& qpos, const Tensor& kpos) {
  check_float(op, "q", q);
  TS_CHECK(q.dim() == 4, "%s: q must be [B, S, H, hd], got %s", op, q.str().c_str());
  TS_CHECK(k.dim() == 4 && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
           "%s: k must be [B, S, KVH, hd] matching q %s, got %s", op, q.str().c_str(), k.str().c_str());
  check_same_dtype(op, q, "q", k, "k");
  check_like(op, "v", v, k, "k");
  check_like(op, "out", out, q, "q");
  const AttnShape a{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  TS_CHECK(a.KVH > 0 && a.H % a.KVH == 0, "%s: heads %lld not divisible by kv heads %lld", op, (long long)a.H,
           (long long)a.KVH);
  check_shape(op, "lse", lse, {a.B, a.H, a.S});
  check_dtype(op, "lse", lse, DType::F32);
  check_shape(op, "qpos", qpos, {a.S});
  check_dtype(op, "qpos", qpos, DType::I32);
  check_shape(op, "kpos", kpos, {a.S});
  check_dtype(op, "kpos", kpos, DType::I32);
  return a;
}
}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& qpos, const Tensor& kpos) {
  TS_PROFILE_OP("attention_forward", out);
  const char* op = "attention_forward";
  const AttnShape a = check_attention(op, out, lse, q, k, v, qpos, kpos);
  if (common_device(op, {&out, &lse, &q, &k, &v, &qpos, &kpos}) == Device::CUDA)
    return CUDA_TWIN(attention_forward(out, lse, q, k, v, qpos, kpos));
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_forward_cpu(out.data<T>(), lse.f32(), q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(),
                          a);
  });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                        const Tensor& kpos) {
  TS_PROFILE_OP("attention_backward", dq);
  const char* op = "attention_backward";
  const AttnShape a = check_attention(op, out, lse, q, k, v, qpos, kpos);
  check_like(op, "dq", dq, q, "q");
  check_like(op, "dout", dout, q, "q");
  check_like(op, "dk", dk, k, "k");
  check_like(op, "dv", dv, k, "k");
  if (common_device(op, {&dq, &dk, &dv, &dout, &out, &lse, &q, &k, &v, &qpos, &kpos}) == Device::CUDA)
    return CUDA_TWIN(attention_backward(dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos));
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_backward_cpu(dq.data<T>(), dk.data<T>(), dv.data<T>(), dout.data<T>(), out.data<T>(), lse.f32(),
                           q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(), a);
  });
}

// ===== context parallelism: the merge of partial attention, the Ulysses packing ====================

namespace {
// One row (b, s, h) per iteration: the weights of the two partial softmaxes, from their
// log-sum-exps relative to the larger one (so neither exp overflows), then the weighted sum.
template <class T>
void attention_merge_cpu(T* out, float* lse, const T* part, const float* plse, int64_t B, int64_t S, int64_t H,
                         int64_t hd) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * S * H; row++) {
    const int64_t b = row / (S * H), s = row / H % S, h = row % H, l = (b * H + h) * S + s;
    const float la = lse[l], lb = plse[l], m = std::max(la, lb);
    if (m == ninf) continue;  // no visible key in either part
    const float wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
    lse[l] = m + std::log(sum);
    const float ca = wa / sum, cb = wb / sum;
    T* o = out + row * hd;
    const T* p = part + row * hd;
    for (int64_t d = 0; d < hd; d++) o[d] = st<T>(ca * ld(o[d]) + cb * ld(p[d]));
  }
}
}  // namespace

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part, const Tensor& part_lse) {
  TS_PROFILE_OP("attention_merge", out);
  const char* op = "attention_merge";
  check_float(op, "out", out);
  TS_CHECK(out.dim() == 4, "%s: out must be [B, S, H, hd], got %s", op, out.str().c_str());
  check_like(op, "part", part, out, "out");
  check_shape(op, "lse", lse, {out.size(0), out.size(2), out.size(1)});
  check_dtype(op, "lse", lse, DType::F32);
  check_like(op, "part_lse", part_lse, lse, "lse");
  if (common_device(op, {&out, &lse, &part, &part_lse}) == Device::CUDA)
    return CUDA_TWIN(attention_merge(out, lse, part, part_lse));
  by_dtype(out.dtype, [&](auto t) {
    using T = decltype(t);
    attention_merge_cpu(out.data<T>(), lse.f32(), part.data<T>(), part_lse.f32(), out.size(0), out.size(1),
                        out.size(2), out.size(3));
  });
}

void swap_leading(const Tensor& dst, const Tensor& src, int64_t a, int64_t b) {
  TS_PROFILE_OP("swap_leading", dst);
  const char* op = "swap_leading";
  check_defined(op, "src", src);
  check_numel(op, "dst", dst, src.numel(), src.dtype);
  TS_CHECK(a > 0 && b > 0 && src.numel() % (a * b) == 0, "%s: %s is not [%lld, %lld, w]", op, src.str().c_str(),
           (long long)a, (long long)b);
  TS_CHECK(!(dst.raw() == src.raw() && src.numel() > 0), "%s: dst and src must be separate", op);
  if (common_device(op, {&dst, &src}) == Device::CUDA) return CUDA_TWIN(swap_leading(dst, src, a, b));
  const size_t row = size_t(src.numel() / (a * b)) * dtype_size(src.dtype);
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
#pragma omp parallel for schedule(static)
  for (int64_t ij = 0; ij < a * b; ij++) {
    const int64_t i = ij / b, j = ij % b;
    std::memcpy(d + (j * a + i) * row, s + ij * row, row);
  }
}

void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u) {
  TS_PROFILE_OP("swiglu_forward", h);
  const char* op = "swiglu_forward";
  check_float(op, "g", g);
  check_like(op, "u", u, g, "g");
  check_like(op, "h", h, g, "g");
  if (common_device(op, {&h, &g, &u}) == Device::CUDA) return CUDA_TWIN(swiglu_forward(h, g, u));
  by_dtype(g.dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_forward_cpu(h.data<T>(), g.data<T>(), u.data<T>(), g.numel());
  });
}

void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u) {
  TS_PROFILE_OP("swiglu_backward", dg);
  const char* op = "swiglu_backward";
  check_float(op, "g", g);
  check_like(op, "u", u, g, "g");
  check_like(op, "dh", dh, g, "g");
  check_like(op, "dg", dg, g, "g");
  check_like(op, "du", du, g, "g");
  if (common_device(op, {&dg, &du, &dh, &g, &u}) == Device::CUDA) return CUDA_TWIN(swiglu_backward(dg, du, dh, g, u));
  by_dtype(g.dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_backward_cpu(dg.data<T>(), du.data<T>(), dh.data<T>(), g.data<T>(), u.data<T>(), g.numel());
  });
}

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale) {
  TS_PROFILE_OP("cross_entropy_forward_backward", losses);
  const char* op = "cross_entropy_forward_backward";
  check_float(op, "logits", logits);
  TS_CHECK(logits.dim() >= 1, "%s: logits must be [N, V], got %s", op, logits.str().c_str());
  const int64_t V = logits.size(-1), N = rows_of(op, "logits", logits, V);
  check_numel(op, "targets", targets, N, DType::I32);
  check_numel(op, "losses", losses, N, DType::F32);
  if (dlogits.defined()) check_like(op, "dlogits", dlogits, logits, "logits");
  if (common_device(op, {&losses, &dlogits, &logits, &targets}) == Device::CUDA)
    return CUDA_TWIN(cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale));
  for (int64_t n = 0; n < N; n++)
    TS_CHECK(targets.i32()[n] >= 0 && targets.i32()[n] < V, "%s: target %d of row %lld outside the vocab [0, %lld)",
             op, targets.i32()[n], (long long)n, (long long)V);
  by_dtype(logits.dtype, [&](auto t) {
    using T = decltype(t);
    cross_entropy_cpu(losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(),
                      targets.i32(), grad_scale, N, V);
  });
}

void vocab_ce_max(const Tensor& max, const Tensor& logits) {
  TS_PROFILE_OP("vocab_ce_max", max);
  const char* op = "vocab_ce_max";
  int64_t V;
  const int64_t N = check_vocab_ce(op, logits, max, Tensor(), Tensor(), V);
  if (common_device(op, {&max, &logits}) == Device::CUDA) return CUDA_TWIN(vocab_ce_max(max, logits));
  by_dtype(logits.dtype, [&](auto t) { vocab_ce_max_cpu(max.f32(), logits.data<decltype(t)>(), N, V); });
}

void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets,
                    int64_t vocab_start) {
  TS_PROFILE_OP("vocab_ce_stats", stats);
  const char* op = "vocab_ce_stats";
  int64_t V;
  const int64_t N = check_vocab_ce(op, logits, max, stats, targets, V);
  if (common_device(op, {&stats, &logits, &max, &targets}) == Device::CUDA)
    return CUDA_TWIN(vocab_ce_stats(stats, logits, max, targets, vocab_start));
  for (int64_t n = 0; n < N; n++)  // no rank would own it: its logit would silently read as 0
    TS_CHECK(targets.i32()[n] >= 0, "%s: target %d of row %lld is negative", op, targets.i32()[n], (long long)n);
  by_dtype(logits.dtype, [&](auto t) {
    vocab_ce_stats_cpu(stats.f32(), logits.data<decltype(t)>(), max.f32(), targets.i32(), vocab_start, N, V);
  });
}

void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max,
                     const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale) {
  TS_PROFILE_OP("vocab_ce_finish", losses);
  const char* op = "vocab_ce_finish";
  int64_t V;
  const int64_t N = check_vocab_ce(op, logits, max, stats, targets, V);
  check_numel(op, "losses", losses, N, DType::F32);
  if (dlogits.defined()) check_like(op, "dlogits", dlogits, logits, "logits");
  if (common_device(op, {&losses, &dlogits, &logits, &max, &stats, &targets}) == Device::CUDA)
    return CUDA_TWIN(vocab_ce_finish(losses, dlogits, logits, max, stats, targets, vocab_start, grad_scale));
  by_dtype(logits.dtype, [&](auto t) {
    using T = decltype(t);
    vocab_ce_finish_cpu(losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(), max.f32(),
                        stats.f32(), targets.i32(), vocab_start, grad_scale, N, V);
  });
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p,
                bool decay, float grad_scale, const Tensor& param_copy) {
  TS_PROFILE_OP("adamw_step", param);
  const char* op = "adamw_step";
  check_dtype(op, "param", param, DType::F32);
  const int64_t n = param.numel();
  check_numel(op, "grad", grad, n, DType::F32);
  check_numel(op, "m", m, n, DType::F32);
  check_numel(op, "v", v, n, DType::F32);
  if (param_copy.defined()) {
    check_float(op, "param_copy", param_copy);
    TS_CHECK(param_copy.numel() == n, "%s: param_copy %s must have %lld elements", op, param_copy.str().c_str(),
             (long long)n);
  }
  TS_CHECK(p.step >= 1, "%s: step is 1-based (bias correction 1 - beta^step), got %ld", op, p.step);
  if (common_device(op, {&param, &grad, &m, &v, &param_copy}) == Device::CUDA)
    return CUDA_TWIN(adamw_step(param, grad, m, v, p, decay, grad_scale, param_copy));
  adamw_cpu(param.f32(), grad.f32(), m.f32(), v.f32(), p, decay, grad_scale, param_copy, n);
}

double sum_squares(const Tensor& x) {
  TS_PROFILE_OP("sum_squares", x);
  check_dtype("sum_squares", "x", x, DType::F32);
#ifdef TS_CUDA
  if (x.device() == Device::CUDA) return cuda::sum_squares(x);
#endif
  return sum_squares_cpu(x.f32(), x.numel());
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  for (const Tensor& x : xs) check_dtype("sum_squares_each", "x", x, DType::F32);
#ifdef TS_CUDA
  if (!xs.empty() && xs[0].device() == Device::CUDA) return cuda::sum_squares_each(xs);
#endif
  std::vector<double> r;
  for (const Tensor& x : xs) r.push_back(sum_squares(x));
  return r;
}

void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols) {
  TS_PROFILE_OP("init_normal", t);
  const char* op = "init_normal";
  check_dtype(op, "t", t, DType::F32);
  TS_CHECK(t.dim() == 1 || t.dim() == 2, "%s: t must be 1-D or 2-D, got %s", op, t.str().c_str());
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(-1);
  TS_CHECK(row0 >= 0 && col0 >= 0 && col0 + cols <= global_cols && (t.dim() == 2 || row0 == 0),
           "%s: slice rows [%lld, +%lld) cols [%lld, +%lld) does not fit a global matrix of %lld columns", op,
           (long long)row0, (long long)rows, (long long)col0, (long long)cols, (long long)global_cols);
  if (t.device() == Device::CUDA) return CUDA_TWIN(init_normal(t, key, std, row0, col0, global_cols));
  init_normal_cpu(t.f32(), key, std, rows, cols, row0, col0, global_cols);
}

}  // namespace ts
