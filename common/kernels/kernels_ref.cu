// kernels_ref.cu — the reference implementation of every op of kernels.h: plain loops, written to
// be read beside the formulas (kernels_ref.h says which of them kernels.cu runs on the CPU).
//
// Each op is a loop templated on the activation storage type T (float or bf16, loaded with ld()
// and stored with st<T>()), followed by the function over tensors that picks T. The ops that run
// (elementwise, embedding forward, SwiGLU, AdamW, init) split their rows over OpenMP threads with
// static schedules and no sums across rows, so their bits do not depend on the thread count; the
// oracles of the tuned kernels (embedding backward, RMSNorm, RoPE, matmul, attention,
// cross-entropy, sum of squares) are single-threaded and sum in double.
#include "kernels/kernels_ref.h"
#include "kernels/kernels.h"

#include <cmath>
#include <limits>
#include <vector>

#include "tensor/rng.h"
#include "kernels/kernels_internal.h"
#include "tensor/device.h"

namespace ts {
namespace ref {
namespace {

using detail::by_dtype;
const double kInf = std::numeric_limits<double>::infinity();

// ===== elementwise ==============================================================================

template <class T> void add_ref(T* y, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = st<T>(ld(a[i]) + ld(b[i]));
}

template <class T> void scale_ref(T* y, float s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = st<T>(ld(y[i]) * s);
}

template <class T> void fill_ref(T* y, float value, int64_t n) {
  const T v = st<T>(value);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) y[i] = v;
}

// ===== embedding ================================================================================

template <class T>
void embedding_forward_ref(T* out, const T* table, const int32_t* tok, int64_t N, int64_t V, int64_t D,
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

// dtable[tok[n] - vocab_start, :] += dout[n, :] for the tokens this shard owns, in token order.
template <class T>
void embedding_backward_ref(float* dtable, const T* dout, const int32_t* tok, int64_t N, int64_t V, int64_t D,
                            int64_t vocab_start) {
  for (int64_t n = 0; n < N; n++) {
    const int64_t row = int64_t(tok[n]) - vocab_start;
    if (row < 0 || row >= V) continue;
    for (int64_t d = 0; d < D; d++) dtable[row * D + d] += ld(dout[n * D + d]);
  }
}

// ===== RMSNorm ==================================================================================

// y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
template <class T>
void rmsnorm_forward_ref(T* y, float* rstd, const T* x, const float* w, float eps, int64_t N, int64_t D) {
  for (int64_t n = 0; n < N; n++) {
    double ss = 0;
    for (int64_t d = 0; d < D; d++) ss += double(ld(x[n * D + d])) * ld(x[n * D + d]);
    const float r = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
    rstd[n] = r;
    for (int64_t d = 0; d < D; d++) y[n * D + d] = st<T>(ld(x[n * D + d]) * r * w[d]);
  }
}

// With xhat = x * rstd: dx = rstd * (w*dy - xhat * mean(w*dy*xhat)); dw += sum_n dy * xhat.
template <class T>
void rmsnorm_backward_ref(T* dx, float* dw, const T* dy, const T* x, const float* w, const float* rstd,
                          int64_t N, int64_t D) {
  std::vector<double> dw_sum(D, 0.0);
  for (int64_t n = 0; n < N; n++) {
    const double r = rstd[n];
    double c = 0;
    for (int64_t d = 0; d < D; d++) c += w[d] * double(ld(dy[n * D + d])) * (ld(x[n * D + d]) * r);
    c /= double(D);
    for (int64_t d = 0; d < D; d++) {
      const double xhat = ld(x[n * D + d]) * r, g = ld(dy[n * D + d]);
      dx[n * D + d] = st<T>(float(r * (w[d] * g - xhat * c)));
      dw_sum[d] += g * xhat;
    }
  }
  for (int64_t d = 0; d < D; d++) dw[d] += float(dw_sum[d]);
}

// ===== RoPE =====================================================================================

// The pairs (j, j + hd/2) of every head turn by the angle pos[s] * theta^(-2j/hd):
// (a, b) -> (a cos - b sin, b cos + a sin), the HF rotate_half form. sign = -1 turns them back
// (the backward pass: R^T = R(-angle)).
template <class T>
void rope_ref(T* x, const int32_t* pos, float theta, float sign, int64_t B, int64_t S, int64_t H, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < S; s++)
      for (int64_t h = 0; h < H; h++) {
        T* xh = x + ((b * S + s) * H + h) * hd;
        for (int64_t j = 0; j < half; j++) {
          const double angle = double(pos[s]) * std::pow(double(theta), -2.0 * double(j) / double(hd));
          const double c = std::cos(angle), sn = sign * std::sin(angle);
          const double a = ld(xh[j]), bb = ld(xh[j + half]);
          xh[j] = st<T>(float(a * c - bb * sn));
          xh[j + half] = st<T>(float(bb * c + a * sn));
        }
      }
}

// ===== matmul ===================================================================================

// C[m, n] = alpha sum_k op(A)[m, k] op(B)[k, n] + beta C[m, n], row-major, op(A)[m, k] = A[k, m]
// when transA (likewise B). beta = 0 leaves C unread, as BLAS does.
template <class T, class TC>
void matmul_ref(TC* C, const T* A, bool transA, const T* B, bool transB, float alpha, float beta, int64_t M,
                int64_t N, int64_t K) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++)
        s += double(ld(transA ? A[k * M + m] : A[m * K + k])) * ld(transB ? B[n * K + k] : B[k * N + n]);
      const float c = alpha * float(s);
      C[m * N + n] = st<TC>(beta == 0.0f ? c : c + beta * ld(C[m * N + n]));
    }
}

