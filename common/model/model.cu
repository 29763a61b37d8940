// model.cu — the Llama-style decoder: parameter table, init, forward and backward per unit.
#include "model/model.h"
#include "model/attention_core.h"
#include "model/linear_gemms.h"
#include "model/mlp_block.h"
#include "model/tp_ops.h"

#include "tensor/rng.h"
#include "kernels/kernels.h"
#include "comm/trace.h"
#include "model/moe.h"
#include "tensor/device.h"

#include <mutex>

namespace ts {

Model::~Model() = default;

void Model::linear(int e, const Tensor& y, const Tensor& x) { gemms->forward(e, y, x, w_[size_t(e)]); }

TpOps& Model::mlp_tp() {
  static TpOps identity;
  return mlp->split_over_tp() ? *tp : identity;
}

// The default GEMMs of the dense linears (model.h, LinearGemms): the compute dtype's matmuls.
void LinearGemms::forward(int, const Tensor& y, const Tensor& x, const Tensor& W) { linear_forward(y, x, W); }
void LinearGemms::input_grad(int, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate) {
  linear_backward(dx, Tensor(), dy, Tensor(), W, accumulate);
}
void LinearGemms::weight_grad(int, const Tensor& dW, const Tensor& dy, const Tensor& x) {
  linear_backward(Tensor(), dW, dy, x, Tensor());
}

// ----- the micro-batch's ints on the device --------------------------------------------------------

#ifdef TS_CUDA
// A copy from pageable memory cannot be a DMA: the driver first copies the bytes into a pinned
// buffer of its own, and the host waits for that. A trainer stages its inputs in page-locked memory
// instead (PyTorch's pin_memory), so the copy engine reads them while the host goes on. The copy
// then reads its source only when it runs on the stream (CUDA C++ Programming Guide, "Page-Locked
// Host Memory"), so a staging buffer may be refilled only once the copy from it has run: a ring of
// slots, each with the event of its last copy, which the host waits for before refilling it. With
// eight slots (a micro-batch takes two or three) the host waits only when it has run more than a
// few micro-batches ahead of the GPU. Chosen over one upload per step of all its
// micro-batches because callers build micro-batches one at a time, some in a pipeline schedule's
// order (05, 08), and the staging keeps that interface. Slots grow and are never freed.
static void stage_and_copy(void* dst, const void* src, size_t bytes) {
  struct Slot {
    void* host = nullptr;
    size_t cap = 0;
    cudaEvent_t copied = nullptr;  // recorded after the last copy from `host`
  };
  constexpr int kSlots = 8;
  static std::mutex mu;
  static Slot ring[kSlots];
  static int next = 0;
  std::lock_guard<std::mutex> lk(mu);
  Slot& s = ring[next];
  next = (next + 1) % kSlots;
  if (s.copied)
    CUDA_CHECK(cudaEventSynchronize(s.copied));  // the copy that last read this slot has run
  else
    CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
  if (bytes > s.cap) {
    if (s.host) CUDA_CHECK(cudaFreeHost(s.host));
    CUDA_CHECK(cudaMallocHost(&s.host, bytes));
    s.cap = bytes;
  }
  memcpy(s.host, src, bytes);
  CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, compute_stream()));
  CUDA_CHECK(cudaEventRecord(s.copied, compute_stream()));
}
#endif

Tensor upload_ints(const std::vector<int32_t>& v, Device dev) {
  if (dev == Device::CPU || v.empty()) return from_host_i32(v, dev);
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I32, dev, Tag::Workspace);
#ifdef TS_CUDA
  stage_and_copy(t.raw(), v.data(), v.size() * sizeof(int32_t));
#endif
  return t;
}

// ----- the parameter table -----------------------------------------------------------------------

const ParamEntry& ParamTable::find(const std::string& name) const {
  for (const ParamEntry& e : entries)
    if (e.name == name) return e;
  fatal("no parameter named '%s'", name.c_str());
}

