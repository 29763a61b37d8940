// ranks: 1
// The mixture-of-experts block (common/model/moe.h) against a naive double-precision model written here:
// router (softmax, top-k with ties to the lower index, renormalised weights), capacity per
// sequence with the earliest tokens first, the experts, the combine and the auxiliary
// load-balancing loss; forward outputs, and gradients against central differences of the
// reference loss. Then 01 with --experts end to end: memory measured = predicted, Mixtral's names
// and config in the checkpoint, a dense model untouched, bad input. With a GPU, every MoE kernel's
// CUDA twin against the CPU one.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "training/checkpoint_files.h"
#include "model/mlp_block.h"
#include "tensor/rng.h"
#include "formats/safetensors.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "test_util.h"

using namespace ts;
using DVec = std::vector<double>;

namespace {

// ----- the reference: y = Σ_k w_k · W2 (silu(W1 x) ⊙ W3 x) over the kept top-k experts ---------
struct Ref {
  int B, S, D, F, E, K;
  int64_t cap;        // rows per expert and sequence, −1: dropless
  double aux_weight;  // the loss carries aux_weight · Σ_b aux_b
  DVec wg;            // [E, D]
  std::vector<DVec> w1, w3, w2;  // per expert [F, D], [F, D], [D, F]
  // DeepSeekMoE: the sigmoid router with its bias, groups and scaling; the shared SwiGLU
  // (sw1, sw3 [FS, D], sw2 [D, FS]; empty: none).
  bool sigmoid = false;
  DVec bias;
  int G = 1, M = 1;
  double scale = 1;
  DVec sw1, sw3, sw2;
};

struct RefOut {
  DVec y;
  std::vector<std::vector<int>> chosen;  // [N][K]
  std::vector<std::vector<bool>> kept;
  double aux = 0;  // Σ_b aux_b
};

double silu(double x) { return x / (1 + std::exp(-x)); }

double silu_mlp(const DVec& w1, const DVec& w3, const DVec& w2, const double* x, int D, int d) {
  const int F = int(w1.size()) / D;
  double v = 0;
  for (int f = 0; f < F; f++) {
    double g = 0, u = 0;
    for (int i = 0; i < D; i++) g += w1[size_t(f) * D + i] * x[i], u += w3[size_t(f) * D + i] * x[i];
    v += w2[size_t(d) * F + f] * silu(g) * u;
  }
  return v;
}

// The K choices of one token: the largest of v, ties to the lower index; with groups (DeepSeek-V3,
// Hugging Face's code) v is the biased score, a group scores by the sum of its two largest, the M
// best groups stay and the others' experts count 0.
std::vector<int> ref_choose(const Ref& r, DVec v) {
  if (r.G > 1) {
    const int per = r.E / r.G;
    DVec gs(size_t(r.G));
    for (int g = 0; g < r.G; g++) {
      DVec x(v.begin() + g * per, v.begin() + (g + 1) * per);
      std::sort(x.rbegin(), x.rend());
      gs[size_t(g)] = x[0] + x[1];
    }
    std::vector<bool> keep(size_t(r.G), false);
    for (int m = 0; m < r.M; m++) {
      int best = -1;
      for (int g = 0; g < r.G; g++)
        if (!keep[size_t(g)] && (best < 0 || gs[size_t(g)] > gs[size_t(best)])) best = g;
      keep[size_t(best)] = true;
    }
    for (int e = 0; e < r.E; e++)
      if (!keep[size_t(e / per)]) v[size_t(e)] = 0;
  }
  std::vector<int> c;
  for (int k = 0; k < r.K; k++) {
    int best = -1;
    for (int e = 0; e < r.E; e++)
      if (std::find(c.begin(), c.end(), e) == c.end() && (best < 0 || v[size_t(e)] > v[size_t(best)])) best = e;
    c.push_back(best);
  }
  return c;
}

// Router probabilities p (softmax, or the sigmoid scores) and what the balance loss averages (p,
// or s' = s/Σ s), for token t.
void ref_router(const Ref& r, const double* x, DVec& p, DVec& pbal) {
  DVec z(size_t(r.E), 0.0);
  for (int e = 0; e < r.E; e++)
    for (int d = 0; d < r.D; d++) z[size_t(e)] += r.wg[size_t(e) * r.D + d] * x[d];
  double mx = -1e300, sum = 0;
  for (double v : z) mx = std::max(mx, v);
  for (int e = 0; e < r.E; e++) {
    p[size_t(e)] = r.sigmoid ? 1 / (1 + std::exp(-z[size_t(e)])) : std::exp(z[size_t(e)] - mx);
    sum += p[size_t(e)];
  }
  for (int e = 0; e < r.E; e++) {
    if (!r.sigmoid) p[size_t(e)] /= sum;
    pbal[size_t(e)] = r.sigmoid ? p[size_t(e)] / sum : p[size_t(e)];
  }
}

RefOut ref_forward(const Ref& r, const DVec& h) {
  const int N = r.B * r.S;
  RefOut o;
  o.y.assign(size_t(N) * r.D, 0);
  DVec p(size_t(N) * r.E), pbal(size_t(N) * r.E);
  for (int t = 0; t < N; t++) {
    DVec pt(size_t(r.E)), bt(size_t(r.E));
    ref_router(r, h.data() + size_t(t) * r.D, pt, bt);
    std::copy(pt.begin(), pt.end(), p.begin() + size_t(t) * r.E);
    std::copy(bt.begin(), bt.end(), pbal.begin() + size_t(t) * r.E);
    DVec v = pt;
    if (r.sigmoid)
      for (int e = 0; e < r.E; e++) v[size_t(e)] = float(float(pt[size_t(e)]) + float(r.bias[size_t(e)]));
    o.chosen.push_back(ref_choose(r, v));
  }
  for (int b = 0; b < r.B; b++) {
    std::vector<int64_t> taken(size_t(r.E), 0), cnt(size_t(r.E), 0);
    for (int t = b * r.S; t < (b + 1) * r.S; t++) {
      std::vector<bool> kept;
      double s = r.sigmoid ? 1e-20 : 0;
      for (int e : o.chosen[size_t(t)]) s += p[size_t(t) * r.E + e];
      const double* x = h.data() + size_t(t) * r.D;
      for (int e : o.chosen[size_t(t)]) {
        cnt[size_t(e)]++;
        const bool keep = r.cap < 0 || taken[size_t(e)] < r.cap;
        kept.push_back(keep);
        if (!keep) continue;
        taken[size_t(e)]++;
        const double w = r.scale * p[size_t(t) * r.E + e] / s;
        for (int d = 0; d < r.D; d++) o.y[size_t(t) * r.D + d] += w * silu_mlp(r.w1[size_t(e)], r.w3[size_t(e)], r.w2[size_t(e)], x, r.D, d);
      }
      if (!r.sw1.empty())
        for (int d = 0; d < r.D; d++) o.y[size_t(t) * r.D + d] += silu_mlp(r.sw1, r.sw3, r.sw2, x, r.D, d);
      o.kept.push_back(kept);
    }
    // Switch's aux = E · Σ_e f_e P_e with f over the sequence's S·K choices (DeepSeek-V3's eq. 17–20
    // with s' for p).
    for (int e = 0; e < r.E; e++) {
      double P = 0;
      for (int t = b * r.S; t < (b + 1) * r.S; t++) P += pbal[size_t(t) * r.E + e];
      o.aux += r.E * (double(cnt[size_t(e)]) / (r.S * r.K)) * (P / r.S);
    }
  }
  return o;
}

double ref_loss(const Ref& r, const DVec& h, const DVec& R) {
  RefOut o = ref_forward(r, h);
  double l = r.aux_weight * o.aux;
  for (size_t i = 0; i < o.y.size(); i++) l += o.y[i] * R[i];
  return l;
}

// Central difference of the reference loss in one coordinate of `v` (a reference of r or h).
double numeric_grad(const Ref& r, DVec& h, const DVec& R, DVec& v, size_t i) {
  const double eps = 1e-5, keep = v[i];
  v[i] = keep + eps;
  const double lp = ref_loss(r, h, R);
  v[i] = keep - eps;
  const double lm = ref_loss(r, h, R);
  v[i] = keep;
  return (lp - lm) / (2 * eps);
}

DVec host(const Tensor& t) {
  std::vector<float> v = to_host_f32(t);
  return DVec(v.begin(), v.end());
}

double max_abs(const DVec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The largest |a − b| relative to the largest |b| (the gradient's scale).
double rel_diff(const DVec& a, const DVec& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); i++) m = std::max(m, std::fabs(a[i] - b[i]));
  return m / std::max(1e-30, max_abs(b));
}

struct Case {
  const char* name;
  int K;
  float capacity;
  bool one_expert;  // every token's logits favour expert E-1: the others get no rows
  // DeepSeekMoE: the sigmoid router (8 experts of width 4, routed scaling 2.5, a bias that
  // changes the choices) in G groups of which M are kept, S shared experts.
  bool sigmoid = false;
  int G = 1, M = 1, shared = 0;
};

ModelConfig block_config(const Case& cs) {
  ModelConfig c;
  c.dim = 8, c.layers = 1, c.heads = 2, c.kv_heads = 1, c.ffn = 6, c.vocab = 16, c.seq = 6;
  c.experts = 4, c.top_k = cs.K, c.capacity_factor = cs.capacity, c.aux_loss_coef = 0.3f;
  if (cs.sigmoid || cs.shared > 0) c.experts = 8, c.expert_ffn = 4, c.shared_experts = cs.shared;
  c.sigmoid_router = cs.sigmoid, c.expert_groups = cs.G, c.group_limit = cs.M;
  if (cs.sigmoid) c.routed_scaling = 2.5f, c.bias_update_rate = 0.001f;
  return c;
}

// The reference holding the model's weights (the bias set to values that change the choices).
Ref block_reference(Model& m, const Case& cs, int B) {
  const ModelConfig& c = m.cfg;
  Ref r{B, c.seq, c.dim, c.expert_width(), c.experts, cs.K, expert_capacity(c, c.seq),
        double(c.aux_loss_coef) * m.loss_scale * c.seq, host(m.weight(m.entry(moe_gate_name(m.cfg, 0)))), {}, {}, {}};
  for (int j = 0; j < c.experts; j++) {
    r.w1.push_back(host(m.weight(m.entry(moe_expert_name(m.cfg, 0, j, "gate_proj")))));
    r.w3.push_back(host(m.weight(m.entry(moe_expert_name(m.cfg, 0, j, "up_proj")))));
    r.w2.push_back(host(m.weight(m.entry(moe_expert_name(m.cfg, 0, j, "down_proj")))));
  }
  r.sigmoid = cs.sigmoid, r.G = cs.G, r.M = cs.M, r.scale = c.routed_scaling;
  if (cs.sigmoid) {
    const Tensor b = m.weight(m.entry(moe_bias_name(0)));
    for (int e = 0; e < c.experts; e++) b.f32()[e] = 0.3f * float(e % 3) - 0.3f;
    r.bias = host(b);
  }
  if (cs.shared > 0) {
    r.sw1 = host(m.weight(m.entry(moe_shared_name(0, "gate_proj"))));
    r.sw3 = host(m.weight(m.entry(moe_shared_name(0, "up_proj"))));
    r.sw2 = host(m.weight(m.entry(moe_shared_name(0, "down_proj"))));
  }
  return r;
}

}  // namespace

