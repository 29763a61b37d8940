// ranks: 1
// Every op of kernels.h against a plain double-precision reference written here (the
// vocabulary-parallel cross-entropy's steps against the fused op), at awkward sizes (odd
// dimensions, sequence lengths that are no multiple of any tile, GQA ratios 1, 2, 4); each tuned
// CPU kernel (kernels_cpu.cu) against its plain-loop reference (ts::ref, kernels_ref.cu) within
// bounds a real bug breaks by orders of magnitude ("[ref]"); plus determinism, bf16, the
// allocator's accounting and the counter-based RNG. With a GPU, every CUDA twin is also checked
// against the CPU implementation ("cuda twin: <op>").
#include <catch2/catch.hpp>
#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/allocator.h"
#include "tensor/device.h"
#include "tensor/rng.h"
#include "kernels/kernels.h"
#include "kernels/kernels_bf16.h"
#include "kernels/kernels_ref.h"

using namespace ts;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
using IVec = std::vector<int32_t>;

namespace {

const double kInf = std::numeric_limits<double>::infinity();

// Test inputs come straight from the counter-based sampler, so they do not depend on the ops.
Vec randn(int64_t n, uint64_t seed, float stdev = 1.0f) {
  Vec v(n);
  for (int64_t i = 0; i < n; i++) v[i] = stdev * rng_normal(seed, uint64_t(i));
  return v;
}

Tensor make(std::vector<int64_t> shape, const Vec& vals, DType dt = DType::F32) {
  Tensor t = Tensor::empty(std::move(shape), dt, Device::CPU, Tag::Activations);
  REQUIRE(size_t(t.numel()) == vals.size());
  from_host_f32(t, vals.data());
  return t;
}

Tensor ints(const IVec& v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I32, Device::CPU, Tag::Activations);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

IVec iota(int64_t n, int32_t start) {
  IVec v(n);
  for (int64_t i = 0; i < n; i++) v[i] = start + int32_t(i);
  return v;
}

Vec host(const Tensor& t) { return to_host_f32(t); }
DVec dbl(const Vec& v) { return DVec(v.begin(), v.end()); }

// Norm-wise relative error max|got - want| / max|want|: robust where single entries are near 0.
double rel_err(const Vec& got, const DVec& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < got.size(); i++) {
    diff = std::max(diff, std::fabs(double(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return diff / scale;
}
double rel_err(const Vec& got, const Vec& want) { return rel_err(got, dbl(want)); }

bool bitwise_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The gradient of L(x) = sum(dy * f(x)) by central differences, all in double: the oracle a
// backward pass is checked against where no closed form is written out.
DVec fd_grad(const std::function<DVec(const DVec&)>& f, DVec x, const DVec& dy, double h = 1e-5) {
  DVec g(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double x0 = x[i];
    x[i] = x0 + h;
    DVec fp = f(x);
    x[i] = x0 - h;
    DVec fm = f(x);
    x[i] = x0;
    double s = 0;
    for (size_t j = 0; j < fp.size(); j++) s += dy[j] * (fp[j] - fm[j]);
    g[i] = s / (2 * h);
  }
  return g;
}

// Runs body with exactly n OpenMP threads, then restores the previous setting.
template <class F> void with_threads(int n, F&& body) {
  const int prev = omp_get_max_threads();
  omp_set_num_threads(n);
  body();
  omp_set_num_threads(prev);
}

// ----- double references ------------------------------------------------------------------------

DVec rmsnorm_ref(const DVec& x, const DVec& w, double eps, int64_t N, int64_t D, DVec* rstd = nullptr) {
  DVec y(N * D);
  if (rstd) rstd->resize(N);
  for (int64_t n = 0; n < N; n++) {
    double ss = 0;
    for (int64_t d = 0; d < D; d++) ss += x[n * D + d] * x[n * D + d];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    if (rstd) (*rstd)[n] = r;
    for (int64_t d = 0; d < D; d++) y[n * D + d] = x[n * D + d] * r * w[d];
  }
  return y;
}

// HF rotate_half RoPE: pairs (j, j + hd/2) rotated by pos * theta^(-2j/hd).
DVec rope_ref(const DVec& x, const IVec& pos, double theta, int64_t B, int64_t S, int64_t H, int64_t hd) {
  DVec y = x;
  const int64_t half = hd / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < S; s++)
      for (int64_t h = 0; h < H; h++)
        for (int64_t j = 0; j < half; j++) {
          const int64_t o = ((b * S + s) * H + h) * hd;
          const double ang = pos[s] * std::pow(theta, -2.0 * j / hd);
          const double a = x[o + j], c = x[o + j + half];
          y[o + j] = a * std::cos(ang) - c * std::sin(ang);
          y[o + j + half] = c * std::cos(ang) + a * std::sin(ang);
        }
  return y;
}

// C[M, N] = op(A) op(B), A stored [M, K] or [K, M] (transA), B stored [K, N] or [N, K] (transB).
DVec matmul_ref(const DVec& A, bool ta, const DVec& B, bool tb, int64_t M, int64_t N, int64_t K) {
  DVec C(M * N, 0.0);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++) s += (ta ? A[k * M + m] : A[m * K + k]) * (tb ? B[n * K + k] : B[k * N + n]);
      C[m * N + n] = s;
    }
  return C;
}

struct AttnDims {
  int64_t B, S, H, KVH, hd;
  int64_t qsize() const { return B * S * H * hd; }
  int64_t ksize() const { return B * S * KVH * hd; }
  int64_t qi(int64_t b, int64_t s, int64_t h) const { return ((b * S + s) * H + h) * hd; }
  int64_t ki(int64_t b, int64_t s, int64_t h) const { return ((b * S + s) * KVH + h) * hd; }
};

// Probabilities of one (b, h, query i) row; returns false if no key is visible (lse = -inf).
bool attn_probs(DVec& p, double& lse, const DVec& q, const DVec& k, const AttnDims& a, const IVec& qpos,
                const IVec& kpos, int64_t b, int64_t h, int64_t i) {
  const int64_t kvh = h / (a.H / a.KVH);
  const double scale = 1.0 / std::sqrt(double(a.hd));
  p.assign(a.S, 0.0);
  double mx = -kInf;
  for (int64_t j = 0; j < a.S; j++) {
    if (kpos[j] > qpos[i]) continue;
    double s = 0;
    for (int64_t d = 0; d < a.hd; d++) s += q[a.qi(b, i, h) + d] * k[a.ki(b, j, kvh) + d];
    p[j] = s * scale;
    mx = std::max(mx, p[j]);
  }
  if (mx == -kInf) {
    lse = -kInf;
    return false;
  }
  double sum = 0;
  for (int64_t j = 0; j < a.S; j++) sum += kpos[j] <= qpos[i] ? std::exp(p[j] - mx) : 0.0;
  for (int64_t j = 0; j < a.S; j++) p[j] = kpos[j] <= qpos[i] ? std::exp(p[j] - mx) / sum : 0.0;
  lse = mx + std::log(sum);
  return true;
}

DVec attn_ref(const DVec& q, const DVec& k, const DVec& v, const AttnDims& a, const IVec& qpos, const IVec& kpos,
              DVec* lse = nullptr) {
  DVec out(a.qsize(), 0.0), p;
  if (lse) lse->assign(a.B * a.H * a.S, 0.0);
  for (int64_t b = 0; b < a.B; b++)
    for (int64_t h = 0; h < a.H; h++)
      for (int64_t i = 0; i < a.S; i++) {
        double l;
        const bool any = attn_probs(p, l, q, k, a, qpos, kpos, b, h, i);
        if (lse) (*lse)[(b * a.H + h) * a.S + i] = l;
        if (!any) continue;
        for (int64_t j = 0; j < a.S; j++)
          for (int64_t d = 0; d < a.hd; d++)
            out[a.qi(b, i, h) + d] += p[j] * v[a.ki(b, j, h / (a.H / a.KVH)) + d];
      }
  return out;
}

// The analytic softmax-attention backward: dS = P (dP - rowsum(dO * O)), in double.
void attn_bwd_ref(DVec& dq, DVec& dk, DVec& dv, const DVec& dout, const DVec& q, const DVec& k, const DVec& v,
                  const AttnDims& a, const IVec& qpos, const IVec& kpos) {
  const DVec out = attn_ref(q, k, v, a, qpos, kpos);
  const double scale = 1.0 / std::sqrt(double(a.hd));
  dq.assign(a.qsize(), 0.0);
  dk.assign(a.ksize(), 0.0);
  dv.assign(a.ksize(), 0.0);
  DVec p;
  for (int64_t b = 0; b < a.B; b++)
    for (int64_t h = 0; h < a.H; h++) {
      const int64_t kvh = h / (a.H / a.KVH);
      for (int64_t i = 0; i < a.S; i++) {
        double l;
        if (!attn_probs(p, l, q, k, a, qpos, kpos, b, h, i)) continue;
        double Di = 0;
        for (int64_t d = 0; d < a.hd; d++) Di += dout[a.qi(b, i, h) + d] * out[a.qi(b, i, h) + d];
        for (int64_t j = 0; j < a.S; j++) {
          double dp = 0;
          for (int64_t d = 0; d < a.hd; d++) dp += dout[a.qi(b, i, h) + d] * v[a.ki(b, j, kvh) + d];
          const double ds = p[j] * (dp - Di);
          for (int64_t d = 0; d < a.hd; d++) {
            dq[a.qi(b, i, h) + d] += scale * ds * k[a.ki(b, j, kvh) + d];
            dk[a.ki(b, j, kvh) + d] += scale * ds * q[a.qi(b, i, h) + d];
            dv[a.ki(b, j, kvh) + d] += p[j] * dout[a.qi(b, i, h) + d];
          }
        }
      }
    }
}

// Compares lse allowing -inf (rows with no visible key) on both sides.
void check_lse(const Vec& got, const DVec& want, double tol) {
  REQUIRE(got.size() == want.size());
  Vec g;
  DVec w;
  for (size_t i = 0; i < got.size(); i++) {
    if (want[i] == -kInf) {
      REQUIRE(got[i] == -std::numeric_limits<float>::infinity());
      continue;
    }
    g.push_back(got[i]);
    w.push_back(want[i]);
  }
  if (!g.empty()) REQUIRE(rel_err(g, w) <= tol);
}

struct AttnCase {
  AttnDims a;
  Vec q, k, v, dout;
  IVec qpos, kpos;
};

AttnCase attn_case(AttnDims a, IVec qpos, IVec kpos, uint64_t seed) {
  return {a, randn(a.qsize(), seed), randn(a.ksize(), seed + 1), randn(a.ksize(), seed + 2),
          randn(a.qsize(), seed + 3), std::move(qpos), std::move(kpos)};
}

// Runs attention forward and backward through the kernels; returns out, lse, dq, dk, dv.
std::vector<Vec> run_attention(const AttnCase& c, DType dt) {
  const AttnDims& a = c.a;
  Tensor q = make({a.B, a.S, a.H, a.hd}, c.q, dt), k = make({a.B, a.S, a.KVH, a.hd}, c.k, dt);
  Tensor v = make({a.B, a.S, a.KVH, a.hd}, c.v, dt), dout = make({a.B, a.S, a.H, a.hd}, c.dout, dt);
  Tensor qp = ints(c.qpos), kp = ints(c.kpos);
  Tensor out = Tensor::empty(q.shape, dt, Device::CPU, Tag::Activations);
  Tensor lse = Tensor::empty({a.B, a.H, a.S}, DType::F32, Device::CPU, Tag::Activations);
  Tensor dq = Tensor::empty(q.shape, dt, Device::CPU, Tag::Activations);
  Tensor dk = Tensor::empty(k.shape, dt, Device::CPU, Tag::Activations);
  Tensor dv = Tensor::empty(k.shape, dt, Device::CPU, Tag::Activations);
  attention_forward(out, lse, q, k, v, qp, kp);
  attention_backward(dq, dk, dv, dout, out, lse, q, k, v, qp, kp);
  return {host(out), host(lse), host(dq), host(dk), host(dv)};
}

}  // namespace

// ===== bf16 and elementwise ======================================================================

TEST_CASE("float_to_bf16 rounds to nearest even on hand-picked bit patterns", "[bf16]") {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0 exact
      {0x3F808000u, 0x3F80},  // tie, even neighbour below: down
      {0x3F818000u, 0x3F82},  // tie, odd below: up to even
      {0x3F808001u, 0x3F81},  // just above the tie: up
      {0x3F807FFFu, 0x3F80},  // just below the tie: down
      {0xBF818000u, 0xBF82},  // negative tie rounds the magnitude to even
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX rounds up to inf
      {0x80000000u, 0x8000},  // -0
      {0x00000001u, 0x0000},  // smallest denormal rounds to 0
      {0x7FC00000u, 0x7FC0},  // quiet NaN stays
  };
  for (const Case& c : cases) {
    INFO("input bits 0x" << std::hex << c.in);
    CHECK(float_to_bf16(bits_float(c.in)).bits == c.out);
  }
  // A NaN whose payload lives only in the dropped bits must stay NaN, not become inf.
  CHECK(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));
  CHECK(std::isnan(bf16_to_float(float_to_bf16(bits_float(0xFF800001u)))));
}