// The sparse MoE block in HF names (moe.h: Mixtral's or Glm4Moe's): the router (and DeepSeek-V3's
// bias), then each expert's gate, down and up matrices, the order of Mixtral's w1, w2, w3. Expert
// j lives on ep rank j / (E/ep); elsewhere its entries hold nothing. Under tensor parallelism the
// router and the experts are whole on every tp rank (replicated over tp, counted on tp rank 0, as
// the norms): the MoE block is not split over tp (MlpBlock::split_over_tp).
template <class Add> static void add_experts(const ModelConfig& c, const ShardSpec& sh, int l, Add& add, bool& expert) {
  if (c.experts % sh.ep) config_error("--experts %d is not divisible by --ep %d", c.experts, sh.ep);
  const int64_t D = c.dim, F = c.expert_width(), per = c.experts / sh.ep;
  add(moe_gate_name(c, l), {c.experts, D}, Split::Whole, false);
  if (c.sigmoid_router) add(moe_bias_name(l), {c.experts}, Split::Whole, false);  // DeepSeek-V3's b_e
  expert = true;
  for (int j = 0; j < c.experts; j++) {
    const Split s = j / per == sh.ep_rank ? Split::Whole : Split::None;
    add(moe_expert_name(c, l, j, "gate_proj"), {F, D}, s, false);
    add(moe_expert_name(c, l, j, "down_proj"), {D, F}, s, false);
    add(moe_expert_name(c, l, j, "up_proj"), {F, D}, s, false);
  }
  expert = false;
  // DeepSeekMoE's shared experts: dense, replicated like the router, one SwiGLU of width S·F_e.
  const int64_t FS = int64_t(c.shared_experts) * F;
  if (FS == 0) return;
  add(moe_shared_name(l, "gate_proj"), {FS, D}, Split::Whole, false);
  add(moe_shared_name(l, "up_proj"), {FS, D}, Split::Whole, false);
  add(moe_shared_name(l, "down_proj"), {D, FS}, Split::Whole, false);
}

// The model's tensors in HF order, unit by unit. How each dense tensor is split over tp is the
// shard spec's split table (04_tensor_parallel.cu's tp::split_of, the chapter's figure); norm
// weights come out whole on every tp rank. Units another pipeline stage owns are kept in the
// table with nothing held, so indices agree on every rank.
ParamTable Model::make_table(const ModelConfig& c, int align, const ShardSpec& sh) {
  if (sh.tp > 1 && !sh.tp_split) fatal("make_table: a tp %d shard spec without a split table (tp::shard_spec sets it)", sh.tp);
  ParamTable t;
  int unit = 0;
  auto next_unit = [&] {
    t.total = (t.total + align - 1) / align * align;
    t.unit_begin.push_back(t.total);
  };
  bool expert = false;  // the entries being added are one expert's (held whole by one ep rank)
  auto add = [&](const std::string& name, std::vector<int64_t> shape, Split split, bool norm) {
    ParamEntry e;
    e.name = name;
    e.shape = shape;
    e.global_numel = 1;
    for (int64_t d : shape) e.global_numel *= d;
    e.local_shape = shape;
    if (!sh.holds(unit)) split = Split::None;
    e.split = split;
    if (split == Split::Rows || split == Split::Cols) {
      const int dim = split == Split::Rows ? 0 : 1;
      if (shape[dim] % sh.tp)
        config_error("%s: dimension %lld is not divisible by tp %d", name.c_str(), (long long)shape[dim], sh.tp);
      e.parts = sh.tp;
      e.part = sh.tp_rank;
      e.local_shape[dim] /= sh.tp;
    } else if (split == Split::Whole && sh.tp > 1) {
      e.replicated_over = "tp";
      e.counts = sh.tp_rank == 0;
    } else if (split == Split::None) {
      e.local_shape[0] = 0;
    }
    if (sh.ep > 1 && !expert && split != Split::None) {  // dense tensors: one copy per ep rank
      // A whole tensor under tp is replicated over both; it keeps the name tp (the group sequence
      // parallelism reduces norm gradients over) and counts on tp rank 0 of ep rank 0.
      if (e.replicated_over.empty()) e.replicated_over = "ep";
      e.counts = e.counts && sh.ep_rank == 0;
    }
    e.numel = 1;
    for (int64_t d : e.local_shape) e.numel *= d;
    e.offset = t.total;
    e.unit = unit;
    e.is_norm = norm;
    e.decay = shape.size() == 2;
    t.total += e.numel;
    t.entries.push_back(e);
  };
  auto dense = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) {
    add(name, std::move(shape), sh.tp_split ? sh.tp_split(name) : Split::Whole, norm);
  };
  const int64_t D = c.dim, KV = c.kv_dim(), F = c.ffn;
  next_unit();
  dense("model.embed_tokens.weight", {c.vocab, D});
  for (int l = 0; l < c.layers; l++) {
    unit = l + 1;
    next_unit();
    std::string p = "model.layers." + std::to_string(l) + ".";
    dense(p + "input_layernorm.weight", {D}, true);
    dense(p + "self_attn.q_proj.weight", {D, D});
    dense(p + "self_attn.k_proj.weight", {KV, D});
    dense(p + "self_attn.v_proj.weight", {KV, D});
    dense(p + "self_attn.o_proj.weight", {D, D});
    dense(p + "post_attention_layernorm.weight", {D}, true);
    if (c.experts > 0) {
      add_experts(c, sh, l, add, expert);
      continue;
    }
    dense(p + "mlp.gate_proj.weight", {F, D});
    dense(p + "mlp.up_proj.weight", {F, D});
    dense(p + "mlp.down_proj.weight", {D, F});
  }
  unit = c.layers + 1;
  next_unit();
  dense("model.norm.weight", {D}, true);
  dense("lm_head.weight", {c.vocab, D});
  next_unit();
  return t;
}

