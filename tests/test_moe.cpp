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
#include "tensor/rng.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "model/moe.h"
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
};

struct RefOut {
  DVec y;
  std::vector<std::vector<int>> chosen;  // [N][K]
  std::vector<std::vector<bool>> kept;
  double aux = 0;  // Σ_b aux_b
};

double silu(double x) { return x / (1 + std::exp(-x)); }

RefOut ref_forward(const Ref& r, const DVec& h) {
  const int N = r.B * r.S;
  RefOut o;
  o.y.assign(size_t(N) * r.D, 0);
  DVec p(size_t(N) * r.E);
  for (int t = 0; t < N; t++) {
    DVec z(r.E);
    double mx = -1e300, sum = 0;
    for (int e = 0; e < r.E; e++) {
      for (int d = 0; d < r.D; d++) z[e] += r.wg[size_t(e) * r.D + d] * h[size_t(t) * r.D + d];
      mx = std::max(mx, z[e]);
    }
    for (int e = 0; e < r.E; e++) sum += std::exp(z[e] - mx);
    for (int e = 0; e < r.E; e++) p[size_t(t) * r.E + e] = std::exp(z[e] - mx) / sum;
    std::vector<int> c;
    for (int k = 0; k < r.K; k++) {  // the largest remaining; ties to the lower index
      int best = -1;
      for (int e = 0; e < r.E; e++)
        if (std::find(c.begin(), c.end(), e) == c.end() && (best < 0 || p[size_t(t) * r.E + e] > p[size_t(t) * r.E + best]))
          best = e;
      c.push_back(best);
    }
    o.chosen.push_back(c);
  }
  for (int b = 0; b < r.B; b++) {
    std::vector<int64_t> taken(size_t(r.E), 0), cnt(size_t(r.E), 0);
    for (int t = b * r.S; t < (b + 1) * r.S; t++) {
      std::vector<bool> kept;
      double s = 0;
      for (int e : o.chosen[size_t(t)]) s += p[size_t(t) * r.E + e];
      for (int e : o.chosen[size_t(t)]) {
        cnt[size_t(e)]++;
        const bool keep = r.cap < 0 || taken[size_t(e)] < r.cap;
        kept.push_back(keep);
        if (!keep) continue;
        taken[size_t(e)]++;
        const double w = p[size_t(t) * r.E + e] / s;
        const double* x = h.data() + size_t(t) * r.D;
        DVec a(size_t(r.F));
        for (int f = 0; f < r.F; f++) {
          double g = 0, u = 0;
          for (int d = 0; d < r.D; d++) {
            g += r.w1[size_t(e)][size_t(f) * r.D + d] * x[d];
            u += r.w3[size_t(e)][size_t(f) * r.D + d] * x[d];
          }
          a[size_t(f)] = silu(g) * u;
        }
        for (int d = 0; d < r.D; d++) {
          double v = 0;
          for (int f = 0; f < r.F; f++) v += r.w2[size_t(e)][size_t(d) * r.F + f] * a[size_t(f)];
          o.y[size_t(t) * r.D + d] += w * v;
        }
      }
      o.kept.push_back(kept);
    }
    // Switch's aux = E · Σ_e f_e P_e with f over the sequence's S·K choices.
    for (int e = 0; e < r.E; e++) {
      double P = 0;
      for (int t = b * r.S; t < (b + 1) * r.S; t++) P += p[size_t(t) * r.E + e];
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
};

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
                         Case{"all tokens to one expert", 1, 0.f, true}}) {
    INFO(cs.name);
    ModelConfig c;
    c.dim = 8, c.layers = 1, c.heads = 2, c.kv_heads = 1, c.ffn = 6, c.vocab = 16, c.seq = 6;
    c.experts = 4, c.top_k = cs.K, c.capacity_factor = cs.capacity, c.aux_loss_coef = 0.3f;
    Model m(c, Device::CPU, DType::F32, Recompute::None);
    Model::init_range(m.table, 7, 0, m.table.total, m.params);
    const int B = 2, S = c.seq, N = B * S, D = c.dim, F = c.ffn, E = c.experts;
    m.loss_scale = 1.f / (4 * S);  // as if the global batch had 4 sequences
    // Larger weights than the init's 0.02 so that the experts and the router matter.
    scale_inplace(m.params, 20.f);
    DVec hv(size_t(N) * D), R(size_t(N) * D);
    for (size_t i = 0; i < hv.size(); i++) hv[i] = rng_normal(11, i), R[i] = rng_normal(12, i);
    const int gate = m.entry(moe_gate_name(0));
    if (cs.one_expert) {
      for (int t = 0; t < N; t++) hv[size_t(t) * D] = 2 + std::fabs(hv[size_t(t) * D]);
      m.weight(gate).f32()[(E - 1) * D] = 50.f;
    }
    Ref r{B, S, D, F, E, cs.K, expert_capacity(c, S), double(c.aux_loss_coef) * m.loss_scale * S, host(m.weight(gate)), {}, {}, {}};
    for (int j = 0; j < E; j++) {
      r.w1.push_back(host(m.weight(m.entry(moe_expert_name(0, j, "w1")))));
      r.w3.push_back(host(m.weight(m.entry(moe_expert_name(0, j, "w3")))));
      r.w2.push_back(host(m.weight(m.entry(moe_expert_name(0, j, "w2")))));
    }
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
      for (auto [w, vec] : {std::pair<const char*, DVec*>{"w1", &r.w1[size_t(j)]}, {"w3", &r.w3[size_t(j)]},
                            {"w2", &r.w2[size_t(j)]}}) {
        DVec n(vec->size());
        for (size_t i = 0; i < vec->size(); i++) n[i] = numeric_grad(r, hv, R, *vec, i);
        const DVec got = host(m.grad(m.entry(moe_expert_name(0, j, w))));
        if (max_abs(n) == 0) CHECK(max_abs(got) == 0);  // an expert without rows gets no gradient
        else CHECK(rel_diff(got, n) <= 2e-6);
        if (cs.one_expert && j < E - 1) CHECK(max_abs(got) == 0);
      }
    }
  }
}

// ----- 01 with --experts, end to end --------------------------------------------------------------

const std::string kMoe = "--preset tiny --experts 4 --top-k 2 --ffn 64 --quiet --lr-schedule constant ";

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

TEST_CASE("01 --experts: bad input", "[moe][errors]") {
  tst::check_errors("01_single_gpu", "--preset tiny --steps 1 ", {
      {1, "--experts 4 --top-k 5", "--top-k 5 must be between 1 and --experts 4"},
      {1, "--experts 4 --top-k 0", "--top-k 0 must be between 1 and --experts 4"},
      {1, "--experts 4 --capacity-factor -1", "--capacity-factor must be >= 0"},
      {1, "--experts -2", "--experts must be >= 0"},
  });
}

// ----- CUDA twins -----------------------------------------------------------------------------------

TEST_CASE("cuda twin: MoE router, gather, combine", "[cuda]") {
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