TEST_CASE("convert rounds like float_to_bf16 and widens exactly", "[elementwise]") {
  Vec x = randn(1001, 11, 3.0f);
  x[0] = bits_float(0x3F818000u);
  x[1] = std::numeric_limits<float>::infinity();
  Tensor f = make({1001}, x), b = Tensor::empty({1001}, DType::BF16, Device::CPU, Tag::Activations);
  convert(b, f);
  for (int i = 0; i < 1001; i++) REQUIRE(b.b16()[i].bits == float_to_bf16(x[i]).bits);
  Tensor back = Tensor::empty({1001}, DType::F32, Device::CPU, Tag::Activations);
  convert(back, b);
  for (int i = 0; i < 1001; i++) REQUIRE(back.f32()[i] == bf16_to_float(b.b16()[i]));
}

TEST_CASE("add, add_inplace, scale_inplace and fill", "[elementwise]") {
  const int64_t n = 777;
  Vec a = randn(n, 21), b = randn(n, 22);
  Tensor ta = make({n}, a), tb = make({n}, b), y = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Activations);
  add(y, ta, tb);
  for (int64_t i = 0; i < n; i++) REQUIRE(y.f32()[i] == a[i] + b[i]);
  add(ta, ta, tb);  // y aliasing a
  for (int64_t i = 0; i < n; i++) REQUIRE(ta.f32()[i] == a[i] + b[i]);
  add_inplace(ta, tb);
  for (int64_t i = 0; i < n; i++) REQUIRE(ta.f32()[i] == (a[i] + b[i]) + b[i]);
  scale_inplace(tb, -0.5f);
  for (int64_t i = 0; i < n; i++) REQUIRE(tb.f32()[i] == b[i] * -0.5f);
  fill(tb, 2.5f);
  for (int64_t i = 0; i < n; i++) REQUIRE(tb.f32()[i] == 2.5f);
  Tensor h = Tensor::empty({n}, DType::BF16, Device::CPU, Tag::Activations);
  fill(h, 1.00390625f);  // 1 + 2^-8: a tie in bf16, rounds to 1
  for (int64_t i = 0; i < n; i++) REQUIRE(h.b16()[i].bits == 0x3F80);
}

// ===== embedding =================================================================================

TEST_CASE("embedding forward gathers rows, zeros outside the vocab shard", "[embedding]") {
  const int64_t V = 13, D = 7, vstart = 10;
  const Vec table = randn(V * D, 31);
  const IVec tok = {10, 22, 9, 23, 15, 10, 0};  // 9, 23, 0 fall outside [10, 23)
  Tensor out = Tensor::empty({7, D}, DType::F32, Device::CPU, Tag::Activations);
  fill(out, 99.0f);
  embedding_forward(out, make({V, D}, table), ints(tok), vstart);
  const Vec got = host(out);
  for (int64_t n = 0; n < 7; n++)
    for (int64_t d = 0; d < D; d++) {
      const int64_t row = tok[n] - vstart;
      const float want = row >= 0 && row < V ? table[row * D + d] : 0.0f;
      REQUIRE(got[n * D + d] == want);
    }
  // [B, S] tokens into [B, S, D] activations: the same rows.
  Tensor out3 = Tensor::empty({1, 7, D}, DType::F32, Device::CPU, Tag::Activations);
  embedding_forward(out3, make({V, D}, table), ints(tok).reshape({1, 7}), vstart);
  REQUIRE(bitwise_equal(host(out3), got));
}

TEST_CASE("embedding backward accumulates in token order into fp32", "[embedding]") {
  const int64_t V = 67, D = 9, N = 301, vstart = 3;
  IVec tok(N);
  for (int64_t n = 0; n < N; n++) tok[n] = int32_t((n * 37 + n / 5) % 75);  // repeats, some out of shard
  const Vec dout = randn(N * D, 41), init = randn(V * D, 42);
  DVec want(init.begin(), init.end());
  Vec order = init;  // fp32 accumulation in token order: the kernel's exact contract
  for (int64_t n = 0; n < N; n++) {
    const int64_t row = tok[n] - vstart;
    if (row < 0 || row >= V) continue;
    for (int64_t d = 0; d < D; d++) {
      want[row * D + d] += dout[n * D + d];
      order[row * D + d] += dout[n * D + d];
    }
  }
  Tensor dt = make({V, D}, init);
  embedding_backward(dt, make({N, D}, dout), ints(tok), vstart);
  REQUIRE(rel_err(host(dt), want) <= 1e-6);
  REQUIRE(bitwise_equal(host(dt), order));
}

// ===== RMSNorm ===================================================================================

TEST_CASE("rmsnorm forward matches the double reference", "[rmsnorm]") {
  const int64_t N = 13, D = 67;
  const float eps = 1e-5f;
  const Vec x = randn(N * D, 51, 2.0f), w = randn(D, 52);
  DVec rstd;
  const DVec want = rmsnorm_ref(dbl(x), dbl(w), eps, N, D, &rstd);
  Tensor y = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Activations);
  Tensor r = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Activations);
  rmsnorm_forward(y, r, make({N, D}, x), make({D}, w), eps);
  REQUIRE(rel_err(host(y), want) <= 1e-6);
  REQUIRE(rel_err(host(r), rstd) <= 1e-6);
}

TEST_CASE("rmsnorm backward matches finite differences; dw accumulates", "[rmsnorm]") {
  const int64_t N = 5, D = 33;
  const float eps = 1e-5f;
  const Vec x = randn(N * D, 61), w = randn(D, 62), dy = randn(N * D, 63), dw0 = randn(D, 64);
  const DVec dx_want = fd_grad([&](const DVec& xx) { return rmsnorm_ref(xx, dbl(w), eps, N, D); }, dbl(x), dbl(dy));
  DVec dw_want = fd_grad([&](const DVec& ww) { return rmsnorm_ref(dbl(x), ww, eps, N, D); }, dbl(w), dbl(dy));
  for (int64_t d = 0; d < D; d++) dw_want[d] += dw0[d];
  Tensor tx = make({N, D}, x), tw = make({D}, w), dw = make({D}, dw0);
  Tensor y = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Activations);
  Tensor r = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Activations);
  Tensor dx = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Activations);
  rmsnorm_forward(y, r, tx, tw, eps);
  rmsnorm_backward(dx, dw, make({N, D}, dy), tx, tw, r);
  REQUIRE(rel_err(host(dx), dx_want) <= 1e-5);
  REQUIRE(rel_err(host(dw), dw_want) <= 1e-5);
}

TEST_CASE("rmsnorm accepts [B, S, D] activations", "[rmsnorm]") {
  const int64_t B = 2, S = 7, D = 16;
  const Vec x = randn(B * S * D, 65), w = randn(D, 66);
  Tensor y3 = Tensor::empty({B, S, D}, DType::F32, Device::CPU, Tag::Activations);
  Tensor y2 = Tensor::empty({B * S, D}, DType::F32, Device::CPU, Tag::Activations);
  Tensor r = Tensor::empty({B, S}, DType::F32, Device::CPU, Tag::Activations);
  rmsnorm_forward(y3, r, make({B, S, D}, x), make({D}, w), 1e-6f);
  rmsnorm_forward(y2, r.reshape({B * S}), make({B * S, D}, x), make({D}, w), 1e-6f);
  REQUIRE(bitwise_equal(host(y3), host(y2)));
}

// ===== RoPE ======================================================================================

TEST_CASE("rope forward matches HF rotate_half at offset positions", "[rope]") {
  const int64_t B = 2, S = 7, H = 3, hd = 10;
  const float theta = 10000.0f;
  const IVec pos = {5, 6, 7, 8, 9, 10, 1000};  // a large position checks the angle's precision
  const Vec x = randn(B * S * H * hd, 71);
  Tensor t = make({B, S, H, hd}, x);
  rope_forward(t, ints(pos), theta);
  REQUIRE(rel_err(host(t), rope_ref(dbl(x), pos, theta, B, S, H, hd)) <= 2e-6);
  // Position 0 is the identity.
  Tensor t0 = make({1, 1, H, hd}, Vec(x.begin(), x.begin() + H * hd));
  rope_forward(t0, ints({0}), theta);
  REQUIRE(bitwise_equal(host(t0), Vec(x.begin(), x.begin() + H * hd)));
}

TEST_CASE("rope backward is the transpose of the forward rotation", "[rope]") {
  const int64_t B = 1, S = 33, H = 2, hd = 8;
  const IVec pos = iota(S, 5);
  const Vec x = randn(B * S * H * hd, 72), g = randn(B * S * H * hd, 73);
  // d/dx sum(g * R x) = R^T g; R is linear, so the finite differences are exact up to rounding.
  const DVec want = fd_grad([&](const DVec& xx) { return rope_ref(xx, pos, 500.0, B, S, H, hd); }, dbl(x), dbl(g));
  Tensor tg = make({B, S, H, hd}, g);
  rope_backward(tg, ints(pos), 500.0f);
  REQUIRE(rel_err(host(tg), want) <= 1e-5);
  Tensor tx = make({B, S, H, hd}, x);
  rope_forward(tx, ints(pos), 500.0f);
  rope_backward(tx, ints(pos), 500.0f);
  REQUIRE(rel_err(host(tx), dbl(x)) <= 1e-6);
}

// The CPU kernel keeps its cos/sin tables between calls: a call with other positions (same
// length), another theta or another head dim must rebuild them, and coming back must match the
// first call bit for bit.
TEST_CASE("rope follows changes of positions, theta and head dim between calls", "[rope]") {
  const int64_t B = 1, S = 6, H = 2;
  const IVec pos_a = {0, 1, 2, 3, 4, 5}, pos_b = {9, 3, 700, 4, 5, 6};
  struct Call {
    IVec pos;
    float theta;
    int64_t hd;
  };
  const Call calls[] = {{pos_a, 10000.0f, 8}, {pos_b, 10000.0f, 8}, {pos_b, 500.0f, 8}, {pos_b, 500.0f, 4},
                        {pos_a, 10000.0f, 8}};
  Vec first;
  for (const Call& c : calls) {
    const Vec x = randn(B * S * H * c.hd, 74);
    Tensor t = make({B, S, H, c.hd}, x);
    rope_forward(t, ints(c.pos), c.theta);
    REQUIRE(rel_err(host(t), rope_ref(dbl(x), c.pos, c.theta, B, S, H, c.hd)) <= 2e-6);
    if (first.empty()) first = host(t);
  }
  Tensor again = make({B, S, H, 8}, randn(B * S * H * 8, 74));
  rope_forward(again, ints(pos_a), 10000.0f);
  REQUIRE(bitwise_equal(host(again), first));
}

// ===== matmul and linear =========================================================================

TEST_CASE("matmul: every transpose, alpha and beta, odd sizes", "[matmul]") {
  const int64_t M = 17, N = 23, K = 31;
  const Vec A = randn(M * K, 81), B = randn(K * N, 82), C0 = randn(M * N, 83);
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      INFO("transA " << ta << " transB " << tb);
      Tensor tA = ta ? make({K, M}, A) : make({M, K}, A);
      Tensor tB = tb ? make({N, K}, B) : make({K, N}, B);
      Tensor C = make({M, N}, C0);
      matmul(C, tA, ta, tB, tb, 0.75f, 0.5f);
      DVec want = matmul_ref(dbl(A), ta, dbl(B), tb, M, N, K);
      for (int64_t i = 0; i < M * N; i++) want[i] = 0.75 * want[i] + 0.5 * C0[i];
      REQUIRE(rel_err(host(C), want) <= 1e-5);
      matmul(C, tA, ta, tB, tb);  // beta = 0 ignores C's old contents
      REQUIRE(rel_err(host(C), matmul_ref(dbl(A), ta, dbl(B), tb, M, N, K)) <= 1e-5);
    }
}

TEST_CASE("matmul with bf16 operands: fp32 and bf16 outputs", "[matmul][bf16]") {
  const int64_t M = 9, N = 11, K = 65;
  const Vec A = randn(M * K, 84), B = randn(K * N, 85), C0 = randn(M * N, 86);
  Tensor tA = make({M, K}, A, DType::BF16), tB = make({K, N}, B, DType::BF16);
  // The reference multiplies the same bf16-rounded operands, so fp32 accumulation is all that differs.
  const DVec want = matmul_ref(dbl(host(tA)), false, dbl(host(tB)), false, M, N, K);
  Tensor C = make({M, N}, C0);
  matmul(C, tA, false, tB, false, 1.0f, 1.0f);
  DVec acc = want;
  for (int64_t i = 0; i < M * N; i++) acc[i] += C0[i];
  REQUIRE(rel_err(host(C), acc) <= 1e-5);
  Tensor Cb = make({M, N}, C0, DType::BF16);
  matmul(Cb, tA, false, tB, false);
  REQUIRE(rel_err(host(Cb), want) <= 4e-3);  // one bf16 rounding of the result: 2^-8 relative
}