// Init: matrices N(0, 0.02) from the counter-based RNG keyed by the HF name and the
// global element index, norm weights 1, the MoE routing bias 0. Any block computes exactly its
// part of the full tensor.
void Model::init_range(const ParamTable& t, uint64_t seed, int64_t b, int64_t e, const Tensor& dst) {
  t.for_each_global_run(b, e, [&](const ParamEntry& p, int64_t flat, int64_t global, int64_t n) {
    const Tensor d = dst.view(flat - b, {n});
    if (p.is_norm) fill(d, 1.f);
    else if (is_moe_bias(p)) fill(d, 0.f);  // DeepSeek-V3's routing bias starts at 0
    else init_normal(d, rng_key(seed, p.name), 0.02f, 0, global, p.global_numel);
  });
}

int64_t param_count(const ModelConfig& c, bool with_embedding) {
  int64_t n = Model::make_table(c).total;
  return with_embedding ? n : n - int64_t(c.vocab) * c.dim;
}

int64_t local_param_count(const ParamTable& t) {
  int64_t n = 0;
  for (const ParamEntry& e : t.entries) n += e.numel;
  return n;
}

// Playbook: training FLOPs per token = 6N (forward 2N, backward 4N) + 12·L·h·s for attention
// scores and values; N excludes the embedding lookup (no matmul) but includes the LM head. With
// experts N counts the active parameters: a token runs K of the E experts of each layer.
double flops_per_token(const ModelConfig& c) {
  // The routing bias (E per layer) only selects: no FLOPs.
  const double inactive = c.experts > 0 ? double(c.layers) * ((c.experts - c.top_k) * 3.0 * c.expert_width() * c.dim +
                                                              (c.sigmoid_router ? c.experts : 0))
                                        : 0.0;
  return 6.0 * (double(param_count(c, false)) - inactive) + 12.0 * c.layers * c.dim * double(c.seq);
}

// ----- construction ------------------------------------------------------------------------------

// The default MLP: down(silu(gate(h)) * up(h)). Saves gate and up outputs and their product;
// under selective recompute the product is dropped and rebuilt in backward (no matmul needed).
// Under tensor parallelism gate/up hold ffn/tp rows and down ffn/tp columns: the widths below
// come from the weights, and the output is a partial sum that g completes.
void swiglu_mlp_forward(Model& m, const SwiGluWeights& w, const Tensor& y, const Tensor& h, Tensor& g, Tensor& u,
                        Tensor& act) {
  const int64_t N = h.size(0), F = m.weight(w.gate).size(0);
  g = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
  u = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
  m.linear(w.gate, g, h);
  m.linear(w.up, u, h);
  act = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
  swiglu_forward(act, g, u);
  m.linear(w.down, y, act);
}

