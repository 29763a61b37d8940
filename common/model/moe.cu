// moe.cu — the mixture-of-experts block: router, routing plan, gather/combine, experts, aux loss.
#include "model/moe.h"
#include "tensor/shape_only.h"
#include "model/mlp_block.h"
#include "kernels/kernels.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>

#include "comm/comm.h"
#include "comm/trace.h"
#include "tensor/device.h"

namespace ts {

// ===== kernels: CPU reference ====================================================================

static void moe_check(bool ok, const char* op, const char* what) { TS_CHECK(ok, "%s: %s", op, what); }

template <class T> static void gather_cpu(T* out, const T* x, const int32_t* rows, const float* scale, int64_t M,
                                          int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t a = 0; a < M; a++) {
    const float s = scale ? scale[a] : 1.f;
    const T* in = x + int64_t(rows[a]) * D;
    for (int64_t d = 0; d < D; d++) out[a * D + d] = st<T>(s * ld(in[d]));
  }
}

template <class T> static void combine_cpu(T* y, const T* x, const int32_t* src, const float* w, int64_t N, int K,
                                           int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; t++)
    for (int64_t d = 0; d < D; d++) {
      float acc = 0.f;
      for (int k = 0; k < K; k++) {
        const int32_t r = src[t * K + k];
        if (r >= 0) acc += (w ? w[t * K + k] : 1.f) * ld(x[int64_t(r) * D + d]);
      }
      y[t * D + d] = st<T>(acc);
    }
}

template <class T> static void combine_bw_cpu(float* dw, const T* dy, const T* x, const int32_t* src, int64_t N, int K,
                                              int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t a = 0; a < N * K; a++) {
    double acc = 0;
    if (src[a] >= 0)
      for (int64_t d = 0; d < D; d++) acc += double(ld(dy[(a / K) * D + d])) * ld(x[int64_t(src[a]) * D + d]);
    dw[a] = float(acc);
  }
}

// One row of the router, shared by both backends' loops (plain arithmetic, double).
TS_HD void router_row(float* p, int32_t* idx, float* w, const float* z, int E, int K) {
  double mx = z[0], sum = 0;
  for (int j = 1; j < E; j++) mx = z[j] > mx ? z[j] : mx;
  for (int j = 0; j < E; j++) sum += exp(double(z[j]) - mx);
  for (int j = 0; j < E; j++) p[j] = float(exp(double(z[j]) - mx) / sum);
  double s = 0;
  for (int k = 0; k < K; k++) {  // selection: strictly larger wins, so ties go to the lower index
    int best = -1;
    for (int j = 0; j < E; j++) {
      bool taken = false;
      for (int q = 0; q < k; q++) taken |= idx[q] == j;
      if (!taken && (best < 0 || p[j] > p[best])) best = j;
    }
    idx[k] = best;
    s += p[best];
  }
  for (int k = 0; k < K; k++) w[k] = float(p[idx[k]] / s);
}

// dp_j = daux_j + Σ_k [i_k = j] (dw_k − Σ dw·w)/s; dz_j = p_j (dp_j − Σ_i p_i dp_i), no scratch.
TS_HD void router_row_backward(float* dz, const float* dw, const float* p, const int32_t* idx,
                                      const float* daux, int E, int K) {
  double s = 0, gw = 0;
  for (int k = 0; k < K; k++) s += p[idx[k]];
  for (int k = 0; k < K; k++) gw += double(dw[k]) * (p[idx[k]] / s);
  double pd = 0;
  for (int j = 0; j < E; j++) pd += double(p[j]) * (daux ? daux[j] : 0.0);
  for (int k = 0; k < K; k++) pd += double(p[idx[k]]) * (dw[k] - gw) / s;
  for (int j = 0; j < E; j++) {
    double dp = daux ? daux[j] : 0.0;
    for (int k = 0; k < K; k++)
      if (idx[k] == j) dp += (dw[k] - gw) / s;
    dz[j] = float(p[j] * (dp - pd));
  }
}

// DeepSeek-V3's group score (Hugging Face's get_topk_indices): the sum of the group's two largest
// biased scores, in fp32 as there.
TS_HD float moe_group_score(const float* s, const float* bias, int j0, int per) {
  float a = -INFINITY, b = -INFINITY;
  for (int j = j0; j < j0 + per; j++) {
    const float v = s[j] + (bias ? bias[j] : 0.f);
    if (v > a) b = a, a = v;
    else if (v > b) b = v;
  }
  return a + b;
}

// The M best of G groups as a bit mask (strictly larger wins: ties to the lower group).
TS_HD uint64_t moe_group_mask(const float* s, const float* bias, int E, int G, int M) {
  if (G == 1) return 1;
  const int per = E / G;
  uint64_t keep = 0;
  for (int m = 0; m < M; m++) {
    int best = -1;
    float bs = 0.f;
    for (int g = 0; g < G; g++) {
      if ((keep >> g) & 1) continue;
      const float v = moe_group_score(s, bias, g * per, per);
      if (best < 0 || v > bs) best = g, bs = v;
    }
    keep |= uint64_t(1) << best;
  }
  return keep;
}

