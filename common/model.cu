// model.cu — the Llama-style decoder: parameter table, init, forward and backward per unit.
#include "model.h"

#include "rng.h"
#include "trace.h"

namespace ts {

// ----- the parameter table -----------------------------------------------------------------------

const ParamEntry& ParamTable::find(const std::string& name) const {
  for (const ParamEntry& e : entries)
    if (e.name == name) return e;
  fatal("no parameter named '%s'", name.c_str());
}

ParamTable Model::make_table(const ModelConfig& c, int align) {
  ParamTable t;
  auto next_unit = [&] {
    t.total = (t.total + align - 1) / align * align;
    t.unit_begin.push_back(t.total);
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape, int unit, bool norm) {
    ParamEntry e;
    e.name = name;
    e.shape = shape;
    e.numel = 1;
    for (int64_t d : shape) e.numel *= d;
    e.offset = t.total;
    e.unit = unit;
    e.is_norm = norm;
    e.decay = shape.size() == 2;
    t.total += e.numel;
    t.entries.push_back(e);
  };
  const int64_t D = c.dim, KV = c.kv_dim(), F = c.ffn;
  next_unit();
  add("model.embed_tokens.weight", {c.vocab, D}, 0, false);
  for (int l = 0; l < c.layers; l++) {
    next_unit();
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {D}, l + 1, true);
    add(p + "self_attn.q_proj.weight", {D, D}, l + 1, false);
    add(p + "self_attn.k_proj.weight", {KV, D}, l + 1, false);
    add(p + "self_attn.v_proj.weight", {KV, D}, l + 1, false);
    add(p + "self_attn.o_proj.weight", {D, D}, l + 1, false);
    add(p + "post_attention_layernorm.weight", {D}, l + 1, true);
    add(p + "mlp.gate_proj.weight", {F, D}, l + 1, false);
    add(p + "mlp.up_proj.weight", {F, D}, l + 1, false);
    add(p + "mlp.down_proj.weight", {D, F}, l + 1, false);
  }
  next_unit();
  add("model.norm.weight", {D}, c.layers + 1, true);
  add("lm_head.weight", {c.vocab, D}, c.layers + 1, false);
  next_unit();
  return t;
}

// DESIGN.md init: matrices N(0, 0.02) from the counter-based RNG keyed by the HF name, norm
// weights 1. Any slice computes exactly its part of the full tensor.
void Model::init_entry(const ParamEntry& e, uint64_t seed, const Tensor& dst, int64_t elem0) {
  if (e.is_norm) {
    fill(dst, 1.f);
    return;
  }
  init_normal(dst.reshape({dst.numel()}), rng_key(seed, e.name), 0.02f, 0, elem0, e.numel);
}

void Model::init_range(const ParamTable& t, uint64_t seed, int64_t b, int64_t e, const Tensor& dst) {
  t.for_each_overlap(b, e, [&](const ParamEntry& p, int64_t lo, int64_t hi) {
    init_entry(p, seed, dst.view(lo - b, {hi - lo}), lo - p.offset);
  });
}

int64_t param_count(const ModelConfig& c, bool with_embedding) {
  int64_t n = Model::make_table(c).total;
  return with_embedding ? n : n - int64_t(c.vocab) * c.dim;
}

// Playbook: training FLOPs per token = 6N (forward 2N, backward 4N) + 12·L·h·s for attention
// scores and values; N excludes the embedding lookup (no matmul) but includes the LM head.
double flops_per_token(const ModelConfig& c) {
  return 6.0 * double(param_count(c, false)) + 12.0 * c.layers * c.dim * double(c.seq);
}

// ----- construction ------------------------------------------------------------------------------