void swiglu_mlp_backward(Model& m, const SwiGluWeights& w, const Tensor& dh, const Tensor& dy, const Tensor& h,
                         const Tensor& g, const Tensor& u, Tensor& act, bool accumulate_dh) {
  const int64_t N = h.size(0), F = g.size(1);
  if (!act.defined()) {  // selective recompute
    act = Tensor::empty({N, F}, m.dtype, m.dev, Tag::Activations);
    swiglu_forward(act, g, u);
  }
  auto work = [&] { return Tensor::empty({N, F}, m.dtype, m.dev, Tag::Workspace); };
  Tensor dact = work(), dg = work(), du = work();
  m.linear_backward(w.down, dact, dy, act);
  swiglu_backward(dg, du, dact, g, u);
  m.linear_backward(w.gate, dh, dg, h, accumulate_dh);
  m.linear_backward(w.up, dh, du, h, /*accumulate_dx=*/true);
}

struct SwiGluMlp : MlpBlock {
  std::vector<SwiGluWeights> idx;
  explicit SwiGluMlp(const Model& m) {
    for (int l = 0; l < m.cfg.layers; l++) {
      std::string p = "model.layers." + std::to_string(l) + ".mlp.";
      idx.push_back({m.entry(p + "gate_proj.weight"), m.entry(p + "up_proj.weight"), m.entry(p + "down_proj.weight")});
    }
  }
  void forward(Model& m, int l, const Tensor& y, const Tensor& h, LayerActs& a) override {
    swiglu_mlp_forward(m, idx[size_t(l)], y, h, a.g, a.u, a.act);
  }
  void backward(Model& m, int l, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) override {
    swiglu_mlp_backward(m, idx[size_t(l)], dh, dy, h, a.g, a.u, a.act, false);
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

// The fused softmax-cross-entropy over the whole vocabulary (one rank holds every logit).
struct CrossEntropyLoss : LossFn {
  void forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                        int64_t vocab_start, float grad_scale) override {
    TS_CHECK(vocab_start == 0, "the plain cross-entropy needs the whole vocabulary on this rank");
    cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale);
  }
};

Model::Model(const ModelConfig& c, Device d, DType dt, Recompute rc, ModelLayout layout)
    : cfg(c), dev(d), dtype(dt), recompute(rc), table(make_table(c, layout.align, layout.shard)), shard(layout.shard) {
  if (c.dim % c.heads) config_error("--dim %d is not divisible by --heads %d", c.dim, c.heads);
  if (c.heads % c.kv_heads)
    config_error("--heads %d is not divisible by --kv-heads %d (GQA groups query heads per kv head)", c.heads,
                 c.kv_heads);
  if (c.head_dim() % 2) config_error("head dim %d must be even for RoPE", c.head_dim());
  w_.resize(table.entries.size());
  g_.resize(table.entries.size());
  // Zeroed so that the padding between units (ZeRO) is zero and stays zero.
  if (layout.hold_params) params = Tensor::zeros({table.total}, dtype, dev, Tag::Params);
  if (layout.hold_grads) grads = Tensor::zeros({table.total}, DType::F32, dev, Tag::Grads);
  for (int u = 0; u < table.num_units(); u++) {
    if (!holds(u)) continue;
    const int64_t b = table.unit_begin[u], e = table.unit_begin[u + 1];
    if (layout.hold_params) bind_unit(u, params.view(b, {e - b}));
    if (layout.hold_grads) bind_unit_grads(u, grads.view(b, {e - b}));
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
  // Local sizes come from the blocks this rank holds (every rank computes them alike).
  const int tp = layout.shard.tp, r = layout.shard.tp_rank;
  local_heads = c.heads / tp;
  local_kv_heads = c.kv_heads / tp;
  local_vocab = c.vocab / tp;
  vocab_start = int64_t(r) * local_vocab;
  attention = std::make_unique<LocalAttention>();
  if (c.experts > 0) mlp = std::make_unique<MoeBlock>(*this);
  else mlp = std::make_unique<SwiGluMlp>(*this);
  this->tp = std::make_unique<TpOps>();
  loss = std::make_unique<CrossEntropyLoss>();
  gemms = std::make_unique<LinearGemms>();
}

int Model::entry(const std::string& name) const { return e_idx(name); }

int Model::e_idx(const std::string& name) const {
  for (size_t i = 0; i < table.entries.size(); i++)
    if (table.entries[i].name == name) return int(i);
  fatal("no parameter named '%s'", name.c_str());
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
    if (e.unit == u && e.held()) views[i] = flat.view(e.offset - base, e.local_shape);
  }
}
void Model::bind_unit(int u, const Tensor& flat) { bind_views(w_, table, u, flat); }
void Model::bind_unit_grads(int u, const Tensor& flat) { bind_views(g_, table, u, flat); }

