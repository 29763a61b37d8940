// ranks: 1
// The attention ladder's second rung (common/kernels/attention_v2.cu: FlashAttention-2 on the
// tensor cores) against its first (kernels_cuda.cu, fp32 on the CUDA cores), the CPU kernels and
// the exact attention of the same bf16 inputs: head dims 64 and 128, causal and not, GQA ratios
// 1, 2 and 4, the query and key positions of ring-attention blocks (some queries seeing no key),
// lengths that are no multiple of a tile; and the same bits run to run.
// With no GPU the emulated one runs them, where each mma.sync and ldmatrix moves exactly the
// fragment elements NVIDIA's PTX ISA gives each lane: a kernel that reads a wrong register fails
// here as it would on the hardware.
//
// Every output element is held to a bound derived for it (Bounds below), not to one tolerance.
#include <catch2/catch.hpp>

#ifdef TS_CUDA
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "tensor/device.h"
#include "kernels/kernels_cuda.h"
#include "tensor/core.h"
#include "tensor/rng.h"

using namespace ts;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
using IVec = std::vector<int32_t>;

namespace {

struct Case {
  std::string name;
  int64_t B, Sq, Sk, H, KVH, hd;
  IVec qpos, kpos;
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * Sq + i) * H + h) * hd; }
  int64_t k(int64_t b, int64_t j, int64_t h) const { return ((b * Sk + j) * KVH + h) * hd; }
};

IVec iota(int64_t n, int32_t start) {
  IVec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i++) v[size_t(i)] = start + int32_t(i);
  return v;
}
IVec cat(IVec a, const IVec& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Normal samples rounded to bf16, so that the exact reference sees the kernels' inputs.
Vec bf16_randn(int64_t n, uint64_t seed) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i++) v[size_t(i)] = bf16_to_float(float_to_bf16(rng_normal(seed, uint64_t(i))));
  return v;
}

// The exact attention (double) of bf16 inputs, forward and backward, and what each bound needs:
// for every output the sum of its terms' magnitudes (mag), and per query row the largest scaled
// score magnitude scale·Σ_d |q_d k_d| (smag), which bounds the fp32 rounding of a score.
struct Exact {
  DVec out, lse, dq, dk, dv, out_mag, dq_mag, dk_mag, dv_mag, smag;
};

// One (b, h, i) row: probabilities p (0 where masked); false if no key is visible.
bool probs(DVec& p, double& lse, double& smag, const Case& c, const Vec& q, const Vec& k, int64_t b, int64_t h,
           int64_t i) {
  const int64_t kvh = h / (c.H / c.KVH);
  const double scale = 1.0 / std::sqrt(double(c.hd));
  p.assign(size_t(c.Sk), 0.0);
  double mx = -INFINITY;
  smag = 0;
  for (int64_t j = 0; j < c.Sk; j++) {
    double s = 0, a = 0;
    for (int64_t d = 0; d < c.hd; d++) {
      s += double(q[size_t(c.q(b, i, h) + d)]) * k[size_t(c.k(b, j, kvh) + d)];
      a += std::fabs(double(q[size_t(c.q(b, i, h) + d)]) * k[size_t(c.k(b, j, kvh) + d)]);
    }
    smag = std::max(smag, scale * a);
    if (c.kpos[size_t(j)] > c.qpos[size_t(i)]) continue;
    p[size_t(j)] = s * scale;
    mx = std::max(mx, p[size_t(j)]);
  }
  lse = -INFINITY;
  if (mx == -INFINITY) return false;
  double sum = 0;
  for (int64_t j = 0; j < c.Sk; j++) sum += c.kpos[size_t(j)] <= c.qpos[size_t(i)] ? std::exp(p[size_t(j)] - mx) : 0.0;
  for (int64_t j = 0; j < c.Sk; j++)
    p[size_t(j)] = c.kpos[size_t(j)] <= c.qpos[size_t(i)] ? std::exp(p[size_t(j)] - mx) / sum : 0.0;
  lse = mx + std::log(sum);
  return true;
}