// One row of the sigmoid router: scores, the group mask, top-K of the biased scores of the kept
// groups' experts (a masked expert is −∞: never chosen, since K ≤ M·E/G), the unbiased weights
// renormalised.
TS_HD void sigmoid_router_row(float* s, int32_t* idx, float* w, const float* z, const float* bias, int E, int K,
                              int G, int M, float scale) {
  for (int j = 0; j < E; j++) s[j] = float(1.0 / (1.0 + exp(-double(z[j]))));
  const uint64_t keep = moe_group_mask(s, bias, E, G, M);
  const int per = E / G;
  for (int k = 0; k < K; k++) {
    int best = -1;
    float bv = 0.f;
    for (int j = 0; j < E; j++) {
      bool taken = false;
      for (int q = 0; q < k; q++) taken |= idx[q] == j;
      const float v = ((keep >> (j / per)) & 1) ? s[j] + (bias ? bias[j] : 0.f) : -INFINITY;
      if (!taken && (best < 0 || v > bv)) best = j, bv = v;
    }
    idx[k] = best;
  }
  double sum = 1e-20;
  for (int k = 0; k < K; k++) sum += s[idx[k]];
  for (int k = 0; k < K; k++) w[k] = float(double(scale) * (s[idx[k]] / sum));
}

// The sigmoid router's backward for one row (formulas in moe.h), no scratch.
TS_HD void sigmoid_router_row_backward(float* dz, const float* dw, const float* s, const int32_t* idx,
                                       const float* daux, int E, int K, float scale) {
  double sig = 1e-20, gw = 0, tot = 0, sd = 0;
  for (int k = 0; k < K; k++) sig += s[idx[k]];
  for (int k = 0; k < K; k++) gw += double(dw[k]) * (s[idx[k]] / sig);
  if (daux) {
    for (int j = 0; j < E; j++) tot += s[j];
    for (int j = 0; j < E; j++) sd += double(s[j]) * daux[j];
  }
  for (int j = 0; j < E; j++) {
    double ds = daux ? (daux[j] - sd / tot) / tot : 0.0;
    for (int k = 0; k < K; k++)
      if (idx[k] == j) ds += double(scale) * (dw[k] - gw) / sig;
    dz[j] = float(ds * s[j] * (1.0 - s[j]));
  }
}

#ifdef TS_CUDA
namespace cuda {
constexpr int kMoeBlock = 256;
static unsigned moe_grid(int64_t n) { return unsigned(std::max<int64_t>(1, std::min<int64_t>(16384, (n + 255) / 256))); }

__global__ void router_forward_kernel(float* p, int32_t* idx, float* w, const float* z, int64_t N, int E, int K) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
    router_row(p + n * E, idx + n * K, w + n * K, z + n * E, E, K);
}
__global__ void router_backward_kernel(float* dz, const float* dw, const float* p, const int32_t* idx,
                                       const float* daux, int64_t N, int E, int K, int64_t S) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
    router_row_backward(dz + n * E, dw + n * K, p + n * E, idx + n * K, daux ? daux + (n / S) * E : nullptr, E, K);
}
__global__ void sigmoid_router_forward_kernel(float* s, int32_t* idx, float* w, const float* z, const float* bias,
                                              int64_t N, int E, int K, int G, int M, float scale) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
    sigmoid_router_row(s + n * E, idx + n * K, w + n * K, z + n * E, bias, E, K, G, M, scale);
}
__global__ void sigmoid_router_backward_kernel(float* dz, const float* dw, const float* s, const int32_t* idx,
                                               const float* daux, int64_t N, int E, int K, int64_t S, float scale) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
    sigmoid_router_row_backward(dz + n * E, dw + n * K, s + n * E, idx + n * K, daux ? daux + (n / S) * E : nullptr, E,
                                K, scale);
}
template <class T> __global__ void gather_kernel(T* out, const T* x, const int32_t* rows, const float* scale, int64_t M,
                                                 int64_t D) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * D; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t a = i / D, d = i % D;
    out[i] = st<T>((scale ? scale[a] : 1.f) * ld(x[int64_t(rows[a]) * D + d]));
  }
}
template <class T> __global__ void combine_kernel(T* y, const T* x, const int32_t* src, const float* w, int64_t N,
                                                  int K, int64_t D) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * D; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, d = i % D;
    float acc = 0.f;
    for (int k = 0; k < K; k++) {
      const int32_t r = src[t * K + k];
      if (r >= 0) acc += (w ? w[t * K + k] : 1.f) * ld(x[int64_t(r) * D + d]);
    }
    y[i] = st<T>(acc);
  }
}
template <class T> __global__ void combine_bw_kernel(float* dw, const T* dy, const T* x, const int32_t* src, int64_t N,
                                                     int K, int64_t D) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < N * K; a += int64_t(gridDim.x) * blockDim.x) {
    double acc = 0;
    if (src[a] >= 0)
      for (int64_t d = 0; d < D; d++) acc += double(ld(dy[(a / K) * D + d])) * ld(x[int64_t(src[a]) * D + d]);
    dw[a] = float(acc);
  }
}
template <class F> static void moe_dtype(DType dt, F&& f) {
  if (dt == DType::F32) f(float{});
  else f(bf16{});
}
}  // namespace cuda
#define MOE_LAUNCH(kernel, n, ...)                                                                       \
  do {                                                                                                    \
    TS_LAUNCH(cuda::moe_grid(n), cuda::kMoeBlock, 0, compute_stream(), cuda::kernel)(__VA_ARGS__);               \
    KERNEL_CHECK();                                                                                       \
  } while (0)