void Model::linear_backward(const Tensor& dx, const Tensor& dW, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool accumulate_dx) {
  if (!defer_.queue) return ts::linear_backward(dx, dW, dy, x, W, accumulate_dx);
  ts::linear_backward(dx, Tensor(), dy, x, W, accumulate_dx);
  defer_weight_grad(-1, dW, dy, x);
}

void Model::linear_backward(int e, const Tensor& dx, const Tensor& dy, const Tensor& x, bool accumulate_dx) {
  gemms->input_grad(e, dx, dy, w_[size_t(e)], accumulate_dx);
  if (defer_.queue) return defer_weight_grad(e, g_[size_t(e)], dy, x);
  gemms->weight_grad(e, g_[size_t(e)], dy, x);
}

void Model::defer_weight_grad(int e, const Tensor& dW, const Tensor& dy, const Tensor& x) {
  auto snapshot = [&](const Tensor& t) {
    Tensor keep = Tensor::empty(t.shape, t.dtype, dev, Tag::Activations);
    copy(keep, t);
    return keep;
  };
  // dy is snapshotted: the layer keeps updating the residual gradient it may alias. x is kept as
  // it is, unless it is the B's scratch (sequence parallelism's gathered input, f): then it is
  // snapshotted too, once for the matmuls that share it (q, k, v; gate, up), so that what waits
  // for the W is activations, as the memory model counts it (lab/05_pipeline_parallel.h).
  std::vector<DeferredGrad>& q = *defer_.queue;
  DeferredGrad d{defer_.unit, dW, snapshot(dy), x, e};
  if (x.buf->tag == Tag::Workspace) {
    const bool shared = !q.empty() && q.back().x_from.lock() == x.buf && q.back().x_from_offset == x.byte_offset &&
                        q.back().x.shape == x.shape;
    d.x = shared ? q.back().x : snapshot(x);
    d.x_from = x.buf;
    d.x_from_offset = x.byte_offset;
  }
  q.push_back(std::move(d));
}

// ----- forward -------------------------------------------------------------------------------------

// Norm weights are used in fp32 (the RMSNorm kernels' contract); with bf16 weights the compute
// copy is widened for the call — D elements, negligible next to the matmuls.
static Tensor fp32_weight(const Tensor& w) {
  if (w.dtype == DType::F32) return w;
  Tensor t = Tensor::empty(w.shape, DType::F32, w.device(), Tag::Workspace);
  convert(t, w);
  return t;
}

ForwardState Model::begin_microbatch(const Tensor& inputs, const Tensor& targets, int B, const Tensor& pos) {
  ForwardState st;
  st.B = B;
  st.S = int(inputs.numel() / B);
  st.inputs = inputs;
  st.targets = targets;
  if (pos.defined()) {
    TS_CHECK(pos.numel() == st.S, "begin_microbatch: %lld positions for %d tokens per sequence", (long long)pos.numel(),
             st.S);
    st.pos = pos;
  } else {
    std::vector<int32_t> p(st.S);
    for (int i = 0; i < st.S; i++) p[i] = i;
    st.pos = upload_ints(p, dev);
  }
  st.layers.resize(cfg.layers);
  return st;
}

// The vocabulary-parallel embedding: this rank looks up the tokens it owns (zero rows for the
// others) and g sums the partial rows over tp (reduce-scatters them under sequence parallelism).
void Model::embed_forward(ForwardState& st, Tensor& x) {
  Tensor part = act({int64_t(st.B) * st.S, cfg.dim});
  embedding_forward(part, w_[emb_], st.inputs, vocab_start);
  x = tp->g_forward(part, Tag::Activations);
}

