// model.h — the Llama-style decoder every technique trains, with the extension points they need.
//
//   embedding -> L x [RMSNorm -> attention (GQA, RoPE, causal) -> +residual
//                     -> RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> LM head -> cross-entropy
//
// Parameters and gradients live in one flat buffer each, described by a table of (HF name, global
// shape, offset). The model is cut into "units": unit 0 is the embedding, units 1..L the decoder
// layers, unit L+1 the head (final norm + lm_head). A unit's parameters are one contiguous range
// of the flat buffer, so DP buckets and ZeRO shards are plain ranges, and a pipeline stage owns a
// run of units. Hooks fire when a unit's gradients are complete (DP/ZeRO communication) and
// before a unit's parameters are used (ZeRO-3 gathering).
#pragma once
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "core.h"
#include "kernels.h"

namespace ts {

struct ModelConfig {
  int dim = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 160, vocab = 256, seq = 32;
  float norm_eps = 1e-5f, rope_theta = 10000.f;
  int head_dim() const { return dim / heads; }
  int kv_dim() const { return kv_heads * head_dim(); }
};

// Activation recomputation (playbook, "Activation recomputation"):
//  none      — every activation the backward needs is stored;
//  selective — matmul outputs are stored, the cheap element-wise outputs (the two RMSNorm outputs
//              and the SwiGLU product) are recomputed in backward: memory for no matmul FLOPs;
//  full      — only each layer's input is stored; the layer's forward is rerun in backward.
enum class Recompute { None, Selective, Full };

// One row of the parameter table.
struct ParamEntry {
  std::string name;            // HF name
  std::vector<int64_t> shape;  // global shape
  int64_t offset = 0;          // element offset in the flat buffers
  int64_t numel = 0;
  int unit = 0;                // 0 embedding, 1..L layers, L+1 head
  bool decay = false;          // AdamW weight decay: 2-D tensors only
  bool is_norm = false;        // initialised to 1 instead of N(0, 0.02)
};

struct ParamTable {
  std::vector<ParamEntry> entries;
  std::vector<int64_t> unit_begin;  // unit u's parameters are [unit_begin[u], unit_begin[u+1])
  int64_t total = 0;
  const ParamEntry& find(const std::string& name) const;
  int num_units() const { return int(unit_begin.size()) - 1; }
  // Calls f(entry, lo, hi) for every parameter overlapping the range [b, e) of the flat buffers,
  // [lo, hi) being the overlap: how shards and checkpoint slices that cut tensors visit them.
  template <class F> void for_each_overlap(int64_t b, int64_t e, F f) const {
    for (const ParamEntry& p : entries) {
      const int64_t lo = std::max(b, p.offset), hi = std::min(e, p.offset + p.numel);
      if (lo < hi) f(p, lo, hi);
    }
  }
};

// How this rank lays out and holds the model.
struct ModelLayout {
  int unit_begin = 0, unit_end = -1;  // units held: [begin, end); -1 = through the head (pipeline stages)
  int align = 1;            // every unit's range padded to a multiple of this (ZeRO shards units N ways)
  bool hold_params = true;  // false under ZeRO-3: weights are bound unit by unit when gathered
  bool hold_grads = true;   // false under ZeRO-2/3: gradient buffers are bound per unit in backward
};

// Saved activations of one decoder layer for one micro-batch (Tag::Activations).
struct LayerActs {
  Tensor x;                 // layer input [N, D] (the residual stream)
  Tensor h1, rstd1;         // input_layernorm output (not kept under selective) and its 1/rms
  Tensor q, k, v;           // after RoPE
  Tensor y, lse;            // attention output [N, H*hd] and its log-sum-exp [B, H, S]
  Tensor x_mid;             // x + o_proj(y)
  Tensor h2, rstd2;         // post_attention_layernorm
  Tensor g, u, act;         // SwiGLU's gate, up, silu(g)*u (act not kept under selective)
  void release() { *this = LayerActs(); }
};

// What one forward pass of a micro-batch keeps for its backward.
struct ForwardState {
  int B = 0;
  Tensor inputs, targets;   // int32 [B*S]
  Tensor pos;               // int32 [S]: absolute positions of this rank's tokens
  std::vector<LayerActs> layers;
  Tensor xf, hf, rstdf;     // final RMSNorm input/output
  Tensor logits;            // [N, V]; holds dlogits after the loss kernel
};

// The attention core (scaled-dot-product over already projected, rotated q/k/v) is swappable:
// context parallelism replaces it with ring attention.
struct AttentionCore {
  virtual ~AttentionCore() = default;
  virtual void forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& pos) = 0;
  virtual void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& pos) = 0;
};

class Model;