TEST_CASE("router kernel: softmax, top-k with ties to the lower index, renormalised weights", "[moe][kernels]") {
  const std::vector<float> z = {1, 3, 3, 0, 2, 2, 2, 2, 0, 0, 5, 5};
  Tensor logits = Tensor::empty({3, 4}, DType::F32, Device::CPU, Tag::Workspace);
  from_host_f32(logits, z.data());
  Tensor probs = Tensor::empty({3, 4}, DType::F32, Device::CPU, Tag::Workspace);
  Tensor idx = Tensor::empty({3, 2}, DType::I32, Device::CPU, Tag::Workspace);
  Tensor w = Tensor::empty({3, 2}, DType::F32, Device::CPU, Tag::Workspace);
  moe_router_forward(probs, idx, w, logits);
  const std::vector<int32_t> want = {1, 2, 0, 1, 2, 3};
  for (int i = 0; i < 6; i++) CHECK(idx.i32()[i] == want[size_t(i)]);
  for (int i = 0; i < 6; i++) CHECK(w.f32()[i] == Approx(0.5).epsilon(1e-7));
  const double s = std::exp(1.0) + 2 * std::exp(3.0) + 1;
  CHECK(probs.f32()[1] == Approx(std::exp(3.0) / s).epsilon(1e-7));
}