// ===== attention ================================================================================

struct AttnDims {
  int64_t B, S, H, KVH, hd;
};

// The scaled scores of query row (b, i, h): s[j] = q_i . k_j / sqrt(hd) for the keys it sees,
// kpos[j] <= qpos[i], and -inf for the others. Head h reads kv head h / (H / KVH) (GQA).
template <class T>
void attention_scores(std::vector<double>& s, const T* q, const T* k, const int32_t* qpos, const int32_t* kpos,
                      const AttnDims& a, int64_t b, int64_t i, int64_t h) {
  const T* qi = q + ((b * a.S + i) * a.H + h) * a.hd;
  const int64_t kvh = h / (a.H / a.KVH);
  for (int64_t j = 0; j < a.S; j++) {
    s[j] = -kInf;
    if (kpos[j] > qpos[i]) continue;
    const T* kj = k + ((b * a.S + j) * a.KVH + kvh) * a.hd;
    double dot = 0;
    for (int64_t d = 0; d < a.hd; d++) dot += double(ld(qi[d])) * ld(kj[d]);
    s[j] = dot / std::sqrt(double(a.hd));
  }
}

// lse_i = log sum_j exp(s_ij) over the visible keys (max taken out first); o_i = sum_j p_ij v_j
// with p_ij = exp(s_ij - lse_i). A row that sees no key gets lse -inf and o = 0.
template <class T>
void attention_forward_ref(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* qpos,
                           const int32_t* kpos, const AttnDims& a) {
  std::vector<double> s(a.S), o(a.hd);
  for (int64_t b = 0; b < a.B; b++)
    for (int64_t h = 0; h < a.H; h++)
      for (int64_t i = 0; i < a.S; i++) {
        attention_scores(s, q, k, qpos, kpos, a, b, i, h);
        double mx = -kInf, sum = 0;
        for (int64_t j = 0; j < a.S; j++) mx = std::max(mx, s[j]);
        for (int64_t j = 0; j < a.S && mx > -kInf; j++) sum += std::exp(s[j] - mx);
        const double l = mx > -kInf ? mx + std::log(sum) : -kInf;
        lse[(b * a.H + h) * a.S + i] = float(l);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j < a.S && l > -kInf; j++) {
          const double p = std::exp(s[j] - l);
          const T* vj = v + ((b * a.S + j) * a.KVH + h / (a.H / a.KVH)) * a.hd;
          for (int64_t d = 0; d < a.hd; d++) o[d] += p * ld(vj[d]);
        }
        T* oi = out + ((b * a.S + i) * a.H + h) * a.hd;
        for (int64_t d = 0; d < a.hd; d++) oi[d] = st<T>(float(o[d]));
      }
}