TEST_CASE("linear forward and backward on [B, S, in] activations", "[linear]") {
  const int64_t B = 3, S = 5, in = 19, out = 11, N = B * S;
  const Vec x = randn(N * in, 91), W = randn(out * in, 92), dy = randn(N * out, 93);
  const Vec dW0 = randn(out * in, 94), dx0 = randn(N * in, 95);
  Tensor tx = make({B, S, in}, x), tW = make({out, in}, W), tdy = make({B, S, out}, dy);
  Tensor y = Tensor::empty({B, S, out}, DType::F32, Device::CPU, Tag::Activations);
  linear_forward(y, tx, tW);
  REQUIRE(rel_err(host(y), matmul_ref(dbl(x), false, dbl(W), true, N, out, in)) <= 1e-5);
  Tensor dx = make({B, S, in}, dx0), dW = make({out, in}, dW0);
  const DVec dx_new = matmul_ref(dbl(dy), false, dbl(W), false, N, in, out);
  DVec dW_want = matmul_ref(dbl(dy), true, dbl(x), false, out, in, N);
  for (int64_t i = 0; i < out * in; i++) dW_want[i] += dW0[i];
  linear_backward(dx, dW, tdy, tx, tW);
  REQUIRE(rel_err(host(dx), dx_new) <= 1e-5);
  REQUIRE(rel_err(host(dW), dW_want) <= 1e-5);
  DVec dx_acc = dx_new;
  for (int64_t i = 0; i < N * in; i++) dx_acc[i] += dx_new[i];
  linear_backward(dx, Tensor(), tdy, tx, tW, /*accumulate_dx=*/true);
  REQUIRE(rel_err(host(dx), dx_acc) <= 1e-5);
}

// ===== attention =================================================================================

TEST_CASE("attention reference backward agrees with finite differences", "[attention]") {
  // Validates the double oracle itself before the kernels are held to it.
  const AttnDims a{1, 5, 4, 2, 3};
  const AttnCase c = attn_case(a, iota(5, 5), iota(5, 5), 100);
  DVec dq, dk, dv;
  attn_bwd_ref(dq, dk, dv, dbl(c.dout), dbl(c.q), dbl(c.k), dbl(c.v), a, c.qpos, c.kpos);
  auto fwd = [&](const DVec& q, const DVec& k, const DVec& v) { return attn_ref(q, k, v, a, c.qpos, c.kpos); };
  const DVec dO = dbl(c.dout);
  REQUIRE(rel_err(Vec(dq.begin(), dq.end()),
                  fd_grad([&](const DVec& q) { return fwd(q, dbl(c.k), dbl(c.v)); }, dbl(c.q), dO)) <= 1e-6);
  REQUIRE(rel_err(Vec(dk.begin(), dk.end()),
                  fd_grad([&](const DVec& k) { return fwd(dbl(c.q), k, dbl(c.v)); }, dbl(c.k), dO)) <= 1e-6);
  REQUIRE(rel_err(Vec(dv.begin(), dv.end()),
                  fd_grad([&](const DVec& v) { return fwd(dbl(c.q), dbl(c.k), v); }, dbl(c.v), dO)) <= 1e-6);
}

TEST_CASE("attention forward and backward: sequence lengths and GQA ratios", "[attention]") {
  for (int64_t S : {7, 33, 65}) {
    for (int64_t KVH : {4, 2, 1}) {
      const AttnDims a{2, S, 4, KVH, 12};
      INFO("S " << S << " H 4 KVH " << KVH);
      const IVec pos = iota(S, 5);  // positions offset by 5: masking must use positions, not indices
      const AttnCase c = attn_case(a, pos, pos, 200 + S * 10 + KVH);
      DVec lse, dq, dk, dv;
      const DVec out = attn_ref(dbl(c.q), dbl(c.k), dbl(c.v), a, pos, pos, &lse);
      attn_bwd_ref(dq, dk, dv, dbl(c.dout), dbl(c.q), dbl(c.k), dbl(c.v), a, pos, pos);
      const std::vector<Vec> got = run_attention(c, DType::F32);
      CHECK(rel_err(got[0], out) <= 1e-5);
      check_lse(got[1], lse, 1e-6);
      CHECK(rel_err(got[2], dq) <= 1e-5);
      CHECK(rel_err(got[3], dk) <= 1e-5);
      CHECK(rel_err(got[4], dv) <= 1e-5);
    }
  }
}

TEST_CASE("attention masks by positions: context-parallel chunks and fully masked rows", "[attention]") {
  // Queries hold zigzag chunks {0..3, 12..15}, keys the chunks {4..7, 8..11}: queries 0..3 see no
  // key (lse = -inf, zero output and gradient), queries 12..15 see all of them.
  const IVec qpos = {0, 1, 2, 3, 12, 13, 14, 15}, kpos = {4, 5, 6, 7, 8, 9, 10, 11};
  const AttnDims a{1, 8, 2, 1, 16};
  const AttnCase c = attn_case(a, qpos, kpos, 300);
  DVec lse, dq, dk, dv;
  const DVec out = attn_ref(dbl(c.q), dbl(c.k), dbl(c.v), a, qpos, kpos, &lse);
  attn_bwd_ref(dq, dk, dv, dbl(c.dout), dbl(c.q), dbl(c.k), dbl(c.v), a, qpos, kpos);
  const std::vector<Vec> got = run_attention(c, DType::F32);
  for (int64_t h = 0; h < 2; h++) REQUIRE(got[1][h * 8] == -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < 4 * 2 * 16; i++) REQUIRE((got[0][i] == 0.0f && got[2][i] == 0.0f));
  CHECK(rel_err(got[0], out) <= 1e-5);
  check_lse(got[1], lse, 1e-6);
  CHECK(rel_err(got[2], dq) <= 1e-5);
  CHECK(rel_err(got[3], dk) <= 1e-5);
  CHECK(rel_err(got[4], dv) <= 1e-5);
}

TEST_CASE("attention with large scores stays finite and exact", "[attention]") {
  const AttnDims a{1, 33, 2, 2, 8};
  AttnCase c = attn_case(a, iota(33, 0), iota(33, 0), 400);
  for (float& x : c.q) x *= 30.0f;  // scores of several hundred: softmax must subtract the max
  DVec lse;
  const DVec out = attn_ref(dbl(c.q), dbl(c.k), dbl(c.v), a, c.qpos, c.kpos, &lse);
  const std::vector<Vec> got = run_attention(c, DType::F32);
  for (float x : got[0]) REQUIRE(std::isfinite(x));
  CHECK(rel_err(got[0], out) <= 1e-5);
  check_lse(got[1], lse, 1e-6);
}

// ===== SwiGLU ====================================================================================

TEST_CASE("swiglu forward and backward", "[swiglu]") {
  const int64_t N = 7, F = 45;
  Vec g = randn(N * F, 501, 3.0f);
  g[0] = -100.0f;  // saturated sigmoid on both sides
  g[1] = 100.0f;
  const Vec u = randn(N * F, 502), dh = randn(N * F, 503);
  auto silu = [](double x) { return x / (1 + std::exp(-x)); };
  DVec h(N * F), dg(N * F), du(N * F);
  for (int64_t i = 0; i < N * F; i++) {
    const double s = 1 / (1 + std::exp(-double(g[i])));
    h[i] = silu(g[i]) * u[i];
    dg[i] = dh[i] * u[i] * s * (1 + g[i] * (1 - s));
    du[i] = dh[i] * silu(g[i]);
  }
  // Check the closed-form silu' against finite differences too.
  const DVec fd = fd_grad(
      [&](const DVec& gg) {
        DVec r(gg.size());
        for (size_t i = 0; i < gg.size(); i++) r[i] = silu(gg[i]) * u[i];
        return r;
      },
      dbl(g), dbl(dh));
  REQUIRE(rel_err(Vec(dg.begin(), dg.end()), fd) <= 1e-6);
  Tensor tg = make({N, F}, g), tu = make({N, F}, u);
  Tensor th = Tensor::empty({N, F}, DType::F32, Device::CPU, Tag::Activations);
  Tensor tdg = Tensor::empty({N, F}, DType::F32, Device::CPU, Tag::Activations);
  Tensor tdu = Tensor::empty({N, F}, DType::F32, Device::CPU, Tag::Activations);
  swiglu_forward(th, tg, tu);
  swiglu_backward(tdg, tdu, make({N, F}, dh), tg, tu);
  REQUIRE(rel_err(host(th), h) <= 1e-6);
  REQUIRE(rel_err(host(tdg), dg) <= 1e-6);
  REQUIRE(rel_err(host(tdu), du) <= 1e-6);
}

// ===== cross-entropy =============================================================================

namespace {
void ce_ref(DVec& loss, DVec& dl, const Vec& x, const IVec& t, double scale, int64_t N, int64_t V) {
  loss.assign(N, 0);
  dl.assign(N * V, 0);
  for (int64_t n = 0; n < N; n++) {
    double mx = -kInf, s = 0;
    for (int64_t j = 0; j < V; j++) mx = std::max(mx, double(x[n * V + j]));
    for (int64_t j = 0; j < V; j++) s += std::exp(x[n * V + j] - mx);
    loss[n] = mx + std::log(s) - x[n * V + t[n]];
    for (int64_t j = 0; j < V; j++) dl[n * V + j] = (std::exp(x[n * V + j] - mx) / s - (j == t[n])) * scale;
  }
}
}  // namespace

TEST_CASE("cross-entropy loss and gradient, including logits of +-80", "[cross_entropy]") {
  const int64_t N = 9, V = 257;
  Vec x = randn(N * V, 601, 2.0f);
  for (int64_t j = 0; j < V; j += 3) x[2 * V + j] = 80.0f;  // row 2: target at -80 among +80s
  for (int64_t j = 0; j < V; j++) x[3 * V + j] = j % 2 ? 80.0f : -80.0f;
  IVec t = {0, 256, 1, 0, 5, 100, 17, 3, 128};
  x[2 * V + 1] = -80.0f;
  const float scale = 1.0f / 9;
  DVec loss, dl;
  ce_ref(loss, dl, x, t, scale, N, V);
  Tensor losses = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Activations);
  Tensor dlog = Tensor::empty({N, V}, DType::F32, Device::CPU, Tag::Activations);
  cross_entropy_forward_backward(losses, dlog, make({N, V}, x), ints(t), scale);
  const Vec lg = host(losses), dg = host(dlog);
  for (float v : lg) REQUIRE(std::isfinite(v));
  for (float v : dg) REQUIRE(std::isfinite(v));
  REQUIRE(lg[2] > 159.0f);
  REQUIRE(rel_err(lg, loss) <= 1e-6);
  REQUIRE(rel_err(dg, dl) <= 1e-6);
}

TEST_CASE("cross-entropy: dlogits may alias logits; loss only without dlogits", "[cross_entropy]") {
  const int64_t N = 4, V = 31;
  const Vec x = randn(N * V, 611, 4.0f);
  const IVec t = {3, 30, 0, 7};
  DVec loss, dl;
  ce_ref(loss, dl, x, t, 1.0, N, V);
  Tensor logits = make({N, V}, x), losses = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Activations);
  cross_entropy_forward_backward(losses, Tensor(), logits, ints(t), 1.0f);
  REQUIRE(bitwise_equal(host(logits), x));
  REQUIRE(rel_err(host(losses), loss) <= 1e-6);
  cross_entropy_forward_backward(losses, logits, logits, ints(t), 1.0f);
  REQUIRE(rel_err(host(logits), dl) <= 1e-6);
  REQUIRE(rel_err(host(losses), loss) <= 1e-6);
  // Uniform logits: loss = log V exactly, whatever the common value.
  Tensor u = make({1, V}, Vec(V, 37.0f)), l1 = Tensor::empty({1}, DType::F32, Device::CPU, Tag::Activations);
  cross_entropy_forward_backward(l1, Tensor(), u, ints({4}), 1.0f);
  REQUIRE(std::fabs(host(l1)[0] - std::log(31.0)) <= 1e-6);
}

TEST_CASE("cross-entropy softmax is accurate element by element", "[cross_entropy]") {
  // Probabilities spanning 17 orders of magnitude, each checked relative to itself: the norm-wise
  // checks above would not notice an exp that is off by a part in a million on small entries.
  const int64_t V = 4001;
  Vec x(V);
  for (int64_t j = 0; j < V; j++) x[j] = -20.0f + 40.0f * float((j * 1237) % V) / float(V - 1);
  Tensor dl = Tensor::empty({1, V}, DType::F32, Device::CPU, Tag::Activations);
  Tensor loss = Tensor::empty({1}, DType::F32, Device::CPU, Tag::Activations);
  cross_entropy_forward_backward(loss, dl, make({1, V}, x), ints({0}), 1.0f);
  // The reference takes exp of the same fp32-rounded x - max as the kernel (that rounding alone is
  // worth |x - max| * 2^-24 = 2e-6 here); what remains is the exp and the normalisation.
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : x) mx = std::max(mx, v);
  double s = 0, worst = 0;
  for (float v : x) s += std::exp(double(v - mx));
  for (int64_t j = 1; j < V; j++) {
    const double p = std::exp(double(x[j] - mx)) / s;
    worst = std::max(worst, std::fabs(dl.f32()[j] - p) / p);
  }
  REQUIRE(worst <= 3e-7);  // about 2.5 fp32 ulps
}

// ===== vocabulary-parallel cross-entropy =========================================================