// DeepSeek-V3's router on hand-built rows: 8 experts in 4 groups of 2 (sigmoid is monotone, so the
// logits order the scores).
TEST_CASE("sigmoid router kernel: group-limited top-k, ties to the lower index, the bias only selects",
          "[moe][kernels]") {
  auto route = [](const std::vector<float>& z, const std::vector<float>& bias, int K, int G, int M) {
    const int64_t N = int64_t(z.size()) / 8;
    Tensor logits = Tensor::empty({N, 8}, DType::F32, Device::CPU, Tag::Workspace), b;
    from_host_f32(logits, z.data());
    if (!bias.empty()) {
      b = Tensor::empty({8}, DType::F32, Device::CPU, Tag::Workspace);
      from_host_f32(b, bias.data());
    }
    Tensor s = Tensor::empty({N, 8}, DType::F32, Device::CPU, Tag::Workspace);
    Tensor idx = Tensor::empty({N, K}, DType::I32, Device::CPU, Tag::Workspace);
    Tensor w = Tensor::empty({N, K}, DType::F32, Device::CPU, Tag::Workspace);
    moe_router_sigmoid_forward(s, idx, w, logits, b, G, M, 2.5f);
    return std::make_pair(std::vector<int32_t>(idx.i32(), idx.i32() + N * K), to_host_f32(w));
  };
  // Row 0: expert 0 scores highest but its group (with expert 1) sums lowest, so it is not chosen;
  // groups 2 and 1 stay, experts 4 and 5 first, then 2 and 3 tie: 2. Row 1: groups 0, 2 and 3
  // tie, the lower two stay; their four experts tie: 0, 1, 4.
  auto [i0, w0] = route({3, -3, 1, 1, 2, 2, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1}, {}, 3, 4, 2);
  CHECK(i0 == std::vector<int32_t>{4, 5, 2, 0, 1, 4});
  const double s1 = 1 / (1 + std::exp(-1.0)), s2 = 1 / (1 + std::exp(-2.0));
  CHECK(w0[0] == Approx(2.5 * s2 / (2 * s2 + s1)).epsilon(1e-6));
  CHECK(w0[3] == Approx(2.5 / 3).epsilon(1e-6));
  // Without groups the highest score wins.
  CHECK(route({3, -3, 1, 1, 2, 2, 0, 0}, {}, 3, 1, 1).first == std::vector<int32_t>{0, 4, 5});
  // The bias decides: every score 0.5, expert 6 biased up, so group 3 and expert 6 win, then
  // group 0's experts; the weights are the unbiased scores, all equal.
  auto [i2, w2] = route(std::vector<float>(8, 0.f), {0, 0, 0, 0, 0, 0, 0.5f, 0}, 3, 4, 2);
  CHECK(i2 == std::vector<int32_t>{6, 0, 1});
  for (float v : w2) CHECK(v == Approx(2.5 / 3).epsilon(1e-6));
  // The dropped groups' experts are −∞, not 0.0 (older transformers' masked_fill): with the biased
  // scores of the kept group negative, its experts still win over the masked ones, in score order.
  CHECK(route(std::vector<float>(8, 0.f), {-1, -1, -1, -1, -1, -1, -0.9f, -0.95f}, 1, 4, 1).first ==
        std::vector<int32_t>{6});
  CHECK(route(std::vector<float>(8, 0.f), {-1, -1, -1, -1, -1, -1, -0.9f, -0.95f}, 3, 4, 2).first ==
        std::vector<int32_t>{6, 7, 0});
}

TEST_CASE("sigmoid router kernel: forward against double, backward against central differences", "[moe][kernels]") {
  const int64_t S = 5, B = 2, N = S * B, E = 8, K = 3;
  std::vector<float> z(static_cast<size_t>(N * E)), bias(static_cast<size_t>(E)), dw(static_cast<size_t>(N * K)),
      daux(static_cast<size_t>(B * E));
  for (size_t i = 0; i < z.size(); i++) z[i] = 2 * rng_normal(21, i);
  for (size_t i = 0; i < bias.size(); i++) bias[i] = 0.2f * rng_normal(22, i);
  for (size_t i = 0; i < dw.size(); i++) dw[i] = rng_normal(23, i);
  for (size_t i = 0; i < daux.size(); i++) daux[i] = rng_normal(24, i);
  auto cpu = [](std::vector<int64_t> shape, const std::vector<float>& v) {
    Tensor t = Tensor::empty(shape, DType::F32, Device::CPU, Tag::Workspace);
    from_host_f32(t, v.data());
    return t;
  };
  Tensor logits = cpu({N, E}, z), sc = cpu({N, E}, z), w = cpu({N, K}, dw), dz = cpu({N, E}, z);
  Tensor idx = Tensor::empty({N, K}, DType::I32, Device::CPU, Tag::Workspace);
  moe_router_sigmoid_forward(sc, idx, w, logits, cpu({E}, bias), 4, 2, 2.5f);
  moe_router_sigmoid_backward(dz, cpu({N, K}, dw), sc, idx, cpu({B, E}, daux), S, 2.5f);
  // L = Σ dw·w + Σ daux·s' in double, the choices held fixed (they are piecewise constant).
  auto loss = [&](const std::vector<double>& zz, int64_t n) {
    DVec s(static_cast<size_t>(E));
    double sum = 0, sel = 1e-20, l = 0;
    for (int e = 0; e < E; e++) s[size_t(e)] = 1 / (1 + std::exp(-zz[size_t(e)])), sum += s[size_t(e)];
    for (int k = 0; k < K; k++) sel += s[size_t(idx.i32()[n * K + k])];
    for (int k = 0; k < K; k++) l += dw[size_t(n * K + k)] * 2.5 * s[size_t(idx.i32()[n * K + k])] / sel;
    for (int e = 0; e < E; e++) l += daux[size_t((n / S) * E + e)] * s[size_t(e)] / sum;
    return l;
  };
  double worst = 0, scale = 0;
  for (int64_t n = 0; n < N; n++) {
    std::vector<double> zz(z.begin() + n * E, z.begin() + (n + 1) * E);
    for (int e = 0; e < E; e++) {
      CHECK(sc.f32()[n * E + e] == Approx(1 / (1 + std::exp(-zz[size_t(e)]))).epsilon(1e-7));
      const double keep = zz[size_t(e)];
      zz[size_t(e)] = keep + 1e-5;
      const double lp = loss(zz, n);
      zz[size_t(e)] = keep - 1e-5;
      const double num = (lp - loss(zz, n)) / 2e-5;
      zz[size_t(e)] = keep;
      worst = std::max(worst, std::fabs(num - dz.f32()[n * E + e]));
      scale = std::max(scale, std::fabs(num));
    }
  }
  CHECK(worst <= 1e-6 * scale);
  CHECK(scale > 0.01);
}