// One decoder layer's forward from a.x, filling every activation field of `a`; returns the
// layer output. RMSNorm -> f -> q,k,v -> RoPE -> attention -> o_proj -> g -> +x
//                -> RMSNorm -> f -> MLP -> g -> +x.
Tensor Model::layer_compute(int l, LayerActs& a, int B, int S, const Tensor& pos) {
  const LayerIdx& L = li_[l];
  const int64_t Nr = a.x.size(0), N = int64_t(B) * S, H = local_heads, KVH = local_kv_heads, hd = cfg.head_dim();
  a.h1 = act({Nr, cfg.dim});
  a.rstd1 = Tensor::empty({Nr}, DType::F32, dev, Tag::Activations);
  rmsnorm_forward(a.h1, a.rstd1, a.x, fp32_weight(w_[L.ln1]), cfg.norm_eps);
  a.q = act({B, S, H, hd});
  a.k = act({B, S, KVH, hd});
  a.v = act({B, S, KVH, hd});
  {
    const Tensor h = tp->f_forward_into_linears(a.h1);
    linear(L.q, a.q.reshape({N, H * hd}), h);
    linear(L.k, a.k.reshape({N, KVH * hd}), h);
    linear(L.v, a.v.reshape({N, KVH * hd}), h);
  }
  rope_forward(a.q, pos, cfg.rope_theta);
  rope_forward(a.k, pos, cfg.rope_theta);
  a.y = act({B, S, H, hd});
  a.lse = Tensor::empty({B, H, S}, DType::F32, dev, Tag::Activations);
  attention->forward(a.y, a.lse, a.q, a.k, a.v, pos);
  a.x_mid = act({Nr, cfg.dim});
  {
    Tensor o = work({N, cfg.dim});
    linear(L.o, o, a.y.reshape({N, H * hd}));
    add(a.x_mid, a.x, tp->g_forward(o));
  }
  a.h2 = act({Nr, cfg.dim});
  a.rstd2 = Tensor::empty({Nr}, DType::F32, dev, Tag::Activations);
  rmsnorm_forward(a.h2, a.rstd2, a.x_mid, fp32_weight(w_[L.ln2]), cfg.norm_eps);
  Tensor out = act({Nr, cfg.dim});
  {
    Tensor y2 = work({N, cfg.dim});
    TpOps& fg = mlp_tp();
    mlp->forward(*this, l, y2, fg.f_forward_into_linears(a.h2), a);
    add(out, a.x_mid, fg.g_forward(y2));
  }
  return out;
}