// The backward of one row given the output the kernels are handed (o_in: the exact output rounded
// to bf16): Dsum = dO·o_in, dP_j = dO·v_j, dS_j = p_j (dP_j - Dsum).
void backward_row(Exact& e, const Case& c, const DVec& p, const Vec& q, const Vec& k, const Vec& v, const Vec& dout,
                  const Vec& o_in, int64_t b, int64_t h, int64_t i) {
  const int64_t kvh = h / (c.H / c.KVH), qi = c.q(b, i, h);
  const double scale = 1.0 / std::sqrt(double(c.hd));
  double D = 0;
  for (int64_t d = 0; d < c.hd; d++) D += double(dout[size_t(qi + d)]) * o_in[size_t(qi + d)];
  for (int64_t j = 0; j < c.Sk; j++) {
    if (p[size_t(j)] == 0) continue;
    const int64_t kj = c.k(b, j, kvh);
    double dp = 0;
    for (int64_t d = 0; d < c.hd; d++) dp += double(dout[size_t(qi + d)]) * v[size_t(kj + d)];
    const double ds = p[size_t(j)] * (dp - D), m = p[size_t(j)] * (std::fabs(dp) + std::fabs(D));
    for (int64_t d = 0; d < c.hd; d++) {
      const size_t a = size_t(qi + d), x = size_t(kj + d);
      e.dq[a] += scale * ds * k[x];
      e.dq_mag[a] += scale * m * std::fabs(k[x]);
      e.dk[x] += scale * ds * q[a];
      e.dk_mag[x] += scale * m * std::fabs(q[a]);
      e.dv[x] += p[size_t(j)] * dout[a];
      e.dv_mag[x] += p[size_t(j)] * std::fabs(dout[a]);
    }
  }
}

Exact exact(const Case& c, const Vec& q, const Vec& k, const Vec& v, const Vec& dout, Vec& o_in) {
  Exact e;
  const size_t nq = size_t(c.B * c.Sq * c.H * c.hd), nk = size_t(c.B * c.Sk * c.KVH * c.hd);
  e.out.assign(nq, 0), e.out_mag.assign(nq, 0), e.dq.assign(nq, 0), e.dq_mag.assign(nq, 0);
  e.dk.assign(nk, 0), e.dk_mag.assign(nk, 0), e.dv.assign(nk, 0), e.dv_mag.assign(nk, 0);
  e.lse.assign(size_t(c.B * c.H * c.Sq), 0), e.smag.assign(e.lse.size(), 0);
  std::vector<DVec> rows(e.lse.size());
  for (int64_t b = 0; b < c.B; b++)
    for (int64_t h = 0; h < c.H; h++)
      for (int64_t i = 0; i < c.Sq; i++) {
        const size_t r = size_t((b * c.H + h) * c.Sq + i);
        if (!probs(rows[r], e.lse[r], e.smag[r], c, q, k, b, h, i)) continue;
        const int64_t kvh = h / (c.H / c.KVH);
        for (int64_t j = 0; j < c.Sk; j++)
          for (int64_t d = 0; d < c.hd; d++) {
            const double vv = v[size_t(c.k(b, j, kvh) + d)];
            e.out[size_t(c.q(b, i, h) + d)] += rows[r][size_t(j)] * vv;
            e.out_mag[size_t(c.q(b, i, h) + d)] += rows[r][size_t(j)] * std::fabs(vv);
          }
      }
  o_in.resize(nq);
  for (size_t x = 0; x < nq; x++) o_in[x] = bf16_to_float(float_to_bf16(float(e.out[x])));
  for (int64_t b = 0; b < c.B; b++)
    for (int64_t h = 0; h < c.H; h++)
      for (int64_t i = 0; i < c.Sq; i++)
        if (e.lse[size_t((b * c.H + h) * c.Sq + i)] > -INFINITY)
          backward_row(e, c, rows[size_t((b * c.H + h) * c.Sq + i)], q, k, v, dout, o_in, b, h, i);
  return e;
}