TEST_CASE("bias update: b_e += γ·sign(mean load − load_e), equal loads leave it", "[moe][kernels]") {
  std::vector<float> b = {0.5f, 0.5f, 0.5f, 0.5f};
  const std::vector<int64_t> load = {10, 30, 20, 20};
  moe_bias_update(b.data(), load.data(), 4, 0.001f);
  CHECK(b == std::vector<float>{0.5f + 0.001f, 0.5f - 0.001f, 0.5f, 0.5f});
  const std::vector<int64_t> odd = {1, 2, 2};  // mean 5/3 is not an integer: the sign is still exact
  std::vector<float> c(3, 0.f);
  moe_bias_update(c.data(), odd.data(), 3, 1.f);
  CHECK(c == std::vector<float>{1.f, -1.f, -1.f});
}

TEST_CASE("routing plan: capacity per sequence keeps the earliest tokens, grouped per expert in token order",
          "[moe]") {
  // 2 sequences of 3 tokens, top-1 of 2 experts, capacity 1 row per expert and sequence.
  const std::vector<int32_t> idx = {1, 1, 0, 0, 0, 0};
  const std::vector<float> w(6, 1.f);
  RoutingPlan p = make_routing_plan(idx, w, 2, 3, 2, 1, 1);
  CHECK(p.kept == std::vector<int64_t>{2, 1});
  CHECK(p.perm == std::vector<int32_t>{2, 3, 0});  // expert 0: tokens 2, 3; expert 1: token 0
  CHECK(p.src == std::vector<int32_t>{2, -1, 0, 1, -1, -1});
  CHECK(p.dropped == 3);
  CHECK(p.seq_counts == std::vector<int64_t>{1, 2, 3, 0});
  RoutingPlan all = make_routing_plan(idx, w, 2, 3, 2, 1, -1);
  CHECK(all.dropped == 0);
  CHECK(all.kept == std::vector<int64_t>{4, 2});
}

// fp32 against double: measured output differences ≤ 1.7e-7 and gradient differences ≤ 2.8e-7 of
// each tensor's largest element (central differences at eps 1e-5 add ~1e-9); asserted at 2e-6.
TEST_CASE("MoE block against the naive double reference: forward, gradients, dropped tokens, empty experts",
          "[moe]") {
  for (const Case& cs : {Case{"top-2 dropless", 2, 0.f, false}, Case{"top-1 dropless", 1, 0.f, false},
                         Case{"top-2 capacity 0.5 (drops)", 2, 0.5f, false}, Case{"top-1 capacity 1", 1, 1.f, false},
                         Case{"all tokens to one expert", 1, 0.f, true},
                         Case{"sigmoid top-2", 2, 0.f, false, true},
                         Case{"sigmoid top-3, 4 groups keep 2, 1 shared expert", 3, 0.f, false, true, 4, 2, 1},
                         Case{"sigmoid top-1, capacity 1, 2 shared experts", 1, 1.f, false, true, 1, 1, 2},
                         Case{"softmax with 2 shared experts", 2, 0.f, false, false, 1, 1, 2}}) {
    INFO(cs.name);
    const ModelConfig c = block_config(cs);
    Model m(c, Device::CPU, DType::F32, Recompute::None);
    Model::init_range(m.table, 7, 0, m.table.total, m.params);
    const int B = 2, S = c.seq, N = B * S, D = c.dim, E = c.experts;
    m.loss_scale = 1.f / (4 * S);  // as if the global batch had 4 sequences
    // Larger weights than the init's 0.02 so that the experts and the router matter.
    scale_inplace(m.params, 20.f);
    DVec hv(size_t(N) * D), R(size_t(N) * D);
    for (size_t i = 0; i < hv.size(); i++) hv[i] = rng_normal(11, i), R[i] = rng_normal(12, i);
    const int gate = m.entry(moe_gate_name(m.cfg, 0));
    if (cs.one_expert) {
      for (int t = 0; t < N; t++) hv[size_t(t) * D] = 2 + std::fabs(hv[size_t(t) * D]);
      m.weight(gate).f32()[(E - 1) * D] = 50.f;
    }
    Ref r = block_reference(m, cs, B);
    auto tensor = [&](const DVec& v) {
      Tensor t = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Workspace);
      for (size_t i = 0; i < v.size(); i++) t.f32()[i] = float(v[i]);
      return t;
    };
    Tensor h = tensor(hv), dy = tensor(R), y = tensor(R), dh = tensor(R);
    LayerActs a;
    m.mlp->forward(m, 0, y, h, a);
    const RefOut o = ref_forward(r, hv);
    CHECK(rel_diff(host(y), o.y) <= 2e-6);
    CHECK(a.aux_loss == Approx(c.aux_loss_coef * o.aux).epsilon(1e-6));
    int dropped = 0;
    for (auto& k : o.kept) dropped += int(std::count(k.begin(), k.end(), false));
    if (cs.capacity > 0 && cs.K == 2) CHECK(dropped > 0);
    if (cs.capacity == 0) CHECK(dropped == 0);
    zero(m.grads);
    m.mlp->backward(m, 0, dh, dy, h, a);
    auto& moe = dynamic_cast<MoeBlock&>(*m.mlp);
    CHECK(moe.stats.dropped == dropped);
    // The gradients against central differences of the reference loss.
    DVec num(hv.size());
    for (size_t i = 0; i < hv.size(); i++) num[i] = numeric_grad(r, hv, R, hv, i);
    CHECK(rel_diff(host(dh), num) <= 2e-6);
    DVec ng(r.wg.size());
    for (size_t i = 0; i < r.wg.size(); i++) ng[i] = numeric_grad(r, hv, R, r.wg, i);
    CHECK(rel_diff(host(m.grad(gate)), ng) <= 2e-6);
    for (int j = 0; j < E; j++) {
      INFO("expert " << j);
      for (auto [w, vec] : {std::pair<const char*, DVec*>{"gate_proj", &r.w1[size_t(j)]}, {"up_proj", &r.w3[size_t(j)]},
                            {"down_proj", &r.w2[size_t(j)]}}) {
        DVec n(vec->size());
        for (size_t i = 0; i < vec->size(); i++) n[i] = numeric_grad(r, hv, R, *vec, i);
        const DVec got = host(m.grad(m.entry(moe_expert_name(m.cfg, 0, j, w))));
        if (max_abs(n) == 0) CHECK(max_abs(got) == 0);  // an expert without rows gets no gradient
        else CHECK(rel_diff(got, n) <= 2e-6);
        if (cs.one_expert && j < E - 1) CHECK(max_abs(got) == 0);
      }
    }
    if (cs.shared > 0)
      for (auto [w, vec] : {std::pair<const char*, DVec*>{"gate_proj", &r.sw1}, {"up_proj", &r.sw3}, {"down_proj", &r.sw2}}) {
        INFO("shared " << w);
        DVec n(vec->size());
        for (size_t i = 0; i < vec->size(); i++) n[i] = numeric_grad(r, hv, R, *vec, i);
        CHECK(rel_diff(host(m.grad(m.entry(moe_shared_name(0, w)))), n) <= 2e-6);
      }
    if (cs.sigmoid) CHECK(max_abs(host(m.grad(m.entry(moe_bias_name(0))))) == 0);  // the bias only selects
  }
}