#endif

static bool on_cuda(const Tensor& t) { return t.device() == Device::CUDA; }
template <class T> static const T* opt_ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

// ===== public ops ================================================================================

// A shape-only run's routing: token n's k-th choice is expert (n·K + k) mod E, weight 1/K, the
// balanced loads (N·K/E rows each) that the memory and byte predictions assume.
static void shape_only_route(const Tensor& idx, const Tensor& w, int64_t N, int E, int K) {
  for (int64_t a = 0; a < N * K; a++) idx.i32()[a] = int32_t(a % E), w.f32()[a] = 1.0f / float(K);
}

void moe_router_forward(const Tensor& probs, const Tensor& idx, const Tensor& w, const Tensor& logits) {
  const char* op = "moe_router_forward";
  const int64_t N = logits.size(0);
  const int E = int(logits.size(1)), K = int(idx.size(1));
  moe_check(logits.dtype == DType::F32 && probs.dtype == DType::F32 && w.dtype == DType::F32 &&
                idx.dtype == DType::I32, op, "logits, probs, w fp32 and idx int32");
  moe_check(probs.shape == logits.shape && idx.size(0) == N && w.shape == idx.shape && K <= E, op, "shapes");
  if (shape_only()) return shape_only_route(idx, w, N, E, K);  // no values to route by (tensor/shape_only.h)
  if (on_cuda(logits)) {
#ifdef TS_CUDA
    MOE_LAUNCH(router_forward_kernel, N, probs.f32(), idx.i32(), w.f32(), logits.f32(), N, E, K);
#endif
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    router_row(probs.f32() + n * E, idx.i32() + n * K, w.f32() + n * K, logits.f32() + n * E, E, K);
}

void moe_router_backward(const Tensor& dlogits, const Tensor& dw, const Tensor& probs, const Tensor& idx,
                         const Tensor& daux, int64_t S) {
  const char* op = "moe_router_backward";
  const int64_t N = probs.size(0);
  const int E = int(probs.size(1)), K = int(idx.size(1));
  moe_check(dlogits.shape == probs.shape && dw.shape == idx.shape && N % S == 0, op, "shapes");
  moe_check(!daux.defined() || daux.numel() == N / S * E, op, "daux must be [B, E]");
  TS_SHAPE_ONLY_SKIP();
  if (on_cuda(probs)) {
#ifdef TS_CUDA
    MOE_LAUNCH(router_backward_kernel, N, dlogits.f32(), dw.f32(), probs.f32(), idx.i32(), opt_ptr<float>(daux), N, E,
               K, S);
#endif
    return;
  }
  const float* da = opt_ptr<float>(daux);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    router_row_backward(dlogits.f32() + n * E, dw.f32() + n * K, probs.f32() + n * E, idx.i32() + n * K,
                        da ? da + (n / S) * E : nullptr, E, K);
}

void moe_router_sigmoid_forward(const Tensor& scores, const Tensor& idx, const Tensor& w, const Tensor& logits,
                                const Tensor& bias, int G, int M, float scale) {
  const char* op = "moe_router_sigmoid_forward";
  const int64_t N = logits.size(0);
  const int E = int(logits.size(1)), K = int(idx.size(1));
  moe_check(logits.dtype == DType::F32 && scores.dtype == DType::F32 && w.dtype == DType::F32 &&
                idx.dtype == DType::I32 && (!bias.defined() || (bias.dtype == DType::F32 && bias.numel() == E)),
            op, "logits, scores, w, bias fp32 and idx int32");
  moe_check(scores.shape == logits.shape && idx.size(0) == N && w.shape == idx.shape, op, "shapes");
  moe_check(G >= 1 && G <= 64 && E % G == 0 && M >= 1 && M <= G && K <= M * (E / G), op, "groups");
  if (shape_only()) return shape_only_route(idx, w, N, E, K);  // no values to route by (tensor/shape_only.h)
  const float* b = opt_ptr<float>(bias);
  if (on_cuda(logits)) {
#ifdef TS_CUDA
    MOE_LAUNCH(sigmoid_router_forward_kernel, N, scores.f32(), idx.i32(), w.f32(), logits.f32(), b, N, E, K, G, M,
               scale);
#endif
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    sigmoid_router_row(scores.f32() + n * E, idx.i32() + n * K, w.f32() + n * K, logits.f32() + n * E, b, E, K, G, M,
                       scale);
}

void moe_router_sigmoid_backward(const Tensor& dlogits, const Tensor& dw, const Tensor& scores, const Tensor& idx,
                                 const Tensor& daux, int64_t S, float scale) {
  const char* op = "moe_router_sigmoid_backward";
  const int64_t N = scores.size(0);
  const int E = int(scores.size(1)), K = int(idx.size(1));
  moe_check(dlogits.shape == scores.shape && dw.shape == idx.shape && N % S == 0, op, "shapes");
  moe_check(!daux.defined() || daux.numel() == N / S * E, op, "daux must be [B, E]");
  TS_SHAPE_ONLY_SKIP();
  const float* da = opt_ptr<float>(daux);
  if (on_cuda(scores)) {
#ifdef TS_CUDA
    MOE_LAUNCH(sigmoid_router_backward_kernel, N, dlogits.f32(), dw.f32(), scores.f32(), idx.i32(), da, N, E, K, S,
               scale);
#endif
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    sigmoid_router_row_backward(dlogits.f32() + n * E, dw.f32() + n * K, scores.f32() + n * E, idx.i32() + n * K,
                                da ? da + (n / S) * E : nullptr, E, K, scale);
}

// DeepSeek-V3 §2.1.2: an overloaded expert's bias falls by γ, an underloaded one's rises by γ.
void moe_bias_update(float* bias, const int64_t* load, int E, float rate) {
  int64_t total = 0;
  for (int e = 0; e < E; e++) total += load[e];
  for (int e = 0; e < E; e++) {
    const int64_t d = total - int64_t(E) * load[e];  // E·(mean − load_e): the sign without rounding
    bias[e] += d > 0 ? rate : d < 0 ? -rate : 0.f;
  }
}

void moe_gather(const Tensor& out, const Tensor& x, const Tensor& rows, const Tensor& scale) {
  const int64_t M = out.size(0), D = out.size(1);
  moe_check(out.dtype == x.dtype && x.size(1) == D && rows.numel() == M && rows.dtype == DType::I32, "moe_gather",
            "out [M, D], x [N, D] of one dtype, rows int32 [M]");
  moe_check(!scale.defined() || scale.numel() == M, "moe_gather", "scale must be [M]");
  TS_SHAPE_ONLY_SKIP();
  if (on_cuda(out)) {
#ifdef TS_CUDA
    cuda::moe_dtype(x.dtype, [&](auto t) {
      using T = decltype(t);
      MOE_LAUNCH(gather_kernel<T>, M * D, out.data<T>(), x.data<T>(), rows.i32(), opt_ptr<float>(scale), M, D);
    });
#endif
    return;
  }
  if (x.dtype == DType::F32) gather_cpu(out.f32(), x.f32(), rows.i32(), opt_ptr<float>(scale), M, D);
  else gather_cpu(out.b16(), x.b16(), rows.i32(), opt_ptr<float>(scale), M, D);
}

void moe_combine(const Tensor& y, const Tensor& x, const Tensor& src, const Tensor& w) {
  const int64_t N = y.size(0), D = y.size(1);
  const int K = int(src.size(1));
  moe_check(y.dtype == x.dtype && x.size(1) == D && src.size(0) == N && src.dtype == DType::I32, "moe_combine",
            "y [N, D], x [M, D] of one dtype, src int32 [N, K]");
  moe_check(!w.defined() || w.shape == src.shape, "moe_combine", "w must be [N, K]");
  TS_SHAPE_ONLY_SKIP();
  if (on_cuda(y)) {
#ifdef TS_CUDA
    cuda::moe_dtype(x.dtype, [&](auto t) {
      using T = decltype(t);
      MOE_LAUNCH(combine_kernel<T>, N * D, y.data<T>(), x.data<T>(), src.i32(), opt_ptr<float>(w), N, K, D);
    });
#endif
    return;
  }
  if (x.dtype == DType::F32) combine_cpu(y.f32(), x.f32(), src.i32(), opt_ptr<float>(w), N, K, D);
  else combine_cpu(y.b16(), x.b16(), src.i32(), opt_ptr<float>(w), N, K, D);
}

void moe_combine_backward_weights(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& src) {
  const int64_t N = dy.size(0), D = dy.size(1);
  const int K = int(src.size(1));
  moe_check(dw.shape == src.shape && dw.dtype == DType::F32 && x.dtype == dy.dtype && x.size(1) == D,
            "moe_combine_backward_weights", "dw fp32 [N, K], dy [N, D], x [M, D]");
  TS_SHAPE_ONLY_SKIP();
  if (on_cuda(dy)) {
#ifdef TS_CUDA
    cuda::moe_dtype(x.dtype, [&](auto t) {
      using T = decltype(t);
      MOE_LAUNCH(combine_bw_kernel<T>, N * K, dw.f32(), dy.data<T>(), x.data<T>(), src.i32(), N, K, D);
    });
#endif
    return;
  }
  if (x.dtype == DType::F32) combine_bw_cpu(dw.f32(), dy.f32(), x.f32(), src.i32(), N, K, D);
  else combine_bw_cpu(dw.f32(), dy.b16(), x.b16(), src.i32(), N, K, D);
}

// ===== routing plan ==============================================================================

int64_t expert_capacity(const ModelConfig& c, int S) {
  if (c.capacity_factor <= 0) return -1;
  return int64_t(std::floor(double(c.capacity_factor) * S * c.top_k / c.experts));
}

// Sequence by sequence, token by token, slot by slot: an expert that already holds `cap` rows of
// this sequence drops the assignment (GShard's capacity, Switch's "earliest tokens first").
RoutingPlan make_routing_plan(const std::vector<int32_t>& idx, const std::vector<float>& w, int B, int S, int E,
                              int K, int64_t cap) {
  RoutingPlan p;
  const int64_t N = int64_t(B) * S;
  p.src.assign(size_t(N * K), -1);
  p.kept.assign(size_t(E), 0);
  p.seq_counts.assign(size_t(B) * E, 0);
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(E));
  for (int b = 0; b < B; b++) {
    std::vector<int64_t> taken(size_t(E), 0);
    for (int64_t a = int64_t(b) * S * K; a < int64_t(b + 1) * S * K; a++) {
      const int e = idx[size_t(a)];
      p.seq_counts[size_t(b) * E + e]++;
      if (cap >= 0 && taken[size_t(e)] >= cap) {
        p.dropped++;
        continue;
      }
      taken[size_t(e)]++;
      lists[size_t(e)].push_back(a);
    }
  }
  for (int e = 0; e < E; e++) {
    for (int64_t a : lists[size_t(e)]) {
      p.src[size_t(a)] = int32_t(p.perm.size());
      p.perm.push_back(int32_t(a / K));
      p.wa.push_back(w[size_t(a)]);
    }
    p.kept[size_t(e)] = int64_t(lists[size_t(e)].size());
  }
  return p;
}

// ===== the block =================================================================================

bool is_expert_param(const ParamEntry& e) {
  return e.name.find(".block_sparse_moe.experts.") != std::string::npos || e.name.find(".mlp.experts.") != std::string::npos;
}
static std::string moe_prefix(const ModelConfig& c, int l) {
  return "model.layers." + std::to_string(l) + (c.sigmoid_router ? ".mlp." : ".block_sparse_moe.");
}
std::string moe_gate_name(const ModelConfig& c, int l) { return moe_prefix(c, l) + "gate.weight"; }
std::string moe_expert_name(const ModelConfig& c, int l, int j, const char* role) {
  const std::string r = role;
  // Mixtral numbers SwiGLU's matrices as the Mixtral paper does: w1 gate, w3 up, w2 down.
  const std::string w = c.sigmoid_router ? r : r == "gate_proj" ? "w1" : r == "up_proj" ? "w3" : "w2";
  return moe_prefix(c, l) + "experts." + std::to_string(j) + "." + w + ".weight";
}

std::string moe_bias_name(int l) { return "model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias"; }
std::string moe_shared_name(int l, const char* w) {
  return "model.layers." + std::to_string(l) + ".mlp.shared_experts." + w + ".weight";
}
bool is_moe_bias(const ParamEntry& e) { return e.name.find(".e_score_correction_bias") != std::string::npos; }

MoeBlock::MoeBlock(const Model& m) {
  for (int l = 0; l < m.cfg.layers; l++) {
    gate_.push_back(m.entry(moe_gate_name(m.cfg, l)));
    if (m.cfg.sigmoid_router) bias_.push_back(m.entry(moe_bias_name(l)));
    if (m.cfg.shared_experts > 0)
      shared_.push_back({m.entry(moe_shared_name(l, "gate_proj")), m.entry(moe_shared_name(l, "up_proj")),
                         m.entry(moe_shared_name(l, "down_proj"))});
    std::vector<Expert> ex;
    for (int j = 0; j < m.cfg.experts; j++)
      ex.push_back({m.entry(moe_expert_name(m.cfg, l, j, "gate_proj")), m.entry(moe_expert_name(m.cfg, l, j, "up_proj")),
                    m.entry(moe_expert_name(m.cfg, l, j, "down_proj"))});
    exp_.push_back(ex);
  }
  stats.reset(m.cfg.layers, m.cfg.experts);
}

// What the balance loss averages: the softmax probabilities, or DeepSeek-V3's s' = s / Σ_e s.
static std::vector<float> balance_probs(std::vector<float> p, int E, bool sigmoid) {
  if (!sigmoid) return p;
  for (size_t t = 0; t < p.size(); t += size_t(E)) {
    double sum = 0;
    for (int e = 0; e < E; e++) sum += p[t + size_t(e)];
    for (int e = 0; e < E; e++) p[t + size_t(e)] = float(p[t + size_t(e)] / sum);
  }
  return p;
}

// aux_b = E · Σ_e f_e · P_e per sequence (Switch eq. 4), f from the choices, P the mean probability.
static std::vector<float> aux_per_sequence(const std::vector<float>& probs, const RoutingPlan& p, int B, int S, int E,
                                           int K) {
  std::vector<float> aux(static_cast<size_t>(B));
  for (int b = 0; b < B; b++) {
    double a = 0;
    for (int e = 0; e < E; e++) {
      double P = 0;
      for (int t = b * S; t < (b + 1) * S; t++) P += probs[size_t(t) * E + e];
      a += double(p.seq_counts[size_t(b) * E + e]) / (double(S) * K) * (P / S);
    }
    aux[size_t(b)] = float(E * a);
  }
  return aux;
}

void MoeBlock::forward(Model& m, int l, const Tensor& y, const Tensor& h, LayerActs& a) {
  const ModelConfig& c = m.cfg;
  const int64_t N = h.size(0), D = c.dim;
  const int S = c.seq, E = c.experts, K = c.top_k, B = int(N / S);
  TS_CHECK(N % S == 0, "moe: %lld tokens are not whole sequences of %d", (long long)N, S);
  Tensor logits = Tensor::empty({N, E}, DType::F32, m.dev, Tag::Workspace);
  linear_forward(logits, h, m.weight(gate_[size_t(l)]));
  a.mlp_state = new_acts();
  Tensor probs = Tensor::empty({N, E}, DType::F32, m.dev, Tag::Activations);
  Tensor idx = Tensor::empty({N, K}, DType::I32, m.dev, Tag::Activations);
  Tensor w = Tensor::empty({N, K}, DType::F32, m.dev, Tag::Workspace);
  route(m, l, logits, probs, idx, w);
  const std::vector<float> hp = balance_probs(to_host_f32(probs), E, c.sigmoid_router);
  const RoutingPlan p = make_routing_plan(to_host_i32(idx), to_host_f32(w), B, S, E, K, expert_capacity(c, S));
  const std::vector<float> aux = aux_per_sequence(hp, p, B, S, E, K);
  a.aux_loss = 0;
  for (float v : aux) a.aux_loss += double(c.aux_loss_coef) * v;
  std::vector<int32_t> counts(p.seq_counts.begin(), p.seq_counts.end());
  counts.insert(counts.end(), p.kept.begin(), p.kept.end());
  counts.push_back(int32_t(p.dropped));
  const int64_t M = int64_t(p.perm.size());
  MoeActs& s = acts(a);
  s.probs = probs;
  s.idx = idx;
  s.src = from_host_i32(p.src, m.dev, Tag::Activations).reshape({N, K});
  s.perm = from_host_i32(p.perm, m.dev, Tag::Activations);
  s.wa = from_host_f32(p.wa, m.dev, Tag::Activations);
  s.host_counts = from_host_i32(counts, Device::CPU, Tag::Workspace);
  s.host_aux = from_host_f32(aux, Device::CPU, Tag::Workspace);
  Tensor x = Tensor::empty({M, D}, m.dtype, m.dev, keeps_input_ ? Tag::Activations : Tag::Workspace);
  moe_gather(x, h, s.perm, Tensor());
  routed_forward(m, l, y, x, w, p.kept, a);
  shared_forward(m, l, y, h, a);
}

void MoeBlock::routed_forward(Model& m, int l, const Tensor& y, const Tensor& x, const Tensor& w,
                              const std::vector<int64_t>& counts, LayerActs& a) {
  MoeActs& s = acts(a);
  s.out = experts_forward(m, l, x, counts, a);
  moe_combine(y, s.out, s.src, w);
}

// Mixtral's softmax router, or DeepSeek-V3's sigmoid router with this layer's bias (in fp32).
void MoeBlock::route(Model& m, int l, const Tensor& logits, const Tensor& probs, const Tensor& idx, const Tensor& w) {
  const ModelConfig& c = m.cfg;
  if (!c.sigmoid_router) return moe_router_forward(probs, idx, w, logits);
  Tensor b = m.weight(bias_[size_t(l)]);
  if (b.dtype != DType::F32) {
    Tensor b32 = Tensor::empty({c.experts}, DType::F32, m.dev, Tag::Workspace);
    convert(b32, b);
    b = b32;
  }
  moe_router_sigmoid_forward(probs, idx, w, logits, b, c.expert_groups, c.group_limit, c.routed_scaling);
}

// The shared experts: y += down(silu(gate h) * up h), one SwiGLU of width S·F_e over every token
// (the dense MLP's code, model.h).
void MoeBlock::shared_forward(Model& m, int l, const Tensor& y, const Tensor& h, LayerActs& a) {
  if (shared_.empty()) return;
  MoeActs& s = acts(a);
  Tensor out = Tensor::empty(y.shape, m.dtype, m.dev, Tag::Workspace);
  swiglu_mlp_forward(m, shared_[size_t(l)], out, h, s.shared_g, s.shared_u, s.shared_act);
  add_inplace(y, out);
}

void MoeBlock::shared_backward(Model& m, int l, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) {
  if (shared_.empty()) return;
  MoeActs& s = acts(a);
  swiglu_mlp_backward(m, shared_[size_t(l)], dh, dy, h, s.shared_g, s.shared_u, s.shared_act, /*accumulate_dh=*/true);
}

// b_e ← b_e + γ·sign(mean − load_e) per layer, written to the weights and to the fp32 master copy
// when there is one (the optimizer's step would otherwise restore the old value from it).
void MoeBlock::update_bias(Model& m, const std::vector<int64_t>& loads, const Tensor& master) {
  const ModelConfig& c = m.cfg;
  if (!c.sigmoid_router || c.bias_update_rate == 0) return;
  for (int l = 0; l < c.layers; l++) {
    const ParamEntry& e = m.table.entries[size_t(bias_[size_t(l)])];
    if (!e.held()) continue;  // another pipeline stage's layer: that stage moves it, from the same loads
    const Tensor src = master.defined() ? master.view(e.offset, {e.numel}) : m.weight(bias_[size_t(l)]);
    std::vector<float> b = to_host_f32(src);
    moe_bias_update(b.data(), loads.data() + size_t(l) * c.experts, c.experts, c.bias_update_rate);
    if (master.defined()) from_host_f32(master.view(e.offset, {e.numel}), b.data());
    from_host_f32(m.weight(bias_[size_t(l)]), b.data());  // rounded to the weights' dtype
  }
}

Tensor MoeBlock::experts_forward(Model& m, int l, const Tensor& x, const std::vector<int64_t>& counts, LayerActs& a) {
  acts(a).in = x;
  Tensor out = Tensor::empty(x.shape, m.dtype, m.dev, Tag::Activations);
  run_experts(m, l, 0, counts, x, out, a);
  return out;
}

void MoeBlock::experts_backward(Model& m, int l, const Tensor& dx, const Tensor& dout,
                                const std::vector<int64_t>& counts, LayerActs& a) {
  run_experts_backward(m, l, 0, counts, acts(a).in, dout, dx, a);
}

// Each expert is a SwiGLU MLP over its own consecutive rows: down(silu(w1 x) * w3 x).
void MoeBlock::run_experts(Model& m, int l, int e0, const std::vector<int64_t>& counts, const Tensor& x,
                           const Tensor& out, LayerActs& a) {
  const int64_t R = x.size(0), F = m.cfg.expert_width();
  // One --trace span per call, with its rows: how long each rank's experts take at its load.
  TraceScope trace("experts fwd (" + std::to_string(R) + " rows)");
  auto act = [&] { return Tensor::empty({R, F}, m.dtype, m.dev, Tag::Activations); };
  a.g = act();
  a.u = act();
  a.act = act();
  if (R == 0) return;
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); off += counts[i], i++) {
    if (counts[i] == 0) continue;
    const Expert& ex = exp_[size_t(l)][size_t(e0) + i];
    linear_forward(a.g.rows(off, counts[i]), x.rows(off, counts[i]), m.weight(ex.w1));
    linear_forward(a.u.rows(off, counts[i]), x.rows(off, counts[i]), m.weight(ex.w3));
  }
  swiglu_forward(a.act, a.g, a.u);
  off = 0;
  for (size_t i = 0; i < counts.size(); off += counts[i], i++)
    if (counts[i] > 0)
      linear_forward(out.rows(off, counts[i]), a.act.rows(off, counts[i]), m.weight(exp_[size_t(l)][size_t(e0) + i].w2));
}