namespace {
// The three vocab-parallel steps over tp column blocks of logits [N, V] in one process (block r
// holds columns [r*V/tp, (r+1)*V/tp)), the host standing in for the tp collectives: MAX, then SUM in
// rank order. Each block's dlogits overwrite it (in place) and are reassembled into dl; every
// block must report the same losses, and the same again when it computes the losses alone.
void vocab_parallel_ce(Vec& losses, Vec& dl, const Vec& x, const IVec& t, int tp, DType dt, float scale,
                       int64_t N, int64_t V) {
  auto start = [&](int r) { return r * V / tp; };
  auto f32 = [](std::vector<int64_t> shape) {
    return Tensor::empty(std::move(shape), DType::F32, Device::CPU, Tag::Activations);
  };
  std::vector<Tensor> blocks;
  for (int r = 0; r < tp; r++) {
    const int64_t c0 = start(r), Vl = start(r + 1) - c0;
    Vec b(N * Vl);
    for (int64_t n = 0; n < N; n++) std::copy_n(x.begin() + n * V + c0, Vl, b.begin() + n * Vl);
    blocks.push_back(make({N, Vl}, b, dt));
  }
  const Tensor tg = ints(t);
  Vec M(N, -std::numeric_limits<float>::infinity()), S(2 * N, 0.0f);
  Tensor mx = f32({N}), stats = f32({2, N});
  for (int r = 0; r < tp; r++) {
    vocab_ce_max(mx, blocks[r]);
    for (int64_t n = 0; n < N; n++) M[n] = std::max(M[n], mx.f32()[n]);
  }
  const Tensor Mt = make({N}, M);
  for (int r = 0; r < tp; r++) {
    vocab_ce_stats(stats, blocks[r], Mt, tg, start(r));
    for (int64_t i = 0; i < 2 * N; i++) S[i] += stats.f32()[i];
  }
  const Tensor St = make({2, N}, S);
  dl.assign(N * V, 0.0f);
  for (int r = 0; r < tp; r++) {
    Tensor l = f32({N});
    vocab_ce_finish(l, Tensor(), blocks[r], Mt, St, tg, start(r), scale);
    const Vec alone = host(l);
    vocab_ce_finish(l, blocks[r], blocks[r], Mt, St, tg, start(r), scale);
    if (r == 0) losses = host(l);
    REQUIRE(bitwise_equal(host(l), losses));
    REQUIRE(bitwise_equal(alone, losses));
    const int64_t c0 = start(r), Vl = start(r + 1) - c0;
    const Vec d = host(blocks[r]);
    for (int64_t n = 0; n < N; n++) std::copy_n(d.begin() + n * Vl, Vl, dl.begin() + n * V + c0);
  }
}
}  // namespace

TEST_CASE("vocab-parallel cross-entropy over tp blocks equals the fused kernel", "[cross_entropy]") {
  // Targets only in the first and last quarter of the vocabulary, so that at tp = 4 the middle
  // blocks own none; rows of +-80 where a block's own max would overflow exp or underflow its sum.
  const int64_t N = 9;
  for (int64_t V : {64, 97})  // 97: blocks of unequal width
    for (DType dt : {DType::F32, DType::BF16})
      for (int tp : {1, 2, 4}) {
        INFO("V " << V << " tp " << tp << " " << dtype_name(dt));
        Vec x = randn(N * V, 621 + V, 3.0f);
        IVec t(N);
        for (int64_t n = 0; n < N; n++) t[n] = int32_t(n % 2 ? (n * 5) % (V / 4) : V - 1 - (n * 3) % (V / 4));
        for (int64_t j = 0; j < V; j += 3) x[2 * V + j] = 80.0f;  // row 2: target at -80 among +80s
        t[2] = 1;
        x[2 * V + 1] = -80.0f;
        for (int64_t j = 0; j < V; j++) x[3 * V + j] = j % 2 ? 80.0f : -80.0f;
        for (int64_t j = 0; j < V; j++) x[6 * V + j] = j == V - 2 ? 80.0f : -80.0f;  // one +80, in the last block
        const float scale = 1.0f / N;
        Tensor fl = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Activations), fd = make({N, V}, x, dt);
        cross_entropy_forward_backward(fl, fd, fd, ints(t), scale);
        Vec losses, dl;
        vocab_parallel_ce(losses, dl, x, t, tp, dt, scale, N, V);
        const Vec want_l = host(fl), want_d = host(fd);
        REQUIRE(want_l[2] > 159.0f);
        // Only S differs from the fused kernel's: summed in fp32 over the blocks and rounded to fp32
        // before 1/S. Losses: 1e-6 norm-wise relative. dlogits: 2e-7 * grad_scale absolute (about two
        // fp32 ulps of 1); in bf16 one bf16 step, 2^-8, where a last-bit difference flips the rounding.
        CHECK(rel_err(losses, want_l) <= 1e-6);
        double worst = 0;
        for (int64_t i = 0; i < N * V; i++) worst = std::max(worst, std::fabs(double(dl[i]) - want_d[i]) / scale);
        CHECK(worst <= (dt == DType::BF16 ? 1.0 / 256 : 2e-7));
      }
}

// ===== optimizer and norms =======================================================================

TEST_CASE("adamw: bias correction, decoupled decay, grad scale, bf16 copy", "[adamw]") {
  const int64_t n = 1003;
  const AdamWParams base{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0};
  for (bool decay : {true, false}) {
    INFO("decay " << decay);
    Vec p0 = randn(n, 701), g = randn(n, 702);
    Tensor p = make({n}, p0), m = Tensor::zeros({n}, DType::F32, Device::CPU, Tag::Optimizer);
    Tensor v = Tensor::zeros({n}, DType::F32, Device::CPU, Tag::Optimizer);
    Tensor pc = Tensor::empty({n}, DType::BF16, Device::CPU, Tag::Params);
    DVec P = dbl(p0), Mv(n, 0), Vv(n, 0);
    for (long step = 1; step <= 3; step++) {
      AdamWParams hp = base;
      hp.step = step;
      const float gs = 0.5f * float(step);
      adamw_step(p, make({n}, g), m, v, hp, decay, gs, pc);
      for (int64_t i = 0; i < n; i++) {
        const double gi = double(g[i]) * gs;
        Mv[i] = 0.9 * Mv[i] + 0.1 * gi;
        Vv[i] = 0.95 * Vv[i] + 0.05 * gi * gi;
        const double mhat = Mv[i] / (1 - std::pow(0.9, step)), vhat = Vv[i] / (1 - std::pow(0.95, step));
        P[i] -= 1e-2 * (mhat / (std::sqrt(vhat) + 1e-8) + (decay ? 0.1 * P[i] : 0.0));
      }
      for (int64_t i = 0; i < n; i++) g[i] = g[(i * 7 + 1) % n];  // a different gradient each step
    }
    REQUIRE(rel_err(host(p), P) <= 1e-6);
    REQUIRE(rel_err(host(m), Mv) <= 1e-6);
    REQUIRE(rel_err(host(v), Vv) <= 1e-6);
    for (int64_t i = 0; i < n; i++) REQUIRE(pc.b16()[i].bits == float_to_bf16(p.f32()[i]).bits);
  }
}

TEST_CASE("sum_squares in double, independent of thread count", "[norms]") {
  const int64_t n = (1 << 17) + 12345;  // several fixed chunks and a ragged end
  const Vec x = randn(n, 801, 3.0f);
  double want = 0;
  for (float v : x) want += double(v) * v;
  Tensor t = make({n}, x);
  double one = 0, two = 0;
  with_threads(1, [&] { one = sum_squares(t); });
  with_threads(2, [&] { two = sum_squares(t); });
  REQUIRE(std::fabs(one - want) <= 1e-12 * want);
  REQUIRE(memcmp(&one, &two, sizeof one) == 0);
}

// ===== counter-based init ========================================================================

TEST_CASE("init_normal: a slice alone equals that slice of the full tensor", "[rng]") {
  const int64_t R = 37, C = 29;
  const uint64_t key = rng_key(1234, "model.layers.0.mlp.up_proj.weight");
  Tensor full = Tensor::empty({R, C}, DType::F32, Device::CPU, Tag::Params);
  init_normal(full, key, 0.02f, 0, 0, C);
  const Vec F = host(full);
  REQUIRE(F[0] == 0.02f * rng_normal(key, 0));
  REQUIRE(F[5 * C + 7] == 0.02f * rng_normal(key, 5 * C + 7));
  struct Block {
    int64_t r0, rows, c0, cols;
  };
  // Row slices (TP row/vocab shards), column slices (TP column shards), 2-D blocks, single cells.
  for (const Block& b : {Block{5, 10, 0, C}, Block{0, R, 11, 8}, Block{20, 9, 13, 7}, Block{36, 1, 28, 1},
                         Block{0, R, 0, C}}) {
    INFO("rows [" << b.r0 << ", +" << b.rows << ") cols [" << b.c0 << ", +" << b.cols << ")");
    Tensor s = Tensor::empty({b.rows, b.cols}, DType::F32, Device::CPU, Tag::Params);
    init_normal(s, key, 0.02f, b.r0, b.c0, C);
    const Vec got = host(s);
    for (int64_t r = 0; r < b.rows; r++)
      for (int64_t c = 0; c < b.cols; c++) REQUIRE(got[r * b.cols + c] == F[(b.r0 + r) * C + b.c0 + c]);
  }
  // 1-D tensors: col0 is the offset into the flat global tensor (ZeRO-style ranges).
  const int64_t n = 1000;
  Tensor f1 = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Params);
  init_normal(f1, key, 1.0f, 0, 0, n);
  for (int64_t off : {0, 250, 999}) {
    Tensor s = Tensor::empty({std::min<int64_t>(100, n - off)}, DType::F32, Device::CPU, Tag::Params);
    init_normal(s, key, 1.0f, 0, off, n);
    for (int64_t i = 0; i < s.numel(); i++) REQUIRE(s.f32()[i] == f1.f32()[off + i]);
  }
  // A view into a flat buffer initialises in place.
  Tensor flat = Tensor::zeros({3 + R * C}, DType::F32, Device::CPU, Tag::Params);
  init_normal(flat.view(3, {R, C}), key, 0.02f, 0, 0, C);
  REQUIRE(flat.f32()[0] == 0.0f);
  REQUIRE(memcmp(flat.f32() + 3, F.data(), F.size() * 4) == 0);
}

TEST_CASE("init_normal samples have mean 0 and std 1", "[rng]") {
  const int64_t n = 1 << 18;
  Tensor t = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Params);
  init_normal(t, rng_key(7, "stats"), 1.0f, 0, 0, n);
  double s = 0, s2 = 0, inside = 0;
  for (int64_t i = 0; i < n; i++) {
    const double x = t.f32()[i];
    s += x;
    s2 += x * x;
    inside += std::fabs(x) < 1.0;
  }
  const double mean = s / n, sd = std::sqrt(s2 / n - mean * mean);
  CHECK(std::fabs(mean) < 0.01);  // standard error 0.002
  CHECK(std::fabs(sd - 1.0) < 0.01);
  CHECK(std::fabs(inside / n - 0.6827) < 0.005);  // the normal's one-sigma mass
  // A different name gives a different stream.
  Tensor u = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Params);
  init_normal(u, rng_key(7, "stats2"), 1.0f, 0, 0, n);
  CHECK_FALSE(bitwise_equal(host(t), host(u)));
}

// ===== allocator =================================================================================

TEST_CASE("allocator: per-category current, peak and at-peak bytes", "[memory]") {
  mem_reset_peaks(Device::CPU);
  const MemStats base = mem_stats(Device::CPU);
  auto cur = [&](Tag t) { return mem_stats(Device::CPU).current[int(t)] - base.current[int(t)]; };
  auto peak = [&](Tag t) { return mem_stats(Device::CPU).peak[int(t)] - base.current[int(t)]; };
  auto at_peak = [&](Tag t) { return mem_stats(Device::CPU).at_peak[int(t)] - base.current[int(t)]; };
  {
    Tensor p = Tensor::empty({1000}, DType::F32, Device::CPU, Tag::Params);   // 4000
    Tensor g = Tensor::empty({500}, DType::BF16, Device::CPU, Tag::Grads);    // 1000
    Tensor v = p.view(10, {20});                                              // a view allocates nothing
    {
      Tensor w = Tensor::empty({3000}, DType::F32, Device::CPU, Tag::Workspace);  // 12000: the total peak
      REQUIRE(cur(Tag::Workspace) == 12000);
    }
    Tensor o = Tensor::empty({2000}, DType::F32, Device::CPU, Tag::Optimizer);  // 8000, total below peak
    CHECK(cur(Tag::Params) == 4000);
    CHECK(cur(Tag::Grads) == 1000);
    CHECK(cur(Tag::Workspace) == 0);
    CHECK(cur(Tag::Optimizer) == 8000);
    CHECK(peak(Tag::Workspace) == 12000);
    CHECK(peak(Tag::Optimizer) == 8000);
    CHECK(at_peak(Tag::Params) == 4000);
    CHECK(at_peak(Tag::Grads) == 1000);
    CHECK(at_peak(Tag::Workspace) == 12000);
    CHECK(at_peak(Tag::Optimizer) == 0);
    CHECK(mem_stats(Device::CPU).total_peak - base.total_current == 17000);
    CHECK(mem_stats(Device::CPU).total_current - base.total_current == 13000);
    (void)v;
  }
  CHECK(cur(Tag::Params) == 0);
  CHECK(mem_stats(Device::CPU).total_current == base.total_current);
  mem_reset_peaks(Device::CPU);
  CHECK(mem_stats(Device::CPU).total_peak == base.total_current);
  CHECK(mem_stats(Device::CPU).peak[int(Tag::Workspace)] == base.current[int(Tag::Workspace)]);
}