// ----- 01 with --experts, end to end --------------------------------------------------------------

const std::string kMoe = "--preset tiny --experts 4 --top-k 2 --ffn 64 --quiet --lr-schedule constant ";

// LayerActs::mlp_state is the block's MoeActs: each saved tensor under its name, of the shape its
// comment gives (a dropped assignment: src −1, no row), the shared experts' only with them.
TEST_CASE("MoE block: what forward saves for backward is named", "[moe]") {
  const Case cs{"sigmoid top-2, capacity 0.5, 1 shared expert", 2, 0.5f, false, true, 1, 1, 1};
  const ModelConfig c = block_config(cs);
  Model m(c, Device::CPU, DType::F32, Recompute::None);
  Model::init_range(m.table, 7, 0, m.table.total, m.params);
  const int B = 2, N = B * c.seq, D = c.dim, E = c.experts, K = c.top_k;
  Tensor h = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Workspace);
  Tensor y = Tensor::empty({N, D}, DType::F32, Device::CPU, Tag::Workspace);
  for (int64_t i = 0; i < h.numel(); i++) h.f32()[i] = float(rng_normal(11, uint64_t(i)));
  LayerActs a;
  m.mlp->forward(m, 0, y, h, a);
  const MoeActs& s = MoeBlock::acts(a);
  CHECK(s.probs.shape == std::vector<int64_t>{N, E});
  CHECK(s.idx.shape == std::vector<int64_t>{N, K});
  CHECK(s.src.shape == std::vector<int64_t>{N, K});
  const int64_t M = s.perm.numel();
  int64_t kept = 0, dropped = 0;
  for (int64_t i = 0; i < s.src.numel(); i++) (s.src.i32()[i] < 0 ? dropped : kept)++;
  CHECK(dropped > 0);
  CHECK(M == kept);
  CHECK(s.wa.numel() == M);
  CHECK(s.in.shape == std::vector<int64_t>{M, D});
  CHECK(s.out.shape == std::vector<int64_t>{M, D});
  CHECK(s.host_counts.numel() == int64_t(B) * E + E + 1);
  CHECK(s.host_counts.i32()[B * E + E] == dropped);
  CHECK(s.host_aux.numel() == B);
  CHECK(s.shared_g.shape == std::vector<int64_t>{N, c.expert_width()});
  CHECK(s.shared_act.defined());
}