// The default MLP: down(silu(gate(h)) * up(h)). Saves gate and up outputs and their product;
// under selective recompute the product is dropped and rebuilt in backward (no matmul needed).
struct SwiGluMlp : MlpBlock {
  struct Idx {
    int gate, up, down;
  };
  std::vector<Idx> idx;
  explicit SwiGluMlp(const Model& m) {
    for (int l = 0; l < m.cfg.layers; l++) {
      std::string p = "model.layers." + std::to_string(l) + ".mlp.";
      idx.push_back({m.entry(p + "gate_proj.weight"), m.entry(p + "up_proj.weight"), m.entry(p + "down_proj.weight")});
    }
  }
  void forward(Model& m, int l, const Tensor& y, const Tensor& h, LayerActs& a) override {
    const int64_t N = h.size(0), F = m.cfg.ffn;
    a.g = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
    a.u = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
    linear_forward(a.g, h, m.weight(idx[l].gate));
    linear_forward(a.u, h, m.weight(idx[l].up));
    a.act = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
    swiglu_forward(a.act, a.g, a.u);
    linear_forward(y, a.act, m.weight(idx[l].down));
  }
  void backward(Model& m, int l, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) override {
    const int64_t N = h.size(0), F = m.cfg.ffn;
    if (!a.act.defined()) {  // selective recompute
      a.act = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
      swiglu_forward(a.act, a.g, a.u);
    }
    auto work = [&] { return Tensor::empty({N, F}, m.dtype, m.dev, Tag::Workspace); };
    Tensor dact = work(), dg = work(), du = work();
    linear_backward(dact, m.grad(idx[l].down), dy, a.act, m.weight(idx[l].down));
    swiglu_backward(dg, du, dact, a.g, a.u);
    linear_backward(dh, m.grad(idx[l].gate), dg, h, m.weight(idx[l].gate));
    linear_backward(dh, m.grad(idx[l].up), du, h, m.weight(idx[l].up), /*accumulate_dx=*/true);
  }
  void drop_recomputable(LayerActs& a) override { a.act = Tensor(); }
};

struct LocalAttention : AttentionCore {
  void forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor& pos) override {
    attention_forward(out, lse, q, k, v, pos, pos);
  }
  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos) override {
    attention_backward(dq, dk, dv, dout, out, lse, q, k, v, pos, pos);
  }
};

Model::Model(const ModelConfig& c, Device d, DType dt, Recompute rc, ModelLayout layout)
    : cfg(c), dev(d), dtype(dt), recompute(rc), table(make_table(c, layout.align)) {
  if (c.dim % c.heads) config_error("--dim %d is not divisible by --heads %d", c.dim, c.heads);
  if (c.heads % c.kv_heads)
    config_error("--heads %d is not divisible by --kv-heads %d (GQA groups query heads per kv head)", c.heads,
                 c.kv_heads);
  if (c.head_dim() % 2) config_error("head dim %d must be even for RoPE", c.head_dim());
  unit_begin = layout.unit_begin;
  unit_end = layout.unit_end < 0 ? table.num_units() : layout.unit_end;
  local_begin = table.unit_begin[unit_begin];
  local_end = table.unit_begin[unit_end];
  w_.resize(table.entries.size());
  g_.resize(table.entries.size());
  // Zeroed so that the padding between units (ZeRO) is zero and stays zero.
  if (layout.hold_params) params = Tensor::zeros({local_end - local_begin}, dtype, dev, Tag::Params);
  if (layout.hold_grads) grads = Tensor::zeros({local_end - local_begin}, DType::F32, dev, Tag::Grads);
  for (int u = unit_begin; u < unit_end; u++) {
    if (layout.hold_params) bind_unit(u, range(params, table.unit_begin[u], table.unit_begin[u + 1]));
    if (layout.hold_grads) bind_unit_grads(u, range(grads, table.unit_begin[u], table.unit_begin[u + 1]));
  }
  emb_ = e_idx("model.embed_tokens.weight");
  normf_ = e_idx("model.norm.weight");
  head_ = e_idx("lm_head.weight");
  for (int l = 0; l < c.layers; l++) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    li_.push_back({e_idx(p + "input_layernorm.weight"), e_idx(p + "self_attn.q_proj.weight"),
                   e_idx(p + "self_attn.k_proj.weight"), e_idx(p + "self_attn.v_proj.weight"),
                   e_idx(p + "self_attn.o_proj.weight"), e_idx(p + "post_attention_layernorm.weight")});
  }
  attention = std::make_unique<LocalAttention>();
  mlp = std::make_unique<SwiGluMlp>(*this);
}