// With p_ij = exp(s_ij - lse_i) recomputed from the saved lse and D_i = dO_i . O_i:
//   dS_ij = p_ij (dO_i . v_j - D_i),  dq_i = sum_j dS_ij k_j / sqrt(hd),
//   dk_j = sum_i dS_ij q_i / sqrt(hd),  dv_j = sum_i p_ij dO_i,
// dk and dv summed over the query heads that share the kv head.
template <class T>
void attention_backward_ref(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q,
                            const T* k, const T* v, const int32_t* qpos, const int32_t* kpos, const AttnDims& a) {
  const int64_t nq = a.B * a.S * a.H * a.hd, nk = a.B * a.S * a.KVH * a.hd;
  const double scale = 1.0 / std::sqrt(double(a.hd));
  std::vector<double> gq(nq, 0.0), gk(nk, 0.0), gv(nk, 0.0), s(a.S);
  for (int64_t b = 0; b < a.B; b++)
    for (int64_t h = 0; h < a.H; h++)
      for (int64_t i = 0; i < a.S; i++) {
        const double l = lse[(b * a.H + h) * a.S + i];
        if (l == -kInf) continue;  // no visible key: no gradient
        attention_scores(s, q, k, qpos, kpos, a, b, i, h);
        const int64_t qi = ((b * a.S + i) * a.H + h) * a.hd;
        double Di = 0;
        for (int64_t d = 0; d < a.hd; d++) Di += double(ld(dout[qi + d])) * ld(out[qi + d]);
        for (int64_t j = 0; j < a.S; j++) {
          if (s[j] == -kInf) continue;
          const int64_t kj = ((b * a.S + j) * a.KVH + h / (a.H / a.KVH)) * a.hd;
          const double p = std::exp(s[j] - l);
          double dp = 0;
          for (int64_t d = 0; d < a.hd; d++) dp += double(ld(dout[qi + d])) * ld(v[kj + d]);
          const double ds = p * (dp - Di);
          for (int64_t d = 0; d < a.hd; d++) {
            gq[qi + d] += scale * ds * ld(k[kj + d]);
            gk[kj + d] += scale * ds * ld(q[qi + d]);
            gv[kj + d] += p * ld(dout[qi + d]);
          }
        }
      }
  for (int64_t i = 0; i < nq; i++) dq[i] = st<T>(float(gq[i]));
  for (int64_t i = 0; i < nk; i++) {
    dk[i] = st<T>(float(gk[i]));
    dv[i] = st<T>(float(gv[i]));
  }
}

// ===== SwiGLU ===================================================================================

inline float sigmoid(float x) { return 1.0f / (1.0f + detail::exp_approx(-x)); }

// h = silu(g) * u, silu(g) = g * sigmoid(g).
template <class T> void swiglu_forward_ref(T* h, const T* g, const T* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float gi = ld(g[i]);
    h[i] = st<T>(gi * sigmoid(gi) * ld(u[i]));
  }
}

// dg = dh * u * silu'(g), silu'(g) = sig(g) * (1 + g * (1 - sig(g))); du = dh * silu(g).
template <class T> void swiglu_backward_ref(T* dg, T* du, const T* dh, const T* g, const T* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float gi = ld(g[i]), sg = sigmoid(gi), d = ld(dh[i]);
    dg[i] = st<T>(d * ld(u[i]) * sg * (1.0f + gi * (1.0f - sg)));
    du[i] = st<T>(d * gi * sg);
  }
}

// ===== cross-entropy ============================================================================

// loss_n = log sum_j exp(x_j) - x_t (the row max taken out, so no exp overflows);
// dlogits = (softmax(x) - onehot(t)) * grad_scale, written once the row is read (dl may alias
// logits; dl null: losses only).
template <class T>
void cross_entropy_ref(float* losses, T* dl, const T* logits, const int32_t* tgt, float grad_scale, int64_t N,
                       int64_t V) {
  std::vector<double> x(V);
  for (int64_t n = 0; n < N; n++) {
    for (int64_t j = 0; j < V; j++) x[j] = ld(logits[n * V + j]);
    double mx = -kInf, sum = 0;
    for (int64_t j = 0; j < V; j++) mx = std::max(mx, x[j]);
    for (int64_t j = 0; j < V; j++) sum += std::exp(x[j] - mx);
    const int64_t t = tgt[n];
    losses[n] = float(mx + std::log(sum) - x[t]);
    if (!dl) continue;
    for (int64_t j = 0; j < V; j++) dl[n * V + j] = st<T>(float((std::exp(x[j] - mx) / sum - (j == t)) * grad_scale));
  }
}

// ===== optimizer and norms ======================================================================

// AdamW (Loshchilov & Hutter): m, v moments with bias correction 1 - beta^step, decoupled decay.
void adamw_ref(float* p, const float* grad, float* m, float* v, const AdamWParams& hp, bool decay, float grad_scale,
               const Tensor& param_copy, int64_t n) {
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
    by_dtype(param_copy.dtype, [&](auto t) { detail::convert_n(param_copy.data<decltype(t)>(), p, n); });
}

// ===== counter-based init =======================================================================

// Element (r, c) of the slice is element (row0 + r, col0 + c) of the global matrix: its value
// depends on that global index only, so any sharding reproduces the full tensor's slice.
void init_normal_ref(float* t, uint64_t key, float stdev, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                     int64_t global_cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++)
      t[r * cols + c] = stdev * rng_normal(key, uint64_t((row0 + r) * global_cols + col0 + c));
}