void MoeBlock::run_experts_backward(Model& m, int l, int e0, const std::vector<int64_t>& counts, const Tensor& x,
                                    const Tensor& dout, const Tensor& dx, LayerActs& a) {
  const int64_t R = x.size(0), F = m.cfg.expert_width();
  TraceScope trace("experts bwd (" + std::to_string(R) + " rows)");
  if (R == 0) return;
  if (!a.act.defined()) {  // selective recompute: the product is rebuilt, no matmul needed
    a.act = Tensor::empty({R, F}, m.dtype, m.dev, Tag::Activations);
    swiglu_forward(a.act, a.g, a.u);
  }
  auto work = [&] { return Tensor::empty({R, F}, m.dtype, m.dev, Tag::Workspace); };
  Tensor dact = work(), dg = work(), du = work();
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); off += counts[i], i++) {
    if (counts[i] == 0) continue;
    const Expert& ex = exp_[size_t(l)][size_t(e0) + i];
    m.linear_backward(dact.rows(off, counts[i]), m.grad(ex.w2), dout.rows(off, counts[i]), a.act.rows(off, counts[i]),
                      m.weight(ex.w2));
  }
  swiglu_backward(dg, du, dact, a.g, a.u);
  off = 0;
  for (size_t i = 0; i < counts.size(); off += counts[i], i++) {
    if (counts[i] == 0) continue;
    const Expert& ex = exp_[size_t(l)][size_t(e0) + i];
    const Tensor xs = x.rows(off, counts[i]), dxs = dx.rows(off, counts[i]);
    m.linear_backward(dxs, m.grad(ex.w1), dg.rows(off, counts[i]), xs, m.weight(ex.w1));
    m.linear_backward(dxs, m.grad(ex.w3), du.rows(off, counts[i]), xs, m.weight(ex.w3), /*accumulate_dx=*/true);
  }
}