int Model::entry(const std::string& name) const { return e_idx(name); }

int Model::e_idx(const std::string& name) const {
  for (size_t i = 0; i < table.entries.size(); i++)
    if (table.entries[i].name == name) return int(i);
  fatal("no parameter named '%s'", name.c_str());
}

Tensor Model::range(const Tensor& flat, int64_t b, int64_t e) const {
  return flat.view(b - local_begin, {e - b});
}

static void bind_views(std::vector<Tensor>& views, const ParamTable& t, int u, const Tensor& flat) {
  int64_t base = t.unit_begin[u];
  if (!flat.defined()) {
    for (size_t i = 0; i < t.entries.size(); i++)
      if (t.entries[i].unit == u) views[i] = Tensor();
    return;
  }
  TS_CHECK(flat.numel() == t.unit_begin[u + 1] - base, "bind: unit %d needs %lld elements, got %lld", u,
           (long long)(t.unit_begin[u + 1] - base), (long long)flat.numel());
  for (size_t i = 0; i < t.entries.size(); i++) {
    const ParamEntry& e = t.entries[i];
    if (e.unit == u) views[i] = flat.view(e.offset - base, e.shape);
  }
}
void Model::bind_unit(int u, const Tensor& flat) { bind_views(w_, table, u, flat); }
void Model::bind_unit_grads(int u, const Tensor& flat) { bind_views(g_, table, u, flat); }

// ----- forward -------------------------------------------------------------------------------------

// Norm weights are used in fp32 (the RMSNorm kernels' contract); with bf16 weights the compute
// copy is widened for the call — D elements, negligible next to the matmuls.
static Tensor fp32_weight(const Tensor& w) {
  if (w.dtype == DType::F32) return w;
  Tensor t = Tensor::empty(w.shape, DType::F32, w.device(), Tag::Workspace);
  convert(t, w);
  return t;
}

ForwardState Model::begin_microbatch(const Tensor& inputs, const Tensor& targets, int B) {
  ForwardState st;
  st.B = B;
  st.inputs = inputs;
  st.targets = targets;
  std::vector<float> p(cfg.seq);
  for (int i = 0; i < cfg.seq; i++) p[i] = float(i);
  st.pos = Tensor::empty({cfg.seq}, DType::I32, dev, Tag::Workspace);
  from_host_f32(st.pos, p.data());
  st.layers.resize(cfg.layers);
  return st;
}

void Model::embed_forward(ForwardState& st, Tensor& x) {
  x = act({int64_t(st.B) * cfg.seq, cfg.dim});
  embedding_forward(x, w_[emb_], st.inputs);
}

// One decoder layer's forward from a.x, filling every activation field of `a`; returns the
// layer output. RMSNorm -> q,k,v -> RoPE -> attention -> o_proj -> +x -> RMSNorm -> SwiGLU -> +x.
Tensor Model::layer_compute(int l, LayerActs& a, int B, const Tensor& pos) {
  const LayerIdx& L = li_[l];
  const int64_t N = a.x.size(0), S = cfg.seq, H = cfg.heads, KVH = cfg.kv_heads, hd = cfg.head_dim();
  a.h1 = act({N, cfg.dim});
  a.rstd1 = Tensor::empty({N}, DType::F32, dev, Tag::Activations);
  rmsnorm_forward(a.h1, a.rstd1, a.x, fp32_weight(w_[L.ln1]), cfg.norm_eps);
  a.q = act({B, S, H, hd});
  a.k = act({B, S, KVH, hd});
  a.v = act({B, S, KVH, hd});
  linear_forward(a.q.reshape({N, cfg.dim}), a.h1, w_[L.q]);
  linear_forward(a.k.reshape({N, cfg.kv_dim()}), a.h1, w_[L.k]);
  linear_forward(a.v.reshape({N, cfg.kv_dim()}), a.h1, w_[L.v]);
  rope_forward(a.q, pos, cfg.rope_theta);
  rope_forward(a.k, pos, cfg.rope_theta);
  a.y = act({B, S, H, hd});
  a.lse = Tensor::empty({B, H, S}, DType::F32, dev, Tag::Activations);
  attention->forward(a.y, a.lse, a.q, a.k, a.v, pos);
  a.x_mid = act({N, cfg.dim});
  {
    Tensor o = work({N, cfg.dim});
    linear_forward(o, a.y.reshape({N, cfg.dim}), w_[L.o]);
    add(a.x_mid, a.x, o);
  }
  a.h2 = act({N, cfg.dim});
  a.rstd2 = Tensor::empty({N}, DType::F32, dev, Tag::Activations);
  rmsnorm_forward(a.h2, a.rstd2, a.x_mid, fp32_weight(w_[L.ln2]), cfg.norm_eps);
  Tensor out = act({N, cfg.dim});
  {
    Tensor y2 = work({N, cfg.dim});
    mlp->forward(*this, l, y2, a.h2, a);
    add(out, a.x_mid, y2);
  }
  return out;
}