// What the layer keeps for backward depends on the recompute mode (see Recompute in model.h).
void Model::layer_forward(int l, ForwardState& st, Tensor& x) {
  LayerActs& a = st.layers[l];
  a.x = x;
  Tensor out = layer_compute(l, a, st.B, st.S, st.pos);
  st.aux_loss += a.aux_loss;
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

// The head's forward up to the logits (st.logits); returns f(final norm output), the LM head's input.
Tensor Model::head_logits(ForwardState& st, const Tensor& x) {
  const int64_t Nr = x.size(0), N = int64_t(st.B) * st.S;
  st.xf = x;
  st.rstdf = Tensor::empty({Nr}, DType::F32, dev, Tag::Activations);
  st.hf = act({Nr, cfg.dim});
  rmsnorm_forward(st.hf, st.rstdf, st.xf, fp32_weight(w_[normf_]), cfg.norm_eps);
  const Tensor h = tp->f_forward(st.hf);
  st.logits = act({N, int64_t(local_vocab)});
  linear_forward(st.logits, h, w_[head_]);
  return h;
}

// The head: final RMSNorm, f, LM head (column-parallel by vocabulary), the loss, and straight
// back through the LM head, f and the norm. Adds the token losses to the tally; x leaves
// holding d(loss)/d(head input).
void Model::head_forward_backward(ForwardState& st, Tensor& x, float grad_scale) {
  const int64_t Nr = x.size(0), N = int64_t(st.B) * st.S;
  const Tensor h = head_logits(st, x);
  Tensor wn = fp32_weight(w_[normf_]);
  Tensor losses = Tensor::empty({N}, DType::F32, dev, Tag::Workspace);
  loss->forward_backward(losses, st.logits, st.logits, st.targets, vocab_start, grad_scale);
  this->losses.add(losses);
  after_forward();

  Tensor dh = work({N, cfg.dim});
  linear_backward(dh, g_[head_], st.logits, h, w_[head_]);
  st.logits = st.hf = Tensor();
  Tensor dhr = tp->f_backward(dh);
  x = work({Nr, cfg.dim});
  rmsnorm_backward(x, g_[normf_], dhr, st.xf, wn, st.rstdf);
  st.xf = st.rstdf = Tensor();
}

// ----- backward -------------------------------------------------------------------------------------

// Backward of one layer: dx holds d(loss)/d(layer output) and leaves holding d(loss)/d(input).
void Model::layer_backward(int l, ForwardState& st, Tensor& dx) {
  const LayerIdx& L = li_[l];
  LayerActs& a = st.layers[l];
  const int64_t Nr = a.x.size(0), N = int64_t(st.B) * st.S, H = local_heads, KVH = local_kv_heads, hd = cfg.head_dim();
  if (recompute == Recompute::Full) {
    layer_compute(l, a, st.B, st.S, st.pos);  // rerun the forward; the output itself is not needed
  } else if (recompute == Recompute::Selective) {
    a.h1 = act({Nr, cfg.dim});
    rmsnorm_forward(a.h1, a.rstd1, a.x, fp32_weight(w_[L.ln1]), cfg.norm_eps);
    a.h2 = act({Nr, cfg.dim});
    rmsnorm_forward(a.h2, a.rstd2, a.x_mid, fp32_weight(w_[L.ln2]), cfg.norm_eps);
  }
  // MLP: out = x_mid + g(MLP(f(h2))), h2 = RMSNorm(x_mid). The column-parallel input f(h2) is
  // rebuilt rather than stored: under sequence parallelism that is a second all-gather, and
  // only the 1/tp token block is kept (Korthikanti et al.'s sbh/t·(34 + 5as/h)). A block
  // replicated over tp has no f and g: its input gradient is already whole on every tp rank.
  Tensor tmp = work({Nr, cfg.dim});
  {
    Tensor dh2 = work({N, cfg.dim});
    TpOps& fg = mlp_tp();
    mlp->backward(*this, l, dh2, fg.g_backward(dx), fg.f_forward(a.h2), a);
    rmsnorm_backward(tmp, g_[L.ln2], fg.f_backward(dh2), a.x_mid, fp32_weight(w_[L.ln2]), a.rstd2);
    add_inplace(dx, tmp);  // dx := d x_mid (residual path + norm path)
  }
  a.h2 = a.g = a.u = a.act = a.x_mid = a.rstd2 = Tensor();
  a.mlp_state.reset();
  // Attention: x_mid = x + g(o_proj(attn(rope(q(f(h1))), rope(k(f(h1))), v(f(h1))))), h1 = RMSNorm(x).
  {
    Tensor dy = work(a.y.shape), dq = work(a.q.shape), dk = work(a.k.shape), dv = work(a.v.shape);
    linear_backward(L.o, dy.reshape({N, H * hd}), tp->g_backward(dx), a.y.reshape({N, H * hd}));
    attention->backward(dq, dk, dv, dy, a.y, a.lse, a.q, a.k, a.v, st.pos);
    rope_backward(dq, st.pos, cfg.rope_theta);
    rope_backward(dk, st.pos, cfg.rope_theta);
    Tensor dh1 = work({N, cfg.dim});
    const Tensor h1 = tp->f_forward(a.h1);
    linear_backward(L.q, dh1, dq.reshape({N, H * hd}), h1);
    linear_backward(L.k, dh1, dk.reshape({N, KVH * hd}), h1, true);
    linear_backward(L.v, dh1, dv.reshape({N, KVH * hd}), h1, true);
    rmsnorm_backward(tmp, g_[L.ln1], tp->f_backward(dh1), a.x, fp32_weight(w_[L.ln1]), a.rstd1);
    add_inplace(dx, tmp);  // dx := d x
  }
  a.release();
}

// g's backward gives every rank the full token gradient; the scatter adds the rows this rank owns.
void Model::embed_backward(ForwardState& st, const Tensor& dx) {
  embedding_backward(g_[emb_], tp->g_backward(dx), st.inputs, vocab_start);
}

// ----- the loss tally ----------------------------------------------------------------------------

static double sum_in_order(const Tensor& losses) {
  double sum = 0;
  for (float v : to_host_f32(losses)) sum += v;
  return sum;
}

void LossTally::add(const Tensor& losses) {
  if (losses.device() == Device::CPU && pending_.empty()) sums_.push_back(sum_in_order(losses));
  else pending_.push_back(losses);
}

double LossTally::take() {
  for (const Tensor& l : pending_) sums_.push_back(sum_in_order(l));
  double total = 0;
  for (double s : sums_) total += s;
  sums_.clear();
  pending_.clear();
  return total;
}

// ----- units -------------------------------------------------------------------------------------

void Model::unit_forward(int u, ForwardState& st, Tensor& x, float grad_scale) {
  const int L = cfg.layers;
  loss_scale = grad_scale;
  before_unit(u);
  if (u == 0) {
    TraceScope t("fwd embedding");
    embed_forward(st, x);
  } else if (u <= L) {
    TraceScope t("fwd layer " + std::to_string(u - 1));
    layer_forward(u - 1, st, x);
  } else {
    before_backward(u);
    {
      TraceScope t("head fwd+bwd");
      head_forward_backward(st, x, grad_scale);
    }
    unit_grads_ready(u);
  }
  if (u <= L) unit_output(u, x);
  after_unit(u);
}

void Model::unit_backward(int u, ForwardState& st, Tensor& dx, bool defer_weights) {
  TS_CHECK(u <= cfg.layers, "unit_backward: the head's backward runs inside its unit_forward");
  if (u > 0) before_unit(u);  // the embedding's backward is a scatter of dx: it reads no weights
  before_backward(u);
  defer_ = {defer_weights ? &st.deferred : nullptr, u};
  if (u == 0) {
    TraceScope t("bwd embedding");
    embed_backward(st, dx);  // a scatter, no matmul: nothing to defer
  } else {
    TraceScope t(std::string(defer_weights ? "bwd input layer " : "bwd layer ") + std::to_string(u - 1));
    layer_backward(u - 1, st, dx);
  }
  defer_.queue = nullptr;
  unit_input_grad(u, dx);
  if (defer_weights && u > 0) return;
  unit_grads_ready(u);
  if (u > 0) after_unit(u);
}

void Model::unit_backward_weights(int u, ForwardState& st) {
  {
    TraceScope t("bwd weights layer " + std::to_string(u - 1));
    for (const DeferredGrad& d : st.deferred)
      if (d.unit != u) continue;
      else if (d.entry >= 0) gemms->weight_grad(d.entry, d.dW, d.dy, d.x);
      else ts::linear_backward(Tensor(), d.dW, d.dy, d.x, Tensor());
  }
  st.deferred.erase(std::remove_if(st.deferred.begin(), st.deferred.end(), [u](const DeferredGrad& d) { return d.unit == u; }),
                    st.deferred.end());
  unit_grads_ready(u);
  after_unit(u);
}

Tensor Model::forward_logits(const Tensor& inputs, int B) {
  ForwardState st = begin_microbatch(inputs, inputs, B);
  Tensor x;
  for (int u = 0; u <= cfg.layers; u++) {
    unit_forward(u, st, x, 0.f);
    if (u > 0) st.layers[size_t(u - 1)].release();  // nothing runs backward
  }
  const int head = cfg.layers + 1;
  before_unit(head);
  head_logits(st, x);
  after_unit(head);
  return st.logits;
}

// The whole model on one rank, unit by unit, firing the hooks in the order the techniques rely
// on: forward 0..L+1 (the head runs its backward at once), then backward L..0 with
// unit_grads_ready as each unit's gradients finish.
void Model::forward_backward(const Tensor& inputs, const Tensor& targets, int B, float grad_scale, const Tensor& pos) {
  for (int u = 0; u < table.num_units(); u++) TS_CHECK(holds(u), "forward_backward needs the whole model");
  ForwardState st = begin_microbatch(inputs, targets, B, pos);
  Tensor x;
  for (int u = 0; u <= cfg.layers + 1; u++) unit_forward(u, st, x, grad_scale);
  for (int u = cfg.layers; u >= 0; u--) unit_backward(u, st, x);
}

}  // namespace ts