TEST_CASE("01 --experts: activations, params and grads measured = predicted; Mixtral checkpoint", "[moe][e2e]") {
  for (const char* rc : {"--recompute none", "--recompute selective", "--recompute full"}) {
    const tst::CachedRun& run = tst::cached_run("01_single_gpu", 1, kMoe + "--steps 3 --batch 4 --micro-batch 2 " + rc);
    INFO(rc);
    const ts::Json& mem = run.log.summary.at("memory");
    for (const char* cat : {"params", "grads", "optimizer", "activations"})
      CHECK(mem.at(cat).at("measured").as_double() == mem.at(cat).at("predicted").as_double());
    // Ψ = embeddings 2·V·D + per layer (attention 2D² + 2·KV·D, norms 2D, router E·D, experts E·3·F·D) + final norm.
    const double D = 64, V = 256, KV = 32, F = 64, E = 4, L = 2;
    CHECK(mem.at("params").at("measured").as_double() == 4 * (2 * V * D + L * (2 * D * D + 2 * KV * D + 2 * D + E * D + E * 3 * F * D) + D));
    const ts::Json& s0 = run.log.steps[0];
    CHECK(s0.at("moe_tokens_mean").as_double() == 4 * 32 * 2 / 4.0);  // N·K / E per layer
    CHECK(s0.at("moe_tokens_per_expert").size() == 8);
    CHECK(s0.at("moe_dropped_fraction").as_double() == 0);
    CHECK(s0.at("moe_aux_loss").as_double() >= 2.0 * 0.999);  // ≥ 1 per layer, 1 only when balanced
  }
  const tst::CachedRun& run = tst::cached_run("01_single_gpu", 1, kMoe + "--steps 3 --batch 4 --micro-batch 2 --recompute none");
  const ts::Json cfg = ts::Json::parse(tst::run("cat " + run.ckpt + "/config.json").output);
  CHECK(cfg.at("architectures").as_array().at(0).as_string() == "MixtralForCausalLM");
  CHECK(cfg.at("num_local_experts").as_int() == 4);
  CHECK(cfg.at("num_experts_per_tok").as_int() == 2);
  ts::SafetensorsReader st(run.ckpt + "/model.safetensors");
  CHECK(st.has("model.layers.1.block_sparse_moe.gate.weight"));
  CHECK(st.entry("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape == std::vector<int64_t>{64, 64});
  CHECK(!st.has("model.layers.0.mlp.gate_proj.weight"));
}

TEST_CASE("01 --experts: accumulation and recompute give the same losses; capacity drops; aux changes the routing",
          "[moe][e2e]") {
  auto losses = [](const std::string& a) { return tst::cached_run("01_single_gpu", 1, kMoe + "--steps 4 --batch 4 " + a).log; };
  const tst::Log ref = losses("--micro-batch 4");
  // Measured: accumulation ≤ 3e-8 relative (the same rows, other matmul shapes), recompute 0.
  CHECK(tst::max_rel_diff(losses("--micro-batch 2").losses(), ref.losses()) <= 1e-6);
  CHECK(tst::max_rel_diff(losses("--micro-batch 4 --recompute full").losses(), ref.losses()) == 0);
  const tst::Log cap = losses("--micro-batch 4 --capacity-factor 1");
  CHECK(cap.steps[0].at("moe_dropped_fraction").as_double() > 0);
  CHECK(cap.steps[0].at("loss").as_double() != ref.steps[0].at("loss").as_double());  // dropped rows change the output
  const tst::Log aux = losses("--micro-batch 4 --aux-loss-coef 0.5");
  CHECK(aux.steps[0].at("loss").as_double() == ref.steps[0].at("loss").as_double());  // CE of step 0 is unchanged
  CHECK(aux.steps[3].at("loss").as_double() != ref.steps[3].at("loss").as_double());  // its gradient moved the router
}

// ----- 01 with DeepSeekMoE --------------------------------------------------------------------------

const std::string kDeepSeek = "--preset tiny --experts 8 --top-k 2 --ffn 64 --expert-ffn 32 --shared-experts 1 "
                              "--router sigmoid --routed-scaling 2.5 --expert-groups 4 --group-limit 2 "
                              "--aux-loss-coef 0.001 --bias-update-rate 0.001 --quiet --lr-schedule constant ";

std::vector<float> routing_bias(const std::string& ckpt, int l) {
  ts::SafetensorsReader st(ckpt + "/model.safetensors");
  std::vector<float> b(8);
  st.read(moe_bias_name(l), 0, b.data(), 8);
  return b;
}

TEST_CASE("01 DeepSeekMoE: trains, logs the loads, the bias replays from the logged loads", "[moe][e2e]") {
  const tst::CachedRun& run = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8");
  const auto& steps = run.log.steps;
  REQUIRE(steps.size() == 12);
  CHECK(steps.back().at("loss").as_double() < steps.front().at("loss").as_double() - 1.0);
  std::vector<float> bias(16, 0.f);  // [L, E], replayed: b += γ·sign(mean − load) after each step
  for (const ts::Json& s : steps) {
    CHECK(s.at("moe_load_max_over_mean").as_double() ==
          s.at("moe_tokens_max").as_double() / s.at("moe_tokens_mean").as_double());
    CHECK(s.at("moe_tokens_mean").as_double() == 8 * 32 * 2 / 8.0);
    std::vector<int64_t> load;
    for (const ts::Json& v : s.at("moe_tokens_per_expert").as_array()) load.push_back(v.as_int());
    REQUIRE(load.size() == 16);
    for (int l = 0; l < 2; l++) moe_bias_update(bias.data() + l * 8, load.data() + l * 8, 8, 0.001f);
  }
  double moved = 0;
  for (int l = 0; l < 2; l++) {
    const std::vector<float> b = routing_bias(run.ckpt, l);
    for (int e = 0; e < 8; e++) {
      CHECK(b[size_t(e)] == bias[size_t(l * 8 + e)]);  // bit for bit
      moved = std::max(moved, double(std::fabs(b[size_t(e)])));
    }
  }
  CHECK(moved > 0.005);
  ts::SafetensorsReader st(run.ckpt + "/model.safetensors");
  CHECK(st.entry(moe_shared_name(1, "down_proj")).shape == std::vector<int64_t>{64, 32});
  // transformers' Glm4Moe (the DeepseekV3 layout, checkpoint.cu's hf_config) names.
  CHECK(st.entry("model.layers.1.mlp.experts.7.gate_proj.weight").shape == std::vector<int64_t>{32, 64});
  CHECK(st.entry("model.layers.1.mlp.gate.weight").shape == std::vector<int64_t>{8, 64});
  CHECK(!st.has("model.layers.1.block_sparse_moe.gate.weight"));
  const ts::Json cfg = ts::Json::parse(tst::run("cat " + run.ckpt + "/config.json").output);
  CHECK(cfg.at("architectures").as_array().at(0).as_string() == "Glm4MoeForCausalLM");
  CHECK(cfg.at("n_routed_experts").as_int() == 8);
  CHECK(cfg.at("first_k_dense_replace").as_int() == 0);
  CHECK(st.entry(moe_bias_name(1)).shape == std::vector<int64_t>{8});
  // Recompute reruns the shared experts and the router (the bias unchanged within a step);
  // accumulation sums the same loads before the one bias update.
  const tst::Log full = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8 --recompute full").log;
  CHECK(tst::max_rel_diff(full.losses(), run.log.losses()) == 0);
  const tst::Log acc = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8 --micro-batch 2").log;
  CHECK(tst::max_rel_diff(acc.losses(), run.log.losses()) <= 1e-6);
  // The step line of a run without --quiet prints the balance measure.
  const tst::Result r = tst::run_bin("01_single_gpu", "--preset tiny --experts 4 --top-k 2 --router sigmoid --steps 1", 1, 60);
  CHECK(r.output.find("load max/mean") != std::string::npos);
}

TEST_CASE("01 DeepSeekMoE: a resume restores the bias; the bias moves the routing", "[moe][e2e][ckpt]") {
  const tst::CachedRun& ref = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8");
  const tst::CachedRun& first = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 6 --batch 8");
  tst::check_resume("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8", first.ckpt, ref, 6);
  for (int l = 0; l < 2; l++) CHECK(routing_bias(tst::scratch("resume_ck"), l) == routing_bias(ref.ckpt, l));
  // Resumed without the router or the shared experts it was trained with: refused, not ignored.
  for (auto [flags, says] : {std::pair<const char*, const char*>{"--shared-experts 1 ", "trained with the sigmoid router"},
                             {"--router sigmoid ", "has 1 shared experts, the model 0"}}) {
    const tst::Result bad = tst::run_bin("01_single_gpu", std::string("--preset tiny --experts 8 --top-k 2 --ffn 64 ") +
                                                              "--expert-ffn 32 --lr-schedule constant --steps 12 --batch 8 --resume " + first.ckpt +
                                                              " " + flags, 1, 60);
    INFO(bad.output);
    CHECK(bad.status != 0);
    CHECK(bad.output.find(says) != std::string::npos);
  }
  const tst::CachedRun& still = tst::cached_run("01_single_gpu", 1, kDeepSeek + "--steps 12 --batch 8 --bias-update-rate 0");
  CHECK(routing_bias(still.ckpt, 0) == std::vector<float>(8, 0.f));
  CHECK(still.log.steps[0].at("loss").as_double() == ref.log.steps[0].at("loss").as_double());
  CHECK(still.log.steps[11].at("moe_tokens_per_expert").dump() != ref.log.steps[11].at("moe_tokens_per_expert").dump());
}

TEST_CASE("01 --experts: bad input", "[moe][errors]") {
  tst::check_errors("01_single_gpu", "--preset tiny --steps 1 ", {
      {1, "--experts 4 --top-k 5", "--top-k 5 must be between 1 and --experts 4"},
      {1, "--experts 4 --top-k 0", "--top-k 0 must be between 1 and --experts 4"},
      {1, "--experts 4 --capacity-factor -1", "--capacity-factor must be >= 0"},
      {1, "--experts -2", "--experts must be >= 0"},
      {1, "--router sigmoid", "need --experts E"},
      {1, "--experts 4 --router tanh", "--router must be softmax or sigmoid"},
      {1, "--experts 4 --expert-groups 2", "need --router sigmoid"},
      {1, "--experts 6 --router sigmoid --expert-groups 4", "--expert-groups 4 must be >= 1 and divide --experts 6"},
      {1, "--experts 4 --router sigmoid --expert-groups 4", "fewer than 2 experts per group"},
      {1, "--experts 8 --router sigmoid --expert-groups 4 --group-limit 5", "--group-limit 5 must be between 1"},
      {1, "--experts 8 --top-k 5 --router sigmoid --expert-groups 4 --group-limit 2", "--top-k 5 exceeds the 4 experts"},
      {1, "--experts 4 --router sigmoid --routed-scaling 0", "--routed-scaling must be > 0"},
  });
  // A chapter that never reports its steps' routing would train with the bias frozen: refused.
  tst::check_errors("02_data_parallel", "--preset tiny --steps 1 --dp 2 --experts 4 --router sigmoid ",
                    {{2, "", "02_data_parallel does not move the routing bias"}});
}

// ----- CUDA twins -----------------------------------------------------------------------------------

// ----- transformers' Glm4MoeForCausalLM (tests/reference/make_moe_fixture.py) ----------------------

// A checkpoint 01 wrote (tests/reference/tiny_moe: sigmoid router, a trained bias, 4 groups keep
// 2, one shared expert) loaded by transformers' Glm4MoeForCausalLM, which computed the loss of a
// batch, every gradient and the router's choices; here through tinyscale's loader and model.
TEST_CASE("DeepSeekMoE checkpoint: loss, every gradient and the routing match transformers' Glm4Moe",
          "[moe][reference]") {
  SafetensorsReader f{"tests/reference/moe_fixture.safetensors"};
  auto get = [&](const std::string& name) {
    std::vector<float> v(size_t(f.entry(name).numel()));
    f.read(name, 0, v.data(), int64_t(v.size()));
    return v;
  };
  ModelConfig c{64, 2, 4, 2, 64, 256, 32};
  c.experts = 8, c.top_k = 2, c.expert_ffn = 32, c.shared_experts = 1, c.sigmoid_router = true;
  c.routed_scaling = 2.5f, c.expert_groups = 4, c.group_limit = 2;
  Model m(c, Device::CPU, DType::F32, Recompute::None);
  Tensor w = Tensor::empty({m.table.total}, DType::F32, m.dev, Tag::Workspace);
  load_checkpoint("tests/reference/tiny_moe", c, m.table, 0, m.table.total, w, nullptr);
  copy(m.params, w);
  const int B = 4, T = 32;
  const std::vector<float> tok = get("tokens");  // [1, B, T+1]
  std::vector<float> in(B * T), tg(B * T);
  for (int b = 0; b < B; b++)
    for (int s = 0; s < T; s++) in[size_t(b * T + s)] = tok[size_t(b * (T + 1) + s)], tg[size_t(b * T + s)] = tok[size_t(b * (T + 1) + s + 1)];
  Tensor tin = Tensor::empty({B * T}, DType::I32, m.dev, Tag::Workspace), ttg = Tensor::empty({B * T}, DType::I32, m.dev, Tag::Workspace);
  from_host_f32(tin, in.data());
  from_host_f32(ttg, tg.data());
  zero(m.grads);
  m.forward_backward(tin, ttg, B, 1.f / (B * T));
  const double loss = m.take_loss() / (B * T), ref = get("loss0")[0];
  CHECK(std::fabs(loss - ref) / ref <= 1e-5);
  // The same experts chosen: each layer's load per expert from transformers' choices.
  const auto& stats = dynamic_cast<MoeBlock&>(*m.mlp).stats;
  for (int l = 0; l < 2; l++) {
    std::vector<int64_t> load(8, 0);
    for (float e : get("topk." + std::to_string(l))) load[size_t(e)]++;
    INFO("layer " << l);
    CHECK(std::vector<int64_t>(stats.counts.begin() + l * 8, stats.counts.begin() + (l + 1) * 8) == load);
  }
  int compared = 0;
  for (size_t i = 0; i < m.table.entries.size(); i++) {
    const ParamEntry& e = m.table.entries[i];
    const std::vector<float> g = to_host_f32(m.grad(int(i)));
    INFO(e.name);
    if (is_moe_bias(e)) {  // selects only: no gradient
      CHECK(!f.has("grad." + e.name));
      continue;
    }
    const std::vector<float> r = get("grad." + e.name);
    double worst = 0;
    for (size_t k = 0; k < g.size(); k++) worst = std::max(worst, std::fabs(g[k] - r[k]) - (1e-5 + 1e-4 * std::fabs(r[k])));
    CHECK(worst <= 0);
    compared++;
  }
  CHECK(compared == 71);
}

TEST_CASE("cuda twin: MoE routers (softmax and sigmoid), gather, combine", "[cuda]") {
  if (!cuda_available()) {
    WARN("no GPU visible: CUDA twin not run");
    return;
  }
  const int64_t N = 37, E = 8, K = 2, D = 24, S = 37;
  auto randn = [](std::vector<int64_t> shape, uint64_t seed, DType dt) {
    Tensor t = Tensor::empty(shape, dt, Device::CPU, Tag::Workspace);
    std::vector<float> v(size_t(t.numel()));
    for (size_t i = 0; i < v.size(); i++) v[i] = rng_normal(seed, i);
    from_host_f32(t, v.data());
    return t;
  };
  auto gpu = [](const Tensor& t) {
    Tensor g = Tensor::empty(t.shape, t.dtype, Device::CUDA, Tag::Workspace);
    copy(g, t);
    return g;
  };
  auto close = [](const Tensor& a, const Tensor& b, double tol) {
    std::vector<float> x = to_host_f32(a), y = to_host_f32(b);
    double m = 0;
    for (size_t i = 0; i < x.size(); i++) m = std::max(m, double(std::fabs(x[i] - y[i])));
    return m <= tol;
  };
  Tensor z = randn({N, E}, 1, DType::F32), p = randn({N, E}, 0, DType::F32), w = randn({N, K}, 0, DType::F32);
  Tensor idx = Tensor::empty({N, K}, DType::I32, Device::CPU, Tag::Workspace);
  moe_router_forward(p, idx, w, z);
  Tensor gp = gpu(p), gidx = gpu(idx), gw = gpu(w);
  moe_router_forward(gp, gidx, gw, gpu(z));
  CHECK(close(gp, p, 1e-7));
  CHECK(close(gidx, idx, 0));
  CHECK(close(gw, w, 1e-7));
  Tensor dw = randn({N, K}, 2, DType::F32), daux = randn({1, E}, 3, DType::F32), dz = randn({N, E}, 0, DType::F32);
  moe_router_backward(dz, dw, p, idx, daux, S);
  Tensor gdz = gpu(dz);
  moe_router_backward(gdz, gpu(dw), gp, gidx, gpu(daux), S);
  CHECK(close(gdz, dz, 1e-6));
  // DeepSeek-V3's router: 8 experts in 4 groups keeping 2, a bias, routed scaling 2.5.
  Tensor bias = randn({E}, 5, DType::F32), sidx = Tensor::empty({N, K}, DType::I32, Device::CPU, Tag::Workspace);
  Tensor s = randn({N, E}, 0, DType::F32), sw = randn({N, K}, 0, DType::F32);
  moe_router_sigmoid_forward(s, sidx, sw, z, bias, 4, 2, 2.5f);
  Tensor gs = gpu(s), gsidx = gpu(sidx), gsw = gpu(sw);
  moe_router_sigmoid_forward(gs, gsidx, gsw, gpu(z), gpu(bias), 4, 2, 2.5f);
  CHECK(close(gs, s, 0));
  CHECK(close(gsidx, sidx, 0));
  CHECK(close(gsw, sw, 0));
  moe_router_sigmoid_backward(dz, dw, s, sidx, daux, S, 2.5f);
  moe_router_sigmoid_backward(gdz, gpu(dw), gs, gsidx, gpu(daux), S, 2.5f);
  CHECK(close(gdz, dz, 1e-7));
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor x = randn({N, D}, 4, dt), rows = Tensor::empty({N}, DType::I32, Device::CPU, Tag::Workspace);
    Tensor src = Tensor::empty({N, K}, DType::I32, Device::CPU, Tag::Workspace);
    for (int64_t i = 0; i < N; i++) rows.i32()[i] = int32_t((i * 7) % N);
    for (int64_t i = 0; i < N * K; i++) src.i32()[i] = i % 5 == 0 ? -1 : int32_t((i * 3) % N);
    Tensor out = randn({N, D}, 0, dt), gout = gpu(out);
    moe_gather(out, x, rows, w.reshape({N * K}).view(0, {N}));
    moe_gather(gout, gpu(x), gpu(rows), gpu(w.reshape({N * K}).view(0, {N})));
    CHECK(close(gout, out, 0));
    Tensor y = randn({N, D}, 0, dt), gy = gpu(y);
    moe_combine(y, x, src, w);
    moe_combine(gy, gpu(x), gpu(src), gw);
    CHECK(close(gy, y, dt == DType::F32 ? 1e-6 : 1e-2));
    Tensor dwc = randn({N, K}, 0, DType::F32), gdwc = gpu(dwc);
    moe_combine_backward_weights(dwc, y, x, src);
    moe_combine_backward_weights(gdwc, gy, gpu(x), gpu(src));
    CHECK(close(gdwc, dwc, dt == DType::F32 ? 1e-5 : 1e-1));
  }
}