AttnDims attn_dims(const Tensor& q, const Tensor& k) { return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)}; }

}  // namespace

// ===== the ops over tensors =====================================================================

void add(const Tensor& y, const Tensor& a, const Tensor& b) {
  by_dtype(y.dtype, [&](auto t) {
    using T = decltype(t);
    add_ref(y.data<T>(), a.data<T>(), b.data<T>(), y.numel());
  });
}

void scale_inplace(const Tensor& y, float s) {
  by_dtype(y.dtype, [&](auto t) { scale_ref(y.data<decltype(t)>(), s, y.numel()); });
}

void convert(const Tensor& dst, const Tensor& src) {
  by_dtype(dst.dtype, [&](auto dt) {
    by_dtype(src.dtype, [&](auto s) { detail::convert_n(dst.data<decltype(dt)>(), src.data<decltype(s)>(), dst.numel()); });
  });
}

void fill(const Tensor& t, float value) {
  by_dtype(t.dtype, [&](auto tag) { fill_ref(t.data<decltype(tag)>(), value, t.numel()); });
}

void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start) {
  by_dtype(table.dtype, [&](auto t) {
    using T = decltype(t);
    embedding_forward_ref(out.data<T>(), table.data<T>(), tokens.i32(), tokens.numel(), table.size(0), table.size(1),
                          vocab_start);
  });
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start) {
  by_dtype(dout.dtype, [&](auto t) {
    embedding_backward_ref(dtable.f32(), dout.data<decltype(t)>(), tokens.i32(), tokens.numel(), dtable.size(0),
                           dtable.size(1), vocab_start);
  });
}

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_forward_ref(y.data<T>(), rstd.f32(), x.data<T>(), w.f32(), eps, rstd.numel(), w.numel());
  });
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  by_dtype(x.dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_backward_ref(dx.data<T>(), dw.f32(), dy.data<T>(), x.data<T>(), w.f32(), rstd.f32(), rstd.numel(),
                         w.numel());
  });
}

void rope_forward(const Tensor& x, const Tensor& pos, float theta) {
  by_dtype(x.dtype, [&](auto t) {
    rope_ref(x.data<decltype(t)>(), pos.i32(), theta, 1.0f, x.size(0), x.size(1), x.size(2), x.size(3));
  });
}

void rope_backward(const Tensor& dx, const Tensor& pos, float theta) {
  by_dtype(dx.dtype, [&](auto t) {
    rope_ref(dx.data<decltype(t)>(), pos.i32(), theta, -1.0f, dx.size(0), dx.size(1), dx.size(2), dx.size(3));
  });
}

void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta) {
  // A named struct, not a structured binding: C++17 lambdas cannot capture bindings.
  const detail::MatmulDims d = detail::matmul_dims(C, A, transA);
  by_dtype(A.dtype, [&](auto a) {
    using T = decltype(a);
    by_dtype(C.dtype, [&](auto c) {
      matmul_ref(C.data<decltype(c)>(), A.data<T>(), transA, B.data<T>(), transB, alpha, beta, d.M, d.N, d.K);
    });
  });
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& qpos, const Tensor& kpos) {
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_forward_ref(out.data<T>(), lse.f32(), q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(),
                          attn_dims(q, k));
  });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                        const Tensor& kpos) {
  by_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    attention_backward_ref(dq.data<T>(), dk.data<T>(), dv.data<T>(), dout.data<T>(), out.data<T>(), lse.f32(),
                           q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(), attn_dims(q, k));
  });
}

void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u) {
  by_dtype(g.dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_forward_ref(h.data<T>(), g.data<T>(), u.data<T>(), g.numel());
  });
}

void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u) {
  by_dtype(g.dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_backward_ref(dg.data<T>(), du.data<T>(), dh.data<T>(), g.data<T>(), u.data<T>(), g.numel());
  });
}

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale) {
  const int64_t V = logits.size(-1);
  by_dtype(logits.dtype, [&](auto t) {
    using T = decltype(t);
    cross_entropy_ref(losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(), targets.i32(),
                      grad_scale, losses.numel(), V);
  });
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p,
                bool decay, float grad_scale, const Tensor& param_copy) {
  adamw_ref(param.f32(), grad.f32(), m.f32(), v.f32(), p, decay, grad_scale, param_copy, param.numel());
}

double sum_squares(const Tensor& x) {
  double s = 0;
  for (int64_t i = 0; i < x.numel(); i++) s += double(x.f32()[i]) * x.f32()[i];
  return s;
}

void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols) {
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(-1);
  init_normal_ref(t.f32(), key, std, rows, cols, row0, col0, global_cols);
}

}  // namespace ref
}  // namespace ts