// The bound for one output element x with exact value X and term magnitude M:
//   |x − X| ≤ u·|X| + (u_rung + f)·M + 1e-30
// * u = 2^-8, bf16's unit roundoff: every rung stores its outputs in bf16 (one rounding);
// * u_rung = u for v2, which rounds each product's left operand to bf16 before the tensor cores
//   take it (P for O = P V and dV = Pᵀ dO, dS for dQ = dS K and dK = dSᵀ Q): a relative error of at
//   most u in each term; 0 for v1 and the CPU, which keep P and dS in fp32;
// * f covers fp32: a score is a dot product of hd terms, off by at most hd·2^-24·smag (the row's
//   scale·Σ|q_d k_d|), which changes every p by that relative amount; sums of at most Sq + Sk
//   terms add (Sq + Sk)·2^-24 relative to M; expf and logf a few ulps. f = 4·2^-24·(hd·(smag + 1)
//   + Sq + Sk), a factor 4 above the first-order terms.
// lse is fp32 in every rung: |lse − LSE| ≤ 4·2^-24·(hd·smag + |LSE| + 1).
struct Bounds {
  const Case& c;
  double u_rung;
  double f(double smag) const { return 4 * 0x1p-24 * (double(c.hd) * (smag + 1) + double(c.Sq + c.Sk)); }
  // Worst (|x − X| / bound) over a tensor; ≤ 1 passes. row_of maps an element to its query row's smag.
  double worst(const Vec& got, const DVec& want, const DVec& mag, const std::function<double(size_t)>& smag) const {
    REQUIRE(got.size() == want.size());
    double w = 0;
    for (size_t x = 0; x < got.size(); x++) {
      const double bound = 0x1p-8 * std::fabs(want[x]) + (u_rung + f(smag(x))) * mag[x] + 1e-30;
      w = std::max(w, std::fabs(double(got[x]) - want[x]) / bound);
    }
    return w;
  }
};

// A tensor holding v on dev (staged through a host tensor; T float or int32_t).
template <class T> Tensor on(std::vector<int64_t> shape, const std::vector<T>& v, DType dt, Device dev) {
  Tensor h = Tensor::empty(shape, dt, Device::CPU, Tag::Activations);
  if constexpr (std::is_same_v<T, int32_t>) std::copy(v.begin(), v.end(), h.i32());
  else from_host_f32(h, v.data());
  if (dev == Device::CPU) return h;
  Tensor d = Tensor::empty(std::move(shape), dt, dev, Tag::Activations);
  copy(d, h);
  return d;
}

enum class Rung { Cpu, V1, V2 };
const char* rung_name(Rung r) { return r == Rung::Cpu ? "cpu" : r == Rung::V1 ? "v1" : "v2"; }

// out, lse from the rung's forward; dq, dk, dv from its backward given the exact out (rounded) and lse.
std::vector<Vec> run(Rung r, const Case& c, const Vec& q, const Vec& k, const Vec& v, const Vec& dout,
                     const Vec& o_in, const DVec& lse_in) {
  const Device dev = r == Rung::Cpu ? Device::CPU : Device::CUDA;
  const DType bf = DType::BF16;
  Tensor Q = on({c.B, c.Sq, c.H, c.hd}, q, bf, dev), K = on({c.B, c.Sk, c.KVH, c.hd}, k, bf, dev);
  Tensor V = on({c.B, c.Sk, c.KVH, c.hd}, v, bf, dev), dO = on(Q.shape, dout, bf, dev);
  Tensor qp = on({c.Sq}, c.qpos, DType::I32, dev), kp = on({c.Sk}, c.kpos, DType::I32, dev);
  Tensor O = Tensor::empty(Q.shape, bf, dev, Tag::Activations), L = Tensor::empty({c.B, c.H, c.Sq}, DType::F32, dev, Tag::Activations);
  Tensor dQ = Tensor::empty(Q.shape, bf, dev, Tag::Activations), dK = Tensor::empty(K.shape, bf, dev, Tag::Activations);
  Tensor dV = Tensor::empty(K.shape, bf, dev, Tag::Activations);
  Tensor Oin = on(Q.shape, o_in, bf, dev), Lin = on({c.B, c.H, c.Sq}, Vec(lse_in.begin(), lse_in.end()), DType::F32, dev);
  if (r == Rung::V2) {
    REQUIRE(cuda::attention_v2_supports(Q, K, V, O));
    cuda::attention_forward_v2(O, L, Q, K, V, qp, kp);
    cuda::attention_backward_v2(dQ, dK, dV, dO, Oin, Lin, Q, K, V, qp, kp);
  } else if (r == Rung::V1) {
    cuda::attention_forward_v1(O, L, Q, K, V, qp, kp);
    cuda::attention_backward_v1(dQ, dK, dV, dO, Oin, Lin, Q, K, V, qp, kp);
  } else {
    attention_forward(O, L, Q, K, V, qp, kp);
    attention_backward(dQ, dK, dV, dO, Oin, Lin, Q, K, V, qp, kp);
  }
  return {to_host_f32(O), to_host_f32(L), to_host_f32(dQ), to_host_f32(dK), to_host_f32(dV)};
}