TEST_CASE("allocator: reserved counts rounded blocks and cached free ones, the categories only tensors", "[memory]") {
  const MemStats& s = mem_stats(Device::CPU);
  const int64_t n = 12347;                    // 49388 B, a size no other test allocates
  const size_t bytes = 4 * n, block = 49408;  // its block: rounded up to a multiple of 256
  const size_t used0 = s.total_current, held0 = s.reserved;
  CHECK(held0 >= used0);
  {
    Tensor a = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Workspace);
    CHECK(s.total_current - used0 == bytes);
    CHECK(s.reserved - held0 == block);
  }
  CHECK(s.total_current == used0);      // freed: no longer in use...
  CHECK(s.reserved - held0 == block);   // ...but cached, so still held
  {
    Tensor a = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Workspace);  // the cached block
    CHECK(s.reserved - held0 == block);
    Tensor b = Tensor::empty({n}, DType::F32, Device::CPU, Tag::Workspace);  // a new one
    CHECK(s.reserved - held0 == 2 * block);
    CHECK(s.reserved_peak >= s.reserved);
  }
  mem_reset_peaks(Device::CPU);
  CHECK(s.reserved_peak == s.reserved);
}

TEST_CASE("allocator: sizes of one block share it; eight block sizes per power of two above 64 KiB", "[memory]") {
  CHECK(mem_block_size(1) == 256);
  CHECK(mem_block_size(65536) == 65536);
  CHECK(mem_block_size(65537) == 65536 + 8192);            // octave 64 KiB: steps of 8 KiB
  CHECK(mem_block_size(300000) == 327680);                  // octave 256 KiB: steps of 32 KiB
  CHECK(mem_block_size(310000) == 327680);
  CHECK(mem_block_size((size_t(1) << 30) + 1) == (size_t(1) << 30) + (size_t(1) << 27));
  for (size_t b = 1; b < (size_t(1) << 24); b = b * 3 / 2 + 7) {  // never smaller, at most 12.5% (or 255 B) more
    INFO(b);
    CHECK(mem_block_size(b) >= b);
    CHECK(mem_block_size(b) <= std::max(b + 255, b + b / 8));
  }
  // Two tensors of different sizes in one block: the second takes the block the first freed.
  const MemStats& s = mem_stats(Device::CPU);
  const size_t held0 = s.reserved;
  { Tensor a = Tensor::empty({75001}, DType::F32, Device::CPU, Tag::Workspace); }  // 300004 B
  const size_t held1 = s.reserved;  // a new block, or one an earlier case freed
  CHECK((held1 == held0 || held1 - held0 == 327680));
  { Tensor b = Tensor::empty({77003}, DType::F32, Device::CPU, Tag::Workspace); }  // 308012 B
  CHECK(s.reserved == held1);
}

// ===== every op at once: determinism, thread counts, bf16 ========================================

namespace {
struct Named {
  std::string name;
  Vec v;
};

// A miniature training step through every op at awkward sizes, activations in dt. Inputs are the
// same fp32 values for both dtypes (rounded on the way into bf16 tensors).
std::vector<Named> run_all_ops(DType dt) {
  const int64_t B = 2, S = 33, H = 4, KVH = 2, hd = 8, D = H * hd, F = 45, V = 37, N = B * S;
  const float eps = 1e-5f;
  auto act = [&](std::vector<int64_t> shape, uint64_t seed, float sd = 1.0f) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return make(std::move(shape), randn(n, seed, sd), dt);
  };
  auto like = [&](const Tensor& t) { return Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Activations); };
  auto f32 = [](std::vector<int64_t> shape) { return Tensor::zeros(std::move(shape), DType::F32, Device::CPU, Tag::Grads); };
  std::vector<Named> r;
  IVec tokv(N);
  for (int64_t n = 0; n < N; n++) tokv[n] = int32_t((n * 11 + 3) % V);
  Tensor tok = ints(tokv), pos = ints(iota(S, 5));

  Tensor table = act({V, D}, 1), x = act({N, D}, 2);
  embedding_forward(x, table, tok);
  Tensor dtable = f32({V, D});
  embedding_backward(dtable, act({N, D}, 3), tok);
  r.push_back({"embedding_forward", host(x)});
  r.push_back({"embedding_backward", host(dtable)});

  Tensor w = make({D}, randn(D, 4, 0.3f)), y = like(x), rstd = f32({N}), dx = like(x), dw = f32({D});
  rmsnorm_forward(y, rstd, x, w, eps);
  rmsnorm_backward(dx, dw, act({N, D}, 5), x, w, rstd);
  r.push_back({"rmsnorm_forward", host(y)});
  r.push_back({"rmsnorm_backward dx", host(dx)});
  r.push_back({"rmsnorm_backward dw", host(dw)});

  Tensor Wq = act({D, D}, 6, 0.2f), Wk = act({KVH * hd, D}, 7, 0.2f), Wv = act({KVH * hd, D}, 8, 0.2f);
  Tensor q = Tensor::empty({B, S, H, hd}, dt, Device::CPU, Tag::Activations);
  Tensor k = Tensor::empty({B, S, KVH, hd}, dt, Device::CPU, Tag::Activations), v = like(k);
  linear_forward(q.reshape({N, D}), y, Wq);
  linear_forward(k.reshape({N, KVH * hd}), y, Wk);
  linear_forward(v.reshape({N, KVH * hd}), y, Wv);
  r.push_back({"linear_forward", host(q)});
  rope_forward(q, pos, 10000.0f);
  rope_forward(k, pos, 10000.0f);
  r.push_back({"rope_forward", host(q)});
  Tensor o = like(q), lse = f32({B, H, S}), dq = like(q), dk = like(k), dv = like(k);
  attention_forward(o, lse, q, k, v, pos, pos);
  attention_backward(dq, dk, dv, act({B, S, H, hd}, 9), o, lse, q, k, v, pos, pos);
  r.push_back({"attention_forward", host(o)});
  r.push_back({"attention lse", host(lse)});
  r.push_back({"attention_backward dq", host(dq)});
  r.push_back({"attention_backward dk", host(dk)});
  r.push_back({"attention_backward dv", host(dv)});
  rope_backward(dq, pos, 10000.0f);
  r.push_back({"rope_backward", host(dq)});
  Tensor dWq = f32({D, D}), dy_in = like(y);
  linear_backward(dy_in, dWq, dq.reshape({N, D}), y, Wq);
  r.push_back({"linear_backward dx", host(dy_in)});
  r.push_back({"linear_backward dW", host(dWq)});

  Tensor g = act({N, F}, 10), u = act({N, F}, 11), hgl = like(g), dg = like(g), du = like(g);
  swiglu_forward(hgl, g, u);
  swiglu_backward(dg, du, act({N, F}, 12), g, u);
  r.push_back({"swiglu_forward", host(hgl)});
  r.push_back({"swiglu_backward dg", host(dg)});
  r.push_back({"swiglu_backward du", host(du)});

  Tensor logits = act({N, V}, 13, 3.0f), losses = f32({N});
  cross_entropy_forward_backward(losses, logits, logits, tok, 1.0f / N);
  r.push_back({"cross_entropy loss", host(losses)});
  r.push_back({"cross_entropy dlogits", host(logits)});
  // One vocabulary shard starting at row 10: rows whose target is below it own no target.
  Tensor shard = act({N, V}, 15, 3.0f), mx = f32({N}), stats = f32({2, N}), vlosses = f32({N});
  vocab_ce_max(mx, shard);
  vocab_ce_stats(stats, shard, mx, tok, 10);
  vocab_ce_finish(vlosses, shard, shard, mx, stats, tok, 10, 1.0f / N);
  r.push_back({"vocab_ce stats", host(stats)});
  r.push_back({"vocab_ce loss", host(vlosses)});
  r.push_back({"vocab_ce dlogits", host(shard)});

  Tensor s = like(x);
  add(s, x, y);
  add_inplace(s, dx);
  scale_inplace(s, 0.37f);
  r.push_back({"add/add_inplace/scale_inplace", host(s)});
  Tensor p = make({D * D}, randn(D * D, 14)), pc = Tensor::empty({D * D}, dt, Device::CPU, Tag::Params);
  Tensor m = f32({D * D}), vv = f32({D * D});
  adamw_step(p, dWq.reshape({D * D}), m, vv, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1}, true, 0.8f, pc);
  r.push_back({"adamw param_copy", host(pc)});
  r.push_back({"sum_squares", {float(sum_squares(dWq))}});
  return r;
}

void require_bitwise(const std::vector<Named>& a, const std::vector<Named>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); i++) {
    INFO(a[i].name);
    CHECK(bitwise_equal(a[i].v, b[i].v));
  }
}
}  // namespace

TEST_CASE("every op is bitwise reproducible run to run", "[determinism]") {
  require_bitwise(run_all_ops(DType::F32), run_all_ops(DType::F32));
  require_bitwise(run_all_ops(DType::BF16), run_all_ops(DType::BF16));
}

TEST_CASE("every op gives the same bits with 1 and 2 threads", "[determinism]") {
  std::vector<Named> one, two;
  for (DType dt : {DType::F32, DType::BF16}) {
    with_threads(1, [&] { one = run_all_ops(dt); });
    with_threads(2, [&] { two = run_all_ops(dt); });
    require_bitwise(one, two);
  }
}

TEST_CASE("every op with bf16 activations stays within 1e-2 of fp32", "[bf16]") {
  const std::vector<Named> f = run_all_ops(DType::F32), b = run_all_ops(DType::BF16);
  REQUIRE(f.size() == b.size());
  for (size_t i = 0; i < f.size(); i++) {
    INFO(f[i].name);
    CHECK(rel_err(b[i].v, f[i].v) <= 1e-2);
  }
}

TEST_CASE("bad arguments are named in the error (checked shapes compose)", "[validation]") {
  // fatal() ends the process, so only the accepting side is testable here: shapes that do compose
  // in unusual ways are accepted, e.g. a [B, S, D] left operand against [D, out] weights.
  Tensor x = make({2, 3, 4}, randn(24, 901)), W = make({4, 5}, randn(20, 902));
  Tensor y = Tensor::empty({2, 3, 5}, DType::F32, Device::CPU, Tag::Activations);
  matmul(y, x, false, W, false);
  REQUIRE(rel_err(host(y), matmul_ref(dbl(host(x)), false, dbl(host(W)), false, 6, 5, 4)) <= 1e-6);
}

TEST_CASE("sum_squares_each gives each tensor's sum_squares, bit for bit", "[norm]") {
  std::vector<Tensor> xs = {make({1000}, randn(1000, 61)), make({1}, {3.f}), make({70001}, randn(70001, 62))};
  const std::vector<double> each = sum_squares_each(xs);
  REQUIRE(each.size() == 3);
  for (size_t i = 0; i < xs.size(); i++) CHECK(each[i] == sum_squares(xs[i]));
  CHECK(each[1] == 9.0);
  CHECK(sum_squares_each({}).empty());
}

// ===== the tuned CPU kernels against their references ============================================

namespace {
Tensor clone(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor r = Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Workspace);
  copy(r, t);
  return r;
}

// The largest difference a test allows between a tuned kernel and its reference: absolute, and
// relative to the largest reference value (norm-wise, robust where single entries are near 0).
struct Tol {
  double abs, rel;
};

// Runs the tuned kernel (the op of kernels.h, which dispatches to kernels_cpu.cu) and its plain-loop
// reference (ts::ref, kernels_ref.cu) on separate copies of the same tensors, inputs and pre-filled
// outputs, and requires every tensor at the indices in outs to agree within f32 or bf16 (by that
// output's dtype). Equal infinities (the lse of a row with no visible key) agree.
void vs_ref(const char* name, const std::vector<Tensor>& ts, const std::vector<int>& outs,
            const std::function<void(const std::vector<Tensor>&)>& fast,
            const std::function<void(const std::vector<Tensor>&)>& reference, Tol f32, Tol bf16) {
  std::vector<Tensor> f, r;
  for (const Tensor& t : ts) {
    f.push_back(clone(t));
    r.push_back(clone(t));
  }
  fast(f);
  reference(r);
  for (int i : outs) {
    const Vec got = host(f[i]), want = host(r[i]);
    double diff = 0, scale = 1e-30;
    for (size_t j = 0; j < got.size(); j++) {
      if (std::isfinite(want[j])) scale = std::max(scale, std::fabs(double(want[j])));
      if (got[j] != want[j]) diff = std::max(diff, std::isfinite(want[j]) ? std::fabs(double(got[j]) - want[j]) : kInf);
    }
    const Tol tol = f[i].dtype == DType::BF16 ? bf16 : f32;
    INFO(name << ": output " << i << " " << r[i].str() << ": max abs diff " << diff << ", relative " << diff / scale);
    CHECK(diff <= tol.abs);
    CHECK(diff / scale <= tol.rel);
  }
}

Tensor empty_like(const Tensor& t) { return make(t.shape, Vec(t.numel(), 0.0f), t.dtype); }
}  // namespace