// Backward of y = Σ_k w_k · expert(h): the experts' rows get w · dy, the weights get dy · out,
// h gets the experts' input gradients summed back per token (slot order).
void MoeBlock::routed_backward(Model& m, int l, const Tensor& dh, const Tensor& dw, const Tensor& dy,
                               const std::vector<int64_t>& counts, LayerActs& a) {
  const MoeActs& s = acts(a);
  const int64_t M = s.out.size(0), D = m.cfg.dim;
  auto work = [&] { return Tensor::empty({M, D}, m.dtype, m.dev, Tag::Workspace); };
  Tensor dout = work(), dx = work();
  moe_gather(dout, dy, s.perm, s.wa);
  moe_combine_backward_weights(dw, dy, s.out, s.src);
  experts_backward(m, l, dx, dout, counts, a);
  moe_combine(dh, dx, s.src, Tensor());
}

// The routed experts (routed_backward), then the router's part of h's gradient and the shared experts'.
void MoeBlock::backward(Model& m, int l, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) {
  const ModelConfig& c = m.cfg;
  const int64_t N = h.size(0);
  const int S = c.seq, E = c.experts, K = c.top_k, B = int(N / S);
  const MoeActs& s = acts(a);
  const int32_t* hc = s.host_counts.i32();
  const std::vector<int64_t> kept(hc + size_t(B) * E, hc + size_t(B) * E + E);
  Tensor dw = Tensor::empty({N, K}, DType::F32, m.dev, Tag::Workspace);
  routed_backward(m, l, dh, dw, dy, kept, a);
  // The aux term of the loss is α · aux_b / B_global = α · aux_b · loss_scale · T per sequence;
  // d aux_b / d p_{t,e} = E · f_e / T (f, a count, carries no gradient): daux = α·loss_scale·E·f_e.
  std::vector<float> daux(size_t(B) * E);
  for (size_t i = 0; i < daux.size(); i++)
    daux[i] = float(double(c.aux_loss_coef) * m.loss_scale * E * hc[i] / (double(S) * K));
  Tensor dlogits = Tensor::empty({N, E}, DType::F32, m.dev, Tag::Workspace);
  const Tensor da = from_host_f32(daux, m.dev, Tag::Workspace);
  if (c.sigmoid_router) moe_router_sigmoid_backward(dlogits, dw, s.probs, s.idx, da, S, c.routed_scaling);
  else moe_router_backward(dlogits, dw, s.probs, s.idx, da, S);
  Tensor dl = dlogits;
  if (m.dtype != DType::F32) {
    dl = Tensor::empty({N, E}, m.dtype, m.dev, Tag::Workspace);
    convert(dl, dlogits);
  }
  m.linear_backward(dh, m.grad(gate_[size_t(l)]), dl, h, m.weight(gate_[size_t(l)]), /*accumulate_dx=*/true);
  shared_backward(m, l, dh, dy, h, a);
  // Statistics here, not in forward: a full-recompute layer runs its forward twice, backward once.
  for (int b = 0; b < B; b++)
    for (int e = 0; e < E; e++) stats.counts[size_t(l) * E + e] += hc[size_t(b) * E + e];
  stats.assignments += N * K;
  stats.dropped += hc[size_t(B) * E + E];
  for (int64_t b = 0; b < B; b++) stats.aux_sum += s.host_aux.f32()[b];
  if (l == 0) stats.sequences += B;
}

}  // namespace ts
