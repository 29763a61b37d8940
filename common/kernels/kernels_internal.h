// kernels_internal.h — what the implementations of kernels.h share, and what a chapter that
// defines kernels of its own (06's merge and packing) uses as kernels.cu does: the argument
// checks, the dtype dispatch, and the numerics that must give the same bits in every file that
// runs them (inline, one definition).
#pragma once
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/device.h"

namespace ts {
namespace detail {

// ===== argument checks (kernels.cu): each names the op and the argument in its error ============

void check_defined(const char* op, const char* name, const Tensor& t);
void check_shape(const char* op, const char* name, const Tensor& t, const std::vector<int64_t>& shape);
void check_dtype(const char* op, const char* name, const Tensor& t, DType dt);
void check_float(const char* op, const char* name, const Tensor& t);  // activations: fp32 or bf16
void check_same_dtype(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn);
// t has ref's shape and dtype.
void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* refname);
// t has n elements of dtype dt, whatever its shape.
void check_numel(const char* op, const char* name, const Tensor& t, int64_t n, DType dt);
// t is [..., D]; returns its row count (the leading dimensions flattened).
int64_t rows_of(const char* op, const char* name, const Tensor& t, int64_t D);
// Every defined tensor of one call lives on one device; returns it.
Device common_device(const char* op, std::initializer_list<const Tensor*> ts);

// Runs f(T{}) for the activation dtype, so one templated loop serves fp32 and bf16.
template <class F> void by_dtype(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(bf16{});
}

// dst = src element by element, each value rounded to nearest even when D is bf16.
template <class D, class S> void convert_n(D* dst, const S* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) dst[i] = st<D>(ld(src[i]));
}

// C [M, N] = op(A) [M, K] · op(B) [K, N], with every leading dimension of C and of A folded into
// the rows.
struct MatmulDims {
  int64_t M, N, K;
};
inline MatmulDims matmul_dims(const Tensor& C, const Tensor& A, bool transA) {
  const int64_t N = C.size(-1), M = N ? C.numel() / N : 0;
  const int64_t K = !transA ? A.size(-1) : A.size(-1) ? A.numel() / A.size(-1) : 0;
  return {M, N, K};
}

// x rounded up to a multiple of m (tile and panel sizes of the CPU kernels).
constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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

// ----- the row passes of softmax cross-entropy: the fused kernel and the vocabulary-parallel steps

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

// The max, exp and sum passes of a softmax row. Three plain loops: fused into one, the compiler
// no longer vectorises them (~4x slower).
inline float row_max(const float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; j++) mx = mx > row[j] ? mx : row[j];
  return mx;
}

inline void exp_shifted(float* e, const float* row, float mx, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; j++) e[j] = exp_approx(row[j] - mx);
}

inline double exp_sum(float* e, const float* row, float mx, int64_t n) {
  exp_shifted(e, row, mx, n);
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += e[j];
  return sum;
}

// logsumexp - x[t] from the max and the sum of exp(x - max), in double.
inline float ce_loss(float mx, double sum, float xt) { return float(double(mx) + std::log(sum) - double(xt)); }

// A row of dlogits = (softmax - onehot(t)) * scale from e = exp(x - max) and inv = 1 / sum; t may
// lie outside [0, V) (another rank owns the target).
template <class T> void ce_grad_row(T* d, const float* e, float inv, int64_t t, float scale, int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < V; j++) d[j] = st<T>((e[j] * inv - float(j == t)) * scale);
}

}  // namespace detail
}  // namespace ts