// Runs every rung on case c and holds each output to its bound; returns v2's outputs.
std::vector<Vec> check_case(const Case& c, uint64_t seed) {
  const Vec q = bf16_randn(c.B * c.Sq * c.H * c.hd, seed), k = bf16_randn(c.B * c.Sk * c.KVH * c.hd, seed + 1);
  const Vec v = bf16_randn(c.B * c.Sk * c.KVH * c.hd, seed + 2), dout = bf16_randn(c.B * c.Sq * c.H * c.hd, seed + 3);
  Vec o_in;
  const Exact e = exact(c, q, k, v, dout, o_in);
  auto row_of_q = [&](size_t x) {  // element of a q-like tensor → its (b, h, i) row's smag
    const int64_t hh = int64_t(x) / c.hd % c.H, i = int64_t(x) / (c.hd * c.H) % c.Sq, b = int64_t(x) / (c.hd * c.H * c.Sq);
    return e.smag[size_t((b * c.H + hh) * c.Sq + i)];
  };
  double smax = 0;
  for (double s : e.smag) smax = std::max(smax, s);
  auto any_row = [&](size_t) { return smax; };  // dK, dV gather every query row
  std::vector<Vec> v2;
  for (Rung r : {Rung::Cpu, Rung::V1, Rung::V2}) {
    INFO(c.name << ", " << rung_name(r));
    const std::vector<Vec> got = run(r, c, q, k, v, dout, o_in, e.lse);
    const Bounds bd{c, r == Rung::V2 ? 0x1p-8 : 0.0};
    for (size_t x = 0; x < e.lse.size(); x++) {
      if (e.lse[x] == -INFINITY) {
        REQUIRE(got[1][x] == -INFINITY);  // no visible key: lse = -inf, the merge's neutral element
        continue;
      }
      REQUIRE(std::fabs(got[1][x] - e.lse[x]) <= 4 * 0x1p-24 * (double(c.hd) * e.smag[x] + std::fabs(e.lse[x]) + 1));
    }
    CHECK(bd.worst(got[0], e.out, e.out_mag, row_of_q) <= 1.0);
    CHECK(bd.worst(got[2], e.dq, e.dq_mag, row_of_q) <= 1.0);
    CHECK(bd.worst(got[3], e.dk, e.dk_mag, any_row) <= 1.0);
    CHECK(bd.worst(got[4], e.dv, e.dv_mag, any_row) <= 1.0);
    if (r == Rung::V2) v2 = got;
  }
  return v2;
}

}  // namespace

TEST_CASE("attention v2 (tensor cores) against v1, the CPU and the exact attention: head dims, GQA, masks",
          "[cuda][attention]") {
  if (!cuda_available()) {
    WARN("no GPU visible: attention v2 not run");
    return;
  }
  const std::vector<Case> cases = {
      // causal, positions offset by 5 (masks use positions, not indices), 70 = 64 + 6 rows
      {"hd 64, GQA 1, causal, S 70", 1, 70, 70, 2, 2, 64, iota(70, 5), iota(70, 5)},
      // not causal: every query after every key
      {"hd 64, GQA 2, not causal, S 33", 2, 33, 33, 4, 2, 64, IVec(33, 1000), iota(33, 0)},
      {"hd 128, GQA 4, causal, S 97", 1, 97, 97, 4, 1, 128, iota(97, 0), iota(97, 0)},
      // a ring block: queries hold zigzag chunks {0..15, 112..127}, keys the chunk {16..47}:
      // the first 16 queries see no key, the last 16 see all of them
      {"hd 128, GQA 2, ring block", 1, 32, 32, 2, 1, 128, cat(iota(16, 0), iota(16, 112)), iota(32, 16)},
      // queries 30 positions after their keys: the mask's diagonal crosses the tiles off their corners
      {"hd 64, GQA 4, shifted diagonal, S 72", 1, 72, 72, 4, 1, 64, iota(72, 30), iota(72, 0)},
  };
  for (size_t n = 0; n < cases.size(); n++) check_case(cases[n], 7000 + 10 * n);
}

TEST_CASE("attention v2 gives the same bits run to run", "[cuda][attention]") {
  if (!cuda_available()) {
    WARN("no GPU visible: attention v2 not run");
    return;
  }
  const Case c{"hd 64, GQA 2, causal, S 65", 1, 65, 65, 4, 2, 64, iota(65, 0), iota(65, 0)};
  const std::vector<Vec> a = check_case(c, 8100), b = check_case(c, 8100);
  for (size_t t = 0; t < a.size(); t++) {
    INFO("output " << t);
    REQUIRE(a[t].size() == b[t].size());
    CHECK(std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) == 0);
  }
}

#endif  // TS_CUDA