// Tolerances. The reference sums every product in double and takes std::exp; the tuned kernels sum
// in fp32 in their own order (vector lanes, register tiles, BLAS blocks) and use exp_approx
// (~1 ulp), so they differ by their fp32 rounding: with inputs of order 1 and sums of at most a
// few hundred terms, a few 1e-7 relative (measured: attention 7e-7, matmul 7e-7, RMSNorm 1e-7,
// RoPE 8e-8, cross-entropy 2e-8). Each relative bound below is 3 to 6 times the largest difference
// measured (cross-entropy's allows one fp32 ulp of its largest loss), and each absolute bound scales
// with the size of the outputs (a matmul's |C| grows as sqrt(K), attention's dK/dV sum the heads of
// a GQA group). A real bug (a wrong mask, a missed GQA head, a transposed operand, a lost scale)
// moves results by 1e-1 or more, and even a 1e-4 slip in one factor breaks the relative bounds 30
// times over. In bf16 the outputs are rounded to 8 bits of mantissa and a last-bit difference in
// fp32 can flip that rounding: one bf16 step, 2^-8 relative (2^-8 times the largest output).
TEST_CASE("tuned attention equals the reference: GQA, positions, fully masked rows, fp32 and bf16",
          "[attention][ref]") {
  struct Case {
    AttnDims a;
    IVec qpos, kpos;
  };
  std::vector<Case> cases;
  for (int64_t KVH : {4, 2, 1}) cases.push_back({{2, 37, 4, KVH, 24}, iota(37, 5), iota(37, 5)});  // causal
  cases.push_back({{1, 70, 8, 2, 16}, iota(70, 0), iota(70, 0)});                                  // > 2 tiles
  IVec zq(19), zk(19);  // context-parallel chunks: rows 0..4 see no key, the rest some or all
  for (int64_t i = 0; i < 19; i++) zq[i] = int32_t(i < 5 ? i : 40 + 3 * i), zk[i] = int32_t(10 + 5 * i);
  cases.push_back({{2, 19, 6, 3, 8}, zq, zk});
  for (DType dt : {DType::F32, DType::BF16})
    for (size_t n = 0; n < cases.size(); n++) {
      const AttnDims& a = cases[n].a;
      INFO("case " << n << " S " << a.S << " H " << a.H << " KVH " << a.KVH << " hd " << a.hd << " " << dtype_name(dt));
      const AttnCase c = attn_case(a, cases[n].qpos, cases[n].kpos, 700 + 10 * n);
      Tensor q = make({a.B, a.S, a.H, a.hd}, c.q, dt), k = make({a.B, a.S, a.KVH, a.hd}, c.k, dt);
      Tensor v = make({a.B, a.S, a.KVH, a.hd}, c.v, dt), dout = make({a.B, a.S, a.H, a.hd}, c.dout, dt);
      Tensor qp = ints(c.qpos), kp = ints(c.kpos), out = empty_like(q), dq = empty_like(q);
      Tensor lse = make({a.B, a.H, a.S}, Vec(a.B * a.H * a.S, 0.0f)), dk = empty_like(k), dv = empty_like(k);
      vs_ref("attention_forward", {out, lse, q, k, v, qp, kp}, {0, 1},
             [](auto& t) { attention_forward(t[0], t[1], t[2], t[3], t[4], t[5], t[6]); },
             [](auto& t) { ref::attention_forward(t[0], t[1], t[2], t[3], t[4], t[5], t[6]); }, {2e-6, 1e-6},
             {1.0 / 64, 1.0 / 256});
      attention_forward(out, lse, q, k, v, qp, kp);  // both backwards start from the same out, lse
      vs_ref("attention_backward", {dq, dk, dv, dout, out, lse, q, k, v, qp, kp}, {0, 1, 2},
             [](auto& t) { attention_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10]); },
             [](auto& t) {
               ref::attention_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10]);
             },
             {2e-5, 3e-6}, {1.0 / 16, 1.0 / 256});
    }
}

TEST_CASE("tuned rmsnorm, rope and embedding backward equal the reference", "[rmsnorm][rope][embedding][ref]") {
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    const Tol f32{4e-6, 5e-7}, bf16{1.0 / 64, 1.0 / 256};
    const int64_t N = 13, D = 77;
    Tensor x = make({N, D}, randn(N * D, 801, 2.0f), dt), dy = make({N, D}, randn(N * D, 802), dt);
    Tensor w = make({D}, randn(D, 803)), y = empty_like(x), dx = empty_like(x);
    Tensor rstd = make({N}, Vec(N, 0.0f)), dw = make({D}, randn(D, 804));
    vs_ref("rmsnorm_forward", {y, rstd, x, w}, {0, 1}, [](auto& t) { rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-5f); },
           [](auto& t) { ref::rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-5f); }, f32, bf16);
    rmsnorm_forward(y, rstd, x, w, 1e-5f);
    vs_ref("rmsnorm_backward", {dx, dw, dy, x, w, rstd}, {0, 1},
           [](auto& t) { rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]); },
           [](auto& t) { ref::rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]); }, f32, bf16);
    const int64_t B = 2, S = 11, H = 3, hd = 20;
    Tensor r = make({B, S, H, hd}, randn(B * S * H * hd, 805), dt), pos = ints(iota(S, 1000));
    for (float theta : {10000.0f, 500000.0f}) {
      vs_ref("rope_forward", {r, pos}, {0}, [=](auto& t) { rope_forward(t[0], t[1], theta); },
             [=](auto& t) { ref::rope_forward(t[0], t[1], theta); }, f32, bf16);
      vs_ref("rope_backward", {r, pos}, {0}, [=](auto& t) { rope_backward(t[0], t[1], theta); },
             [=](auto& t) { ref::rope_backward(t[0], t[1], theta); }, f32, bf16);
    }
    // Both add each row's tokens in token order in fp32: the same sums, bit for bit.
    const int64_t V = 70, T = 300;
    IVec tk(T);
    for (int64_t i = 0; i < T; i++) tk[i] = int32_t(3 + (i * 37) % (V + 9));  // some outside the shard
    Tensor dtable = make({V, 9}, randn(V * 9, 806)), dout_e = make({T, 9}, randn(T * 9, 807), dt), tok = ints(tk);
    vs_ref("embedding_backward", {dtable, dout_e, tok}, {0}, [](auto& t) { embedding_backward(t[0], t[1], t[2], 5); },
           [](auto& t) { ref::embedding_backward(t[0], t[1], t[2], 5); }, {0, 0},
           {0, 0});
  }
}

TEST_CASE("tuned matmul equals the reference: transposes, alpha and beta, panels, bf16", "[matmul][ref]") {
  struct Dims {
    int64_t M, N, K;
  };
  // OpenBLAS on one thread, so that the tuned matmul cuts C into its panels (300 rows: two).
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  for (Dims d : {Dims{37, 29, 45}, Dims{300, 150, 200}, Dims{1, 17, 3}})
    for (DType dt : {DType::F32, DType::BF16})
      for (DType ct : {DType::F32, dt})
        for (int tr = 0; tr < 4; tr++) {
          const bool ta = tr & 1, tb = tr & 2;
          INFO("M " << d.M << " N " << d.N << " K " << d.K << " A^T " << ta << " B^T " << tb << " " << dtype_name(dt)
                    << " C " << dtype_name(ct));
          Tensor A = make(ta ? std::vector<int64_t>{d.K, d.M} : std::vector<int64_t>{d.M, d.K},
                          randn(d.M * d.K, 811 + tr), dt);
          Tensor B = make(tb ? std::vector<int64_t>{d.N, d.K} : std::vector<int64_t>{d.K, d.N},
                          randn(d.N * d.K, 812 + tr), dt);
          Tensor C = make({d.M, d.N}, randn(d.M * d.N, 813), ct);
          // Sums of K products of unit normals: |C| up to ~4 sqrt(K), 60 at K = 200.
          const Tol f32{1e-5 * std::sqrt(double(d.K)), 3e-6}, bf16{std::sqrt(double(d.K)) / 64, 1.0 / 256};
          vs_ref("matmul", {C, A, B}, {0}, [=](auto& t) { matmul(t[0], t[1], ta, t[2], tb, 0.5f, 0.7f); },
                 [=](auto& t) { ref::matmul(t[0], t[1], ta, t[2], tb, 0.5f, 0.7f); }, f32, bf16);
          vs_ref("matmul beta 0", {C, A, B}, {0}, [=](auto& t) { matmul(t[0], t[1], ta, t[2], tb, 1.0f, 0.0f); },
                 [=](auto& t) { ref::matmul(t[0], t[1], ta, t[2], tb, 1.0f, 0.0f); }, f32, bf16);
        }
  openblas_set_num_threads(blas_threads);
}

// ----- the bf16 GEMM paths (kernels_bf16.h) -----------------------------------------------------

// C [M, N] = alpha · op(A) · op(B) + beta · C0 by the widening path: both bf16 operands widened to
// fp32, one cblas_sgemm (the path every CPU runs, and the reference the bf16 paths are held to).
Vec widened_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const Tensor& A, const Tensor& B,
                 float beta, const Vec& C0) {
  const Vec a = host(A), b = host(B);
  Vec c = C0;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(M), int(N), int(K),
              alpha, a.data(), int(A.size(-1)), b.data(), int(B.size(-1)), beta, c.data(), int(N));
  return c;
}

Vec path_gemm(cpu::Bf16Gemm p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const Tensor& A,
              const Tensor& B, float beta, const Vec& C0) {
  Vec c = C0;
  cpu::bf16_gemm(p, ta, tb, M, N, K, alpha, A.b16(), A.size(-1), B.b16(), B.size(-1), beta, c.data());
  return c;
}

// Each bf16 path the CPU runs, against the widening path. Both form every product exactly (two
// bf16 values) and add in fp32, in different orders: an fp32 sum of K terms in any order is within
// γ_K · Σ|terms| of the exact one (γ_K = K·u / (1 − K·u), u = 2^-24; Higham, "Accuracy and
// Stability of Numerical Algorithms", 3.1), so the two differ by at most 2γ_K · |alpha| · Σ|a||b|
// plus the roundings of alpha·sum and of + beta·C (2u of each side's magnitude). With small
// integers every partial sum is an integer below 2^24, exact in any order: the bits must agree.
TEST_CASE("bf16 GEMM paths equal the widening path: exact on integers, within the fp32 bound, any threads",
          "[matmul][bf16][ref]") {
  struct Dims {
    int64_t M, N, K;
  };
  int ran = 0;
  for (cpu::Bf16Gemm p : {cpu::Bf16Gemm::Avx512Bf16, cpu::Bf16Gemm::Amx}) {
    if (!cpu::bf16_gemm_available(p)) {
      WARN("bf16 GEMM path " << cpu::bf16_gemm_name(p) << " not checked: this CPU (or its kernel) does not run it");
      continue;
    }
    ran++;
    for (Dims d : {Dims{37, 29, 45}, Dims{300, 150, 200}, Dims{1, 17, 3}, Dims{70, 40, 2051}})
      for (int tr = 0; tr < 4; tr++) {
        const bool ta = tr & 1, tb = tr & 2;
        INFO(cpu::bf16_gemm_name(p) << ": M " << d.M << " N " << d.N << " K " << d.K << " A^T " << ta << " B^T " << tb);
        const auto ashape = ta ? std::vector<int64_t>{d.K, d.M} : std::vector<int64_t>{d.M, d.K};
        const auto bshape = tb ? std::vector<int64_t>{d.N, d.K} : std::vector<int64_t>{d.K, d.N};
        // Random operands: within the bound, element by element.
        const Tensor A = make(ashape, randn(d.M * d.K, 831 + tr), DType::BF16);
        const Tensor B = make(bshape, randn(d.N * d.K, 832 + tr), DType::BF16);
        const Vec C0 = randn(d.M * d.N, 833);
        const Vec want = widened_gemm(ta, tb, d.M, d.N, d.K, 0.5f, A, B, 0.7f, C0);
        const Vec got = path_gemm(p, ta, tb, d.M, d.N, d.K, 0.5f, A, B, 0.7f, C0);
        const Vec a = host(A), b = host(B);
        const double u = std::ldexp(1.0, -24), gamma = d.K * u / (1 - d.K * u);
        int64_t outside = 0;
        for (int64_t i = 0; i < d.M; i++)
          for (int64_t j = 0; j < d.N; j++) {
            double abs_sum = 0;
            for (int64_t k = 0; k < d.K; k++)
              abs_sum += std::fabs(a[ta ? k * d.M + i : i * d.K + k]) * std::fabs(b[tb ? j * d.K + k : k * d.N + j]);
            const double mag = 0.5 * abs_sum + 0.7 * std::fabs(C0[i * d.N + j]);
            const double bound = 2 * gamma * 0.5 * abs_sum + 4 * u * mag;
            outside += std::fabs(double(got[i * d.N + j]) - want[i * d.N + j]) > bound;
          }
        CHECK(outside == 0);
        // Integers in [-8, 8]: |partial sums| ≤ 64 K < 2^24, exact in any order.
        Vec ia(d.M * d.K), ib(d.N * d.K), ic(d.M * d.N);
        for (size_t i = 0; i < ia.size(); i++) ia[i] = float(int(i * 7 + tr) % 17 - 8);
        for (size_t i = 0; i < ib.size(); i++) ib[i] = float(int(i * 5 + 3) % 17 - 8);
        for (size_t i = 0; i < ic.size(); i++) ic[i] = float(int(i % 9) - 4);
        const Tensor IA = make(ashape, ia, DType::BF16), IB = make(bshape, ib, DType::BF16);
        CHECK(path_gemm(p, ta, tb, d.M, d.N, d.K, 1.0f, IA, IB, 1.0f, ic) ==
              widened_gemm(ta, tb, d.M, d.N, d.K, 1.0f, IA, IB, 1.0f, ic));
        // The same bits at 1, 2 and 4 threads.
        Vec one, two, four;
        with_threads(1, [&] { one = path_gemm(p, ta, tb, d.M, d.N, d.K, 0.5f, A, B, 0.7f, C0); });
        with_threads(2, [&] { two = path_gemm(p, ta, tb, d.M, d.N, d.K, 0.5f, A, B, 0.7f, C0); });
        with_threads(4, [&] { four = path_gemm(p, ta, tb, d.M, d.N, d.K, 0.5f, A, B, 0.7f, C0); });
        CHECK(std::memcmp(one.data(), got.data(), got.size() * 4) == 0);
        CHECK(std::memcmp(two.data(), got.data(), got.size() * 4) == 0);
        CHECK(std::memcmp(four.data(), got.data(), got.size() * 4) == 0);
      }
    // An element of C does not depend on the matrix around it: the top-left 37 × 29 block of a
    // 300 × 150 product (same rows of A, columns of B, leading dimensions) has the 37 × 29 product's bits.
    const Tensor A = make({300, 200}, randn(300 * 200, 841), DType::BF16);
    const Tensor B = make({200, 150}, randn(200 * 150, 842), DType::BF16);
    Vec big(300 * 150), small(37 * 29);
    cpu::bf16_gemm(p, false, false, 300, 150, 200, 1.0f, A.b16(), 200, B.b16(), 150, 0.0f, big.data());
    cpu::bf16_gemm(p, false, false, 37, 29, 200, 1.0f, A.b16(), 200, B.b16(), 150, 0.0f, small.data());
    int64_t differ = 0;
    for (int64_t i = 0; i < 37; i++)
      for (int64_t j = 0; j < 29; j++) differ += std::memcmp(&big[i * 150 + j], &small[i * 29 + j], 4) != 0;
    CHECK(differ == 0);
  }
  // matmul takes the chosen path for two bf16 operands: its result is that path's, bit for bit.
  const cpu::Bf16Gemm chosen = cpu::bf16_gemm_path();
  if (chosen != cpu::Bf16Gemm::Widen) {
    const Tensor A = make({33, 70}, randn(33 * 70, 851), DType::BF16), B = make({70, 20}, randn(70 * 20, 852), DType::BF16);
    Tensor C = make({33, 20}, Vec(33 * 20, 0.0f));
    matmul(C, A, false, B, false);
    CHECK(host(C) == path_gemm(chosen, false, false, 33, 20, 70, 1.0f, A, B, 0.0f, Vec(33 * 20, 0.0f)));
  }
  WARN("bf16 GEMM paths checked: " << ran << " (matmul takes " << cpu::bf16_gemm_name(chosen) << ")");
}