// The MLP block (post-attention RMSNorm output h -> the residual branch) is swappable: expert
// parallelism replaces SwiGLU by a routed mixture of experts.
struct MlpBlock {
  virtual ~MlpBlock() = default;
  // y [N, D] = MLP_layer(h); saves in `a` what backward needs (Tag::Activations).
  virtual void forward(Model& m, int layer, const Tensor& y, const Tensor& h, LayerActs& a) = 0;
  // dh [N, D] := (dy/dh)^T · dy, overwritten; the block's weight gradients accumulate.
  virtual void backward(Model& m, int layer, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) = 0;
  // Selective recompute: drops the saved tensors backward can rebuild without a matmul.
  virtual void drop_recomputable(LayerActs& a) = 0;
};

class Model {
 public:
  Model(const ModelConfig& cfg, Device dev, DType compute, Recompute rc, ModelLayout layout = {});

  // ----- parameters ------------------------------------------------------------------------
  // Builds the table for this configuration (pure function of the shapes; used by --dry-run).
  // align > 1 pads each unit's range to a multiple of align (the padding belongs to no tensor).
  static ParamTable make_table(const ModelConfig& cfg, int align = 1);
  // Counter-based init of entry e into a fp32 tensor holding elements [elem0, elem0+n) of it.
  static void init_entry(const ParamEntry& e, uint64_t seed, const Tensor& dst, int64_t elem0);
  // Initialises the global range [b, e) of the flat parameters into dst (fp32, e - b elements).
  static void init_range(const ParamTable& t, uint64_t seed, int64_t b, int64_t e, const Tensor& dst);

  const ModelConfig cfg;
  const Device dev;
  const DType dtype;  // compute dtype of weights and activations
  Recompute recompute;
  ParamTable table;
  int unit_begin, unit_end;   // units held on this rank
  int64_t local_begin = 0, local_end = 0;  // their range in the flat buffers

  // The compute weights (dtype) and fp32 gradients, as flat buffers over [local_begin, local_end).
  // Each is addressed through weight(e) / grad(e), which ZeRO-3 can re-point (bind_unit).
  Tensor params, grads;
  int entry(const std::string& name) const;  // index into table.entries
  Tensor weight(int entry) const { return w_[entry]; }
  Tensor grad(int entry) const { return g_[entry]; }
  // Points unit u's weight views at `flat`, a buffer holding exactly the unit's range
  // (an undefined tensor unbinds them, releasing a gathered buffer).
  void bind_unit(int u, const Tensor& flat);
  // Points unit u's gradient views at `flat` (ZeRO-2/3 use per-unit gradient buffers).
  void bind_unit_grads(int u, const Tensor& flat);
  // A view of the flat buffer `flat` (covering [local_begin, local_end)) for global range [b, e).
  Tensor range(const Tensor& flat, int64_t b, int64_t e) const;

  // ----- hooks -------------------------------------------------------------------------------
  std::function<void(int unit)> before_unit;       // before a unit's weights are read
  std::function<void(int unit)> before_backward;   // before a unit's gradients are written
  std::function<void(int unit)> unit_grads_ready;  // after a unit's gradients are complete
  std::function<void(int unit)> after_unit;        // after a unit's forward/backward has used its weights
  std::function<void()> after_forward;             // loss computed, backward not yet started
  std::unique_ptr<AttentionCore> attention;        // default: local causal attention
  std::unique_ptr<MlpBlock> mlp;                   // default: SwiGLU

  // ----- forward and backward of one micro-batch ---------------------------------------------
  // inputs/targets: int32 [B*S] on dev. Whole model on this rank: returns the sum over tokens of
  // the cross-entropy (not divided); gradients += d(loss_sum * grad_scale)/dparams.
  double forward_backward(const Tensor& inputs, const Tensor& targets, int B, float grad_scale);

  // The pieces, for pipeline stages: forward of units [ub, ue) from x (or tokens at unit 0),
  // and the matching backward.
  void embed_forward(ForwardState& st, Tensor& x);
  void layer_forward(int layer, ForwardState& st, Tensor& x);   // x: in -> out (new tensor)
  double head_forward_backward(ForwardState& st, const Tensor& x, Tensor& dx, float grad_scale);
  void layer_backward(int layer, ForwardState& st, Tensor& dx);  // dx: out -> in (in place)
  void embed_backward(ForwardState& st, const Tensor& dx);
  ForwardState begin_microbatch(const Tensor& inputs, const Tensor& targets, int B);

 private:
  int e_idx(const std::string& name) const;
  struct LayerIdx {
    int ln1, q, k, v, o, ln2;
  };
  std::vector<LayerIdx> li_;
  int emb_ = -1, normf_ = -1, head_ = -1;
  std::vector<Tensor> w_, g_;
  Tensor act(std::vector<int64_t> shape) const { return Tensor::empty(shape, dtype, dev, Tag::Activations); }
  Tensor work(std::vector<int64_t> shape) const { return Tensor::empty(shape, dtype, dev, Tag::Workspace); }
  Tensor layer_compute(int l, LayerActs& a, int B, const Tensor& pos);
};

// FLOPs per token of a training step: the playbook's 6·N + 12·L·h·s, N without the embedding.
double flops_per_token(const ModelConfig& cfg);
int64_t param_count(const ModelConfig& cfg, bool with_embedding = true);

}  // namespace ts