// What the layer keeps for backward depends on the recompute mode (see Recompute in model.h).
void Model::layer_forward(int l, ForwardState& st, Tensor& x) {
  LayerActs& a = st.layers[l];
  a.x = x;
  Tensor out = layer_compute(l, a, st.B, st.pos);
  if (recompute == Recompute::Selective) {
    a.h1 = a.h2 = Tensor();
    mlp->drop_recomputable(a);
  } else if (recompute == Recompute::Full) {
    Tensor keep = a.x;
    a.release();
    a.x = keep;
  }
  x = out;
}

// The head: final RMSNorm, LM head, fused softmax-cross-entropy, and straight back through the
// LM head and the norm. Returns the summed token losses; dx receives d(loss)/d(head input).
double Model::head_forward_backward(ForwardState& st, const Tensor& x, Tensor& dx, float grad_scale) {
  const int64_t N = x.size(0);
  st.xf = x;
  st.hf = act({N, cfg.dim});
  st.rstdf = Tensor::empty({N}, DType::F32, dev, Tag::Activations);
  Tensor wn = fp32_weight(w_[normf_]);
  rmsnorm_forward(st.hf, st.rstdf, st.xf, wn, cfg.norm_eps);
  st.logits = act({N, cfg.vocab});
  linear_forward(st.logits, st.hf, w_[head_]);
  Tensor losses = Tensor::empty({N}, DType::F32, dev, Tag::Workspace);
  cross_entropy_forward_backward(losses, st.logits, st.logits, st.targets, grad_scale);
  // Summed in double in token order on the host: the same value on every backend and mesh.
  std::vector<float> l = to_host_f32(losses);
  double sum = 0;
  for (float v : l) sum += v;
  if (after_forward) after_forward();

  Tensor dh = work({N, cfg.dim});
  linear_backward(dh, g_[head_], st.logits, st.hf, w_[head_]);
  st.logits = st.hf = Tensor();
  dx = work({N, cfg.dim});
  rmsnorm_backward(dx, g_[normf_], dh, st.xf, wn, st.rstdf);
  st.xf = st.rstdf = Tensor();
  return sum;
}