// Attention's score products on VDPBF16PS (Q Kᵀ, dO Vᵀ for bf16 operands where the bf16 path is
// AVX512-BF16): against double sums of the same exact products, within γ_K · Σ|a||b| (an fp32 sum of
// K terms in any order), exact on small integers, with the layouts attention gathers (A rows with a
// padded stride, B by pairs with ldb > 2N) and the ragged column tail (N = 48: one 32- and one
// 16-wide tile).
TEST_CASE("bf16 pair products equal fp32 sums of the exact products: the bound, integers", "[attention][bf16][ref]") {
  if (!cpu::bf16_gemm_available(cpu::Bf16Gemm::Avx512Bf16)) {
    WARN("bf16 pair products not checked: this CPU does not run AVX512-BF16 (attention widens bf16 here)");
    return;
  }
  const int64_t M = 24, N = 48, pairs = 20, K = 2 * pairs, lda = K + 8, ldb = 2 * N + 32;
  for (bool integers : {false, true}) {
    Vec af = randn(M * lda, 861), bf = randn(pairs * ldb, 862);
    for (size_t i = 0; integers && i < af.size(); i++) af[i] = float(int(i * 7) % 17 - 8);
    for (size_t i = 0; integers && i < bf.size(); i++) bf[i] = float(int(i * 5 + 3) % 17 - 8);
    const Tensor A = make({M * lda}, af, DType::BF16), B = make({pairs * ldb}, bf, DType::BF16);
    const Vec a = host(A), b = host(B);  // the bf16 values, exactly
    Vec c(M * N, -1.0f);
    cpu::bf16_pair_products(M, N, pairs, A.b16(), lda, B.b16(), ldb, c.data(), N);
    const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);
    int64_t outside = 0, inexact = 0;
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double exact = 0, abs_sum = 0;
        for (int64_t k = 0; k < K; k++) {
          const double p = double(a[i * lda + k]) * b[(k / 2) * ldb + 2 * j + k % 2];
          exact += p, abs_sum += std::fabs(p);
        }
        outside += std::fabs(c[i * N + j] - exact) > gamma * abs_sum;
        inexact += c[i * N + j] != exact;
      }
    INFO((integers ? "integers" : "random") << " operands");
    CHECK(outside == 0);
    if (integers) CHECK(inexact == 0);
  }
}

TEST_CASE("tuned cross-entropy rows and sum_squares equal the reference", "[cross_entropy][norms][ref]") {
  const int64_t N = 9, V = 257;
  Vec x = randn(N * V, 821, 3.0f);
  for (int64_t j = 0; j < V; j += 3) x[2 * V + j] = 80.0f;  // row 2: target at -80 among +80s
  x[2 * V + 1] = -80.0f;
  for (int64_t j = 0; j < V; j++) x[3 * V + j] = j % 2 ? 80.0f : -80.0f;
  const IVec t = {0, 256, 1, 0, 5, 100, 17, 3, 128};
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    // Losses reach 160 (row 2), where one fp32 ulp is 1.5e-5; |dlogits| <= grad_scale = 1/4.
    const Tol f32{4e-5, 2e-7}, bf16{1.0 / 1024, 1.0 / 256};
    Tensor logits = make({N, V}, x, dt), losses = make({N}, Vec(N, 0.0f)), dl = empty_like(logits);
    vs_ref("cross_entropy", {losses, dl, logits, ints(t)}, {0, 1},
           [](auto& a) { cross_entropy_forward_backward(a[0], a[1], a[2], a[3], 0.25f); },
           [](auto& a) { ref::cross_entropy_forward_backward(a[0], a[1], a[2], a[3], 0.25f); }, f32, bf16);
    vs_ref("cross_entropy in place", {losses, logits, ints(t)}, {0, 1},
           [](auto& a) { cross_entropy_forward_backward(a[0], a[1], a[1], a[2], 0.25f); },
           [](auto& a) { ref::cross_entropy_forward_backward(a[0], a[1], a[1], a[2], 0.25f); }, f32, bf16);
  }
  // Double sums of 200001 squares in chunks against one running sum: ~1e-16 relative per add.
  const Tensor sq = make({200001}, randn(200001, 822));
  const double fast = sum_squares(sq), want = ref::sum_squares(sq);
  INFO("sum_squares " << fast << " reference " << want);
  CHECK(std::fabs(fast - want) <= 1e-12 * want);
}

// ===== CUDA twins ================================================================================

#ifdef TS_CUDA
namespace {
Tensor on(const Tensor& t, Device d) {
  if (!t.defined()) return t;
  Tensor r = Tensor::empty(t.shape, t.dtype, d, Tag::Workspace);
  copy(r, t);
  return r;
}

// Runs op on CPU copies and on CUDA copies of the same tensors (inputs and pre-filled outputs)
// and compares the tensors at the indices in outs: the CPU implementation is the oracle.
void twin(const char* name, const std::vector<Tensor>& ts, const std::vector<int>& outs,
          const std::function<void(const std::vector<Tensor>&)>& op, double tol) {
  std::vector<Tensor> cpu, gpu;
  for (const Tensor& t : ts) {
    cpu.push_back(on(t, Device::CPU));
    gpu.push_back(on(t, Device::CUDA));
  }
  op(cpu);
  op(gpu);
  device_sync(Device::CUDA);
  for (int i : outs) {
    INFO(name << ": output " << i << " " << cpu[i].str());
    const Vec c = host(cpu[i]), g = host(gpu[i]);
    CHECK(rel_err(g, c) <= tol);
  }
}

bool gpu_visible() {
  if (cuda_available()) return true;
  WARN("no GPU visible: CUDA twin not run");
  return false;
}

double tol_for(DType dt, double f32_tol) { return dt == DType::BF16 ? 1e-2 : f32_tol; }
}  // namespace

TEST_CASE("cuda twin: elementwise, convert, fill", "[cuda]") {
  if (!gpu_visible()) return;
  for (DType dt : {DType::F32, DType::BF16}) {
    const int64_t n = 1003;
    Tensor a = make({n}, randn(n, 1), dt), b = make({n}, randn(n, 2), dt), y = make({n}, Vec(n, 0.f), dt);
    twin("add", {y, a, b}, {0}, [](auto& t) { add(t[0], t[1], t[2]); }, 0);
    twin("add_inplace", {a, b}, {0}, [](auto& t) { add_inplace(t[0], t[1]); }, 0);
    twin("scale_inplace", {a}, {0}, [](auto& t) { scale_inplace(t[0], -1.5f); }, 0);
    twin("fill", {a}, {0}, [](auto& t) { fill(t[0], 0.3f); }, 0);
    Tensor other = make({n}, Vec(n, 0.f), dt == DType::F32 ? DType::BF16 : DType::F32);
    twin("convert", {other, a}, {0}, [](auto& t) { convert(t[0], t[1]); }, 0);
  }
}

TEST_CASE("cuda twin: embedding", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t V = 37, D = 33, N = 129;
  IVec tok(N);
  for (int64_t n = 0; n < N; n++) tok[n] = int32_t((n * 7) % 45);
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor table = make({V, D}, randn(V * D, 3), dt), out = make({N, D}, Vec(N * D, 0.f), dt);
    twin("embedding_forward", {out, table, ints(tok)}, {0}, [](auto& t) { embedding_forward(t[0], t[1], t[2], 4); }, 0);
    Tensor dtable = make({V, D}, randn(V * D, 4)), dout = make({N, D}, randn(N * D, 5), dt);
    twin("embedding_backward", {dtable, dout, ints(tok)}, {0},
         [](auto& t) { embedding_backward(t[0], t[1], t[2], 4); }, 1e-6);
  }
}

TEST_CASE("cuda twin: rmsnorm", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t N = 67, D = 257;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor x = make({N, D}, randn(N * D, 6), dt), w = make({D}, randn(D, 7)), y = make({N, D}, Vec(N * D, 0.f), dt);
    Tensor rstd = make({N}, Vec(N, 0.f)), dy = make({N, D}, randn(N * D, 8), dt), dx = make({N, D}, Vec(N * D, 0.f), dt);
    Tensor dw = make({D}, randn(D, 9));
    twin("rmsnorm_forward", {y, rstd, x, w}, {0, 1}, [](auto& t) { rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-5f); },
         tol_for(dt, 1e-5));
    rmsnorm_forward(y, rstd, x, w, 1e-5f);
    twin("rmsnorm_backward", {dx, dw, dy, x, w, rstd}, {0, 1},
         [](auto& t) { rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]); }, tol_for(dt, 1e-5));
  }
}

TEST_CASE("cuda twin: rope", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t B = 2, S = 33, H = 3, hd = 10;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor x = make({B, S, H, hd}, randn(B * S * H * hd, 10), dt), pos = ints(iota(S, 5));
    twin("rope_forward", {x, pos}, {0}, [](auto& t) { rope_forward(t[0], t[1], 10000.f); }, tol_for(dt, 1e-5));
    twin("rope_backward", {x, pos}, {0}, [](auto& t) { rope_backward(t[0], t[1], 10000.f); }, tol_for(dt, 1e-5));
  }
}

// The CUDA rope reads cos and sin from a table built once per (theta, head dim) and grown with the
// sequence length; a position past the table is computed in place. Both must give the same bits:
// the same rows at positions outside the table, then again once a longer sequence has grown the
// table over them. A theta of its own per dtype starts each from a 64-position table.
TEST_CASE("cuda rope: positions from the table and computed in place give the same bits", "[cuda][rope]") {
  if (!gpu_visible()) return;
  const int64_t H = 2, hd = 12, L = 2048;
  const IVec pos = {3, 63, 64, 100, 1000, 4097};
  const int64_t S = int64_t(pos.size());
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    const float theta = dt == DType::F32 ? 777.f : 778.f;
    const Tensor x = make({2, S, H, hd}, randn(2 * S * H * hd, 75), dt), p = on(ints(pos), Device::CUDA);
    Tensor first = on(x, Device::CUDA), again = on(x, Device::CUDA), cpu = on(x, Device::CPU);
    rope_forward(first, p, theta);  // 64, 100, 1000 and 4097 computed in place
    Tensor longer = on(make({1, L, 1, hd}, randn(L * hd, 76), dt), Device::CUDA);
    rope_forward(longer, on(ints(iota(L, 0)), Device::CUDA), theta);  // grows the table to 2048 positions
    rope_forward(again, p, theta);  // all but 4097 from the table
    rope_forward(cpu, ints(pos), theta);
    device_sync(Device::CUDA);
    CHECK(bitwise_equal(host(again), host(first)));
    CHECK(rel_err(host(again), host(cpu)) <= tol_for(dt, 1e-5));
  }
}