// Backward of one layer: dx holds d(loss)/d(layer output) and leaves holding d(loss)/d(input).
void Model::layer_backward(int l, ForwardState& st, Tensor& dx) {
  const LayerIdx& L = li_[l];
  LayerActs& a = st.layers[l];
  const int64_t N = a.x.size(0);
  if (recompute == Recompute::Full) {
    layer_compute(l, a, st.B, st.pos);  // rerun the forward; the output itself is not needed
  } else if (recompute == Recompute::Selective) {
    a.h1 = act({N, cfg.dim});
    rmsnorm_forward(a.h1, a.rstd1, a.x, fp32_weight(w_[L.ln1]), cfg.norm_eps);
    a.h2 = act({N, cfg.dim});
    rmsnorm_forward(a.h2, a.rstd2, a.x_mid, fp32_weight(w_[L.ln2]), cfg.norm_eps);
  }
  // MLP: out = x_mid + MLP(h2), h2 = RMSNorm(x_mid).
  Tensor tmp = work({N, cfg.dim});
  {
    Tensor dh2 = work({N, cfg.dim});
    mlp->backward(*this, l, dh2, dx, a.h2, a);
    rmsnorm_backward(tmp, g_[L.ln2], dh2, a.x_mid, fp32_weight(w_[L.ln2]), a.rstd2);
    add_inplace(dx, tmp);  // dx := d x_mid (residual path + norm path)
  }
  a.h2 = a.g = a.u = a.act = a.x_mid = a.rstd2 = Tensor();
  // Attention: x_mid = x + o_proj(attn(rope(q(h1)), rope(k(h1)), v(h1))), h1 = RMSNorm(x).
  {
    Tensor dy = work(a.y.shape), dq = work(a.q.shape), dk = work(a.k.shape), dv = work(a.v.shape);
    linear_backward(dy.reshape({N, cfg.dim}), g_[L.o], dx, a.y.reshape({N, cfg.dim}), w_[L.o]);
    attention->backward(dq, dk, dv, dy, a.y, a.lse, a.q, a.k, a.v, st.pos);
    rope_backward(dq, st.pos, cfg.rope_theta);
    rope_backward(dk, st.pos, cfg.rope_theta);
    Tensor dh1 = work({N, cfg.dim});
    linear_backward(dh1, g_[L.q], dq.reshape({N, cfg.dim}), a.h1, w_[L.q]);
    linear_backward(dh1, g_[L.k], dk.reshape({N, cfg.kv_dim()}), a.h1, w_[L.k], true);
    linear_backward(dh1, g_[L.v], dv.reshape({N, cfg.kv_dim()}), a.h1, w_[L.v], true);
    rmsnorm_backward(tmp, g_[L.ln1], dh1, a.x, fp32_weight(w_[L.ln1]), a.rstd1);
    add_inplace(dx, tmp);  // dx := d x
  }
  a.release();
}

void Model::embed_backward(ForwardState& st, const Tensor& dx) {
  embedding_backward(g_[emb_], dx, st.inputs);
}

// The whole model on one rank, unit by unit, firing the hooks in the order the techniques rely
// on: forward 0..L+1, then backward L+1..0 with unit_grads_ready as each unit's gradients finish.
double Model::forward_backward(const Tensor& inputs, const Tensor& targets, int B, float grad_scale) {
  TS_CHECK(unit_begin == 0 && unit_end == table.num_units(), "forward_backward needs the whole model");
  auto hook = [](const std::function<void(int)>& f, int u) {
    if (f) f(u);
  };
  const int L = cfg.layers;
  ForwardState st = begin_microbatch(inputs, targets, B);
  Tensor x, dx;
  hook(before_unit, 0);
  {
    TraceScope t("fwd embedding");
    embed_forward(st, x);
  }
  hook(after_unit, 0);
  for (int l = 0; l < L; l++) {
    hook(before_unit, l + 1);
    {
      TraceScope t("fwd layer " + std::to_string(l));
      layer_forward(l, st, x);
    }
    hook(after_unit, l + 1);
  }
  hook(before_unit, L + 1);
  hook(before_backward, L + 1);
  double loss;
  {
    TraceScope t("head fwd+bwd");
    loss = head_forward_backward(st, x, dx, grad_scale);
  }
  x = Tensor();
  hook(unit_grads_ready, L + 1);
  hook(after_unit, L + 1);
  for (int l = L - 1; l >= 0; l--) {
    hook(before_unit, l + 1);
    hook(before_backward, l + 1);
    {
      TraceScope t("bwd layer " + std::to_string(l));
      layer_backward(l, st, dx);
    }
    hook(unit_grads_ready, l + 1);
    hook(after_unit, l + 1);
  }
  hook(before_backward, 0);
  {
    TraceScope t("bwd embedding");
    embed_backward(st, dx);  // a scatter of dx: reads no weights, so no before/after_unit
  }
  hook(unit_grads_ready, 0);
  return loss;
}

}  // namespace ts