#ifdef TS_CUDA_EMU
// The rotation as the CUDA kernel computed it before it had a table, one double sincos per
// element, written out on the host. Under the emulator the device's sincos is the host's, so the
// table-driven kernel must give exactly these bits.
Vec rope_untabled(const Vec& x, const IVec& pos, float theta, int64_t S, int64_t H, int64_t hd, float sign, DType dt) {
  Vec y = x;
  const int64_t half = hd / 2, rows = int64_t(x.size()) / hd;
  auto stored = [&](float v) { return dt == DType::BF16 ? bf16_to_float(float_to_bf16(v)) : v; };
  for (int64_t row = 0; row < rows; row++)
    for (int64_t j = 0; j < half; j++) {
      double sd, cd;
      sincos(double(pos[size_t((row / H) % S)]) * std::pow(double(theta), -2.0 * double(j) / double(hd)), &sd, &cd);
      const float cs = float(cd), sn = sign * float(sd);
      const float a = x[size_t(row * hd + j)], b = x[size_t(row * hd + j + half)];
      y[size_t(row * hd + j)] = stored(a * cs - b * sn);
      y[size_t(row * hd + j + half)] = stored(b * cs + a * sn);
    }
  return y;
}

// Calls that switch theta and head dim and grow the table, queued without a synchronisation
// between them (the emulated stream runs them late, in order, after every rebuild they follow):
// each gives the bits of the untabled rotation, forward and backward, fp32 and bf16.
TEST_CASE("cuda rope: the table-driven kernel gives the untabled kernel's bits", "[cuda][rope]") {
  const int64_t B = 2, S = 5, H = 3;
  struct Call {
    float theta;
    int64_t hd;
    IVec pos;
    float sign;
  };
  const std::vector<Call> calls = {{10000.f, 8, iota(S, 0), 1.f},          {500.f, 8, {9, 3, 700, 4, 5}, -1.f},
                                   {10000.f, 4, {0, 1, 2, 3, 4000}, 1.f},  {10000.f, 8, {60, 61, 62, 63, 64}, -1.f},
                                   {10000.f, 128, iota(S, 126), 1.f},      {500.f, 8, iota(S, 70000), 1.f}};
  for (DType dt : {DType::F32, DType::BF16}) {
    std::vector<Tensor> in, out;
    for (size_t i = 0; i < calls.size(); i++) {
      const Call& c = calls[i];
      in.push_back(make({B, S, H, c.hd}, randn(B * S * H * c.hd, 77 + i), dt));
      out.push_back(on(in.back(), Device::CUDA));
      if (c.sign > 0)
        rope_forward(out.back(), on(ints(c.pos), Device::CUDA), c.theta);
      else
        rope_backward(out.back(), on(ints(c.pos), Device::CUDA), c.theta);
    }
    device_sync(Device::CUDA);
    for (size_t i = 0; i < calls.size(); i++) {
      const Call& c = calls[i];
      INFO(dtype_name(dt) << " call " << i);
      CHECK(bitwise_equal(host(out[i]), rope_untabled(host(in[i]), c.pos, c.theta, S, H, c.hd, c.sign, dt)));
    }
  }
}
#endif

TEST_CASE("cuda twin: matmul and linear", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t M = 33, N = 65, K = 47;
  for (DType dt : {DType::F32, DType::BF16}) {
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        Tensor A = ta ? make({K, M}, randn(M * K, 11), dt) : make({M, K}, randn(M * K, 11), dt);
        Tensor B = tb ? make({N, K}, randn(N * K, 12), dt) : make({K, N}, randn(N * K, 12), dt);
        Tensor C = make({M, N}, randn(M * N, 13));
        twin("matmul", {C, A, B}, {0}, [=](auto& t) { matmul(t[0], t[1], ta, t[2], tb, 0.5f, 1.0f); },
             tol_for(dt, 1e-4));  // cuBLAS blocks K differently: fp32 sums in another order
      }
    Tensor x = make({M, K}, randn(M * K, 14), dt), W = make({N, K}, randn(N * K, 15), dt);
    Tensor dy = make({M, N}, randn(M * N, 16), dt), dx = make({M, K}, Vec(M * K, 0.f), dt);
    Tensor dW = make({N, K}, randn(N * K, 17));
    twin("linear_backward", {dx, dW, dy, x, W}, {0, 1}, [](auto& t) { linear_backward(t[0], t[1], t[2], t[3], t[4]); },
         tol_for(dt, 1e-4));
  }
}

// Head dims 16, 64 and 128 take the kernel's 1-, 2- and 4-chunk paths (the presets use 64 and
// 128); GQA ratios 1, 2 and 4; odd sequence lengths; fp32 and bf16.
TEST_CASE("cuda twin: attention", "[cuda]") {
  if (!gpu_visible()) return;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t hd : {16, 64, 128})
      for (int64_t S : {7, 65, 129})
        for (int64_t KVH : {4, 2, 1}) {
          const AttnDims a{2, S, 4, KVH, hd};
          const AttnCase c = attn_case(a, iota(S, 5), iota(S, 5), 20 + S + KVH + hd);
          Tensor q = make({2, S, 4, hd}, c.q, dt), k = make({2, S, KVH, hd}, c.k, dt), v = make({2, S, KVH, hd}, c.v, dt);
          Tensor dout = make({2, S, 4, hd}, c.dout, dt), pos = ints(c.qpos);
          Tensor out = make(q.shape, Vec(q.numel(), 0.f), dt), lse = make({2, 4, S}, Vec(8 * S, 0.f));
          INFO("hd " << hd << " S " << S << " kv heads " << KVH);
          twin("attention_forward", {out, lse, q, k, v, pos}, {0, 1},
               [](auto& t) { attention_forward(t[0], t[1], t[2], t[3], t[4], t[5], t[5]); }, tol_for(dt, 1e-4));
          attention_forward(out, lse, q, k, v, pos, pos);
          Tensor dq = make(q.shape, Vec(q.numel(), 0.f), dt), dk = make(k.shape, Vec(k.numel(), 0.f), dt);
          Tensor dv = make(k.shape, Vec(k.numel(), 0.f), dt);
          twin("attention_backward", {dq, dk, dv, dout, out, lse, q, k, v, pos}, {0, 1, 2},
               [](auto& t) { attention_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[9]); },
               tol_for(dt, 1e-4));
        }
}

TEST_CASE("cuda twin: swiglu and cross-entropy", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t N = 33, F = 689, V = 257;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor g = make({N, F}, randn(N * F, 18, 3.f), dt), u = make({N, F}, randn(N * F, 19), dt);
    Tensor h = make({N, F}, Vec(N * F, 0.f), dt), dh = make({N, F}, randn(N * F, 20), dt), dg = make({N, F}, Vec(N * F, 0.f), dt);
    twin("swiglu_forward", {h, g, u}, {0}, [](auto& t) { swiglu_forward(t[0], t[1], t[2]); }, tol_for(dt, 1e-5));
    twin("swiglu_backward", {dg, h, dh, g, u}, {0, 1},
         [](auto& t) { swiglu_backward(t[0], t[1], t[2], t[3], t[4]); }, tol_for(dt, 1e-5));
    Vec lg = randn(N * V, 21, 4.f);
    lg[5] = 80.f;
    lg[6] = -80.f;
    IVec tg(N);
    for (int64_t n = 0; n < N; n++) tg[n] = int32_t((n * 13) % V);
    Tensor logits = make({N, V}, lg, dt), losses = make({N}, Vec(N, 0.f));
    twin("cross_entropy", {losses, logits, ints(tg)}, {0, 1},
         [](auto& t) { cross_entropy_forward_backward(t[0], t[1], t[1], t[2], 0.25f); }, tol_for(dt, 1e-5));
  }
}

// Vocabularies wider than a 512-thread block (the model's GPT-2 vocabulary is 50257).
TEST_CASE("cuda twin: cross-entropy at vocabularies above 512", "[cuda]") {
  if (!gpu_visible()) return;
  for (int64_t V : {1031, 50257}) {
    const int64_t N = 9;
    Vec lg = randn(N * V, 30 + V, 4.f);
    lg[3] = 80.f;
    IVec tg(N);
    for (int64_t n = 0; n < N; n++) tg[n] = int32_t((n * 977) % V);
    for (DType dt : {DType::F32, DType::BF16}) {
      INFO("vocab " << V);
      Tensor logits = make({N, V}, lg, dt), losses = make({N}, Vec(N, 0.f));
      twin("cross_entropy", {losses, logits, ints(tg)}, {0, 1},
           [](auto& t) { cross_entropy_forward_backward(t[0], t[1], t[1], t[2], 0.25f); }, tol_for(dt, 1e-5));
    }
  }
}

// Embedding backward at vocabularies of 128 and more, with repeated tokens (rows accumulate).
TEST_CASE("cuda twin: embedding backward at vocab 128 and 50257", "[cuda]") {
  if (!gpu_visible()) return;
  for (int64_t V : {128, 300, 50257}) {
    const int64_t D = 64, N = 257;
    IVec tok(N);
    for (int64_t n = 0; n < N; n++) tok[n] = int32_t((n * 31) % std::min<int64_t>(V, 97));
    for (DType dt : {DType::F32, DType::BF16}) {
      INFO("vocab " << V);
      Tensor dtable = make({V, D}, Vec(V * D, 0.f)), dout = make({N, D}, randn(N * D, 40 + V), dt);
      twin("embedding_backward", {dtable, dout, ints(tok)}, {0},
           [](auto& t) { embedding_backward(t[0], t[1], t[2], 0); }, 1e-6);
    }
  }
}

TEST_CASE("cuda twin: vocabulary-parallel cross-entropy", "[cuda]") {
  if (!gpu_visible()) return;
  // A shard of 1000 vocabulary rows (wider than a block) from row 500; targets in [0, 2000).
  const int64_t N = 37, Vl = 1000, vs = 500;
  Vec lg = randn(N * Vl, 25, 4.f);
  lg[5] = 80.f;
  lg[6] = -80.f;
  IVec tg(N);
  for (int64_t n = 0; n < N; n++) tg[n] = int32_t((n * 173) % 2000);
  const Tensor tgt = ints(tg);
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor logits = make({N, Vl}, lg, dt), mx = make({N}, Vec(N, 0.f)), stats = make({2, N}, Vec(2 * N, 0.f));
    Tensor losses = make({N}, Vec(N, 0.f));
    twin("vocab_ce_max", {mx, logits}, {0}, [](auto& t) { vocab_ce_max(t[0], t[1]); }, 0);
    vocab_ce_max(mx, logits);
    scale_inplace(mx, 1.25f);  // a global max above this shard's own, as from another rank
    twin("vocab_ce_stats", {stats, logits, mx, tgt}, {0},
         [=](auto& t) { vocab_ce_stats(t[0], t[1], t[2], t[3], vs); }, 1e-5);
    vocab_ce_stats(stats, logits, mx, tgt, vs);
    twin("vocab_ce_finish", {losses, logits, mx, stats, tgt}, {0, 1},
         [=](auto& t) { vocab_ce_finish(t[0], t[1], t[1], t[2], t[3], t[4], vs, 0.25f); }, tol_for(dt, 1e-5));
  }
}

TEST_CASE("cuda twin: adamw, sum_squares, init_normal", "[cuda]") {
  if (!gpu_visible()) return;
  const int64_t n = 4099;
  Tensor p = make({n}, randn(n, 22)), g = make({n}, randn(n, 23)), m = make({n}, randn(n, 24, 0.1f));
  Tensor v = make({n}, Vec(n, 0.01f)), pc = make({n}, Vec(n, 0.f), DType::BF16);
  // The fp32 master, m and v may differ by an ulp or so (FMA contraction); the bf16 copy is the
  // master rounded, so one master ulp that straddles a bf16 rounding midpoint moves it by one
  // bf16 ulp (~2^-8 relative): compared per element within one bf16 ulp, not at fp32's 1e-6.
  twin("adamw_step", {p, g, m, v, pc}, {0, 2, 3},
       [](auto& t) { adamw_step(t[0], t[1], t[2], t[3], {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3}, true, 0.7f, t[4]); },
       1e-6);
  {
    Tensor pc_cpu = on(pc, Device::CPU), pc_gpu = on(pc, Device::CUDA);
    Tensor p1 = on(p, Device::CPU), g1 = on(g, Device::CPU), m1 = on(m, Device::CPU), v1 = on(v, Device::CPU);
    Tensor p2 = on(p, Device::CUDA), g2 = on(g, Device::CUDA), m2 = on(m, Device::CUDA), v2 = on(v, Device::CUDA);
    const AdamWParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3};
    adamw_step(p1, g1, m1, v1, hp, true, 0.7f, pc_cpu);
    adamw_step(p2, g2, m2, v2, hp, true, 0.7f, pc_gpu);
    device_sync(Device::CUDA);
    const Vec c = host(pc_cpu), gg = host(pc_gpu);
    int64_t beyond_one_ulp = 0;
    for (size_t i = 0; i < c.size(); i++) beyond_one_ulp += std::fabs(gg[i] - c[i]) > std::ldexp(std::fabs(c[i]), -7);
    CHECK(beyond_one_ulp == 0);
  }
  const double want = sum_squares(g);
  const double got = sum_squares(on(g, Device::CUDA));
  CHECK(std::fabs(got - want) <= 1e-12 * want);
  const std::vector<double> each = sum_squares_each({on(g, Device::CUDA), on(m, Device::CUDA)});
  REQUIRE(each.size() == 2);
  CHECK(each[0] == got);  // the same kernels, the same order
  CHECK(std::fabs(each[1] - sum_squares(m)) <= 1e-12 * sum_squares(m));
  Tensor s = make({17, 9}, Vec(17 * 9, 0.f));
  twin("init_normal", {s}, {0}, [](auto& t) { init_normal(t[0], 99, 0.02f, 3, 5, 20); }, 0);
}
#endif
