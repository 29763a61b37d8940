// model.h — the Llama-style decoder every technique trains, with the extension points they need.
//
//   embedding -> L x [RMSNorm -> attention (GQA, RoPE, causal) -> +residual
//                     -> RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> LM head -> cross-entropy
//
// Parameters and gradients live in one flat buffer each, described by a table of (HF name, global
// shape, the block this rank holds, local offset). The model is cut into "units": unit 0 is the
// embedding, units 1..L the decoder layers, unit L+1 the head (final norm + lm_head). A unit's
// local parameters are one contiguous range of the flat buffer, so DP buckets and ZeRO shards are
// plain ranges, and a pipeline stage holds runs of units. Every technique plugs in at an extension
// point that is the identity at degree 1: the shard spec (tensor and pipeline parallel), f and g
// (tensor parallel), the loss (vocabulary-parallel cross-entropy), the attention core (context
// parallel), the MLP block (experts), and the hooks (DP, ZeRO) fired by unit_forward/unit_backward.
#pragma once
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensor/core.h"

namespace ts {

struct ModelConfig {
  int dim = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 160, vocab = 256, seq = 32;
  float norm_eps = 1e-5f, rope_theta = 10000.f;
  // Mixture of experts (moe.h): experts > 0 replaces every MLP by a router and `experts` SwiGLU
  // experts of width ffn, top_k of them per token; capacity_factor 0 is dropless; aux_loss_coef
  // weights the load-balancing loss. experts 0: the dense model.
  int experts = 0, top_k = 0;
  float capacity_factor = 0, aux_loss_coef = 0;
  // DeepSeekMoE as DeepSeek-V3 trains it (moe.h): routed experts of width expert_ffn (0: ffn),
  // shared_experts·expert_ffn of shared SwiGLU width every token passes through, and with
  // sigmoid_router the sigmoid affinities, the selection-only bias moved by bias_update_rate
  // after each step, the gate weights times routed_scaling, and expert_groups groups of which
  // each token keeps group_limit. All off by default: Mixtral's block.
  int expert_ffn = 0, shared_experts = 0, expert_groups = 1, group_limit = 1;
  bool sigmoid_router = false;
  float routed_scaling = 1, bias_update_rate = 0;
  int expert_width() const { return expert_ffn > 0 ? expert_ffn : ffn; }
  int head_dim() const { return dim / heads; }
  int kv_dim() const { return kv_heads * head_dim(); }
};

// Token ids, targets and positions onto `dev` (int32 [v.size()], Tag::Workspace), the way every
// micro-batch's ints reach the device. On CUDA through pinned host staging and an asynchronous
// copy on the compute stream (model.cu says why); on the CPU a plain copy.
Tensor upload_ints(const std::vector<int32_t>& v, Device dev);

// Activation recomputation (playbook, "Activation recomputation"):
//  none      — every activation the backward needs is stored;
//  selective — matmul outputs are stored, the cheap element-wise outputs (the two RMSNorm outputs
//              and the SwiGLU product) are recomputed in backward: memory for no matmul FLOPs;
//  full      — only each layer's input is stored; the layer's forward is rerun in backward.
enum class Recompute { None, Selective, Full };

// How a parameter is split across the ranks that share it (tensor parallelism) and whether this
// rank holds it at all (pipeline stages, experts).
enum class Split {
  Whole,  // this rank holds all of it (replicated_over says which group holds the same copy)
  Rows,   // a block of rows: column-parallel linears (q/k/v, gate/up) and the vocabulary tables
  Cols,   // a block of columns: row-parallel linears (o_proj, down_proj)
  None,   // held elsewhere: a unit another pipeline stage owns, an expert another rank owns
};

// One row of the parameter table. Every rank keeps every row (so indices agree across ranks);
// the row says which block of the global tensor this rank holds and where it sits locally.
struct ParamEntry {
  std::string name;                  // HF name
  std::vector<int64_t> shape;        // global shape
  Split split = Split::Whole;
  int parts = 1, part = 0;           // Rows/Cols: the block is part `part` of `parts` equal blocks
  std::string replicated_over;       // Whole: the group whose ranks hold identical copies ("" = none)
  bool counts = true;                // this copy is the one norms and checkpoints count (one per replica group)
  std::vector<int64_t> local_shape;  // the block held here (empty numel for Split::None)
  int64_t offset = 0;                // element offset of the block in this rank's flat buffers
  int64_t numel = 0;                 // elements held here
  int64_t global_numel = 0;
  int unit = 0;                      // 0 embedding, 1..L layers, L+1 head
  bool decay = false;                // AdamW weight decay: 2-D tensors only
  bool is_norm = false;              // initialised to 1 instead of N(0, 0.02)
  bool held() const { return split != Split::None; }
  // The first global row and column of the block (the block's corner in the global matrix).
  int64_t row0() const { return split == Split::Rows ? part * local_shape[0] : 0; }
  int64_t col0() const { return split == Split::Cols ? part * local_shape[1] : 0; }
  // Calls f(local, global, n) for the runs of consecutive global elements that make up the held
  // elements [lo, hi) of the block (0 <= lo <= hi <= numel): one run for a row block or a whole
  // tensor, one per row for a column block.
  template <class F> void for_each_run(int64_t lo, int64_t hi, F f) const {
    if (split != Split::Cols) {
      if (lo < hi) f(lo, row0() * (global_numel / shape[0]) + lo, hi - lo);
      return;
    }
    const int64_t lc = local_shape[1], gc = shape[1];
    for (int64_t r = lo / lc; r * lc < hi; r++) {
      const int64_t b = std::max(lo, r * lc), e = std::min(hi, (r + 1) * lc);
      f(b, r * gc + col0() + (b - r * lc), e - b);
    }
  }
};

struct ParamTable {
  std::vector<ParamEntry> entries;
  std::vector<int64_t> unit_begin;  // unit u's local parameters are [unit_begin[u], unit_begin[u+1])
  int64_t total = 0;                // elements of this rank's flat buffers
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
  // The one map from this rank's flat buffers to global tensors: f(entry, flat, global, n) for
  // every run of n elements at flat offset `flat` that are elements [global, global + n) of the
  // entry's full tensor, over the flat range [b, e). Initialisation and checkpoints go through it.
  template <class F> void for_each_global_run(int64_t b, int64_t e, F f) const {
    for_each_overlap(b, e, [&](const ParamEntry& p, int64_t lo, int64_t hi) {
      p.for_each_run(lo - p.offset, hi - p.offset, [&](int64_t l, int64_t g, int64_t n) { f(p, p.offset + l, g, n); });
    });
  }
};

// Which blocks of the model this rank holds.
struct ShardSpec {
  int tp = 1, tp_rank = 0;                      // tensor parallelism: heads, ffn and vocabulary split tp ways
  std::vector<std::pair<int, int>> unit_runs;   // units held, as runs [begin, end); empty = every unit
  // Expert parallelism: this rank holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep) of every layer;
  // the dense tensors are replicated over the ep group (counted once, on ep rank 0).
  int ep = 1, ep_rank = 0;
  // Tensor parallelism's split table: how the weight with this HF name is split over the tp
  // ranks (Rows, Cols or Whole). 04_tensor_parallel.cu defines it (tp::split_of); without a
  // table every dense tensor is whole, which tp > 1 refuses.
  Split (*tp_split)(const std::string& hf_name) = nullptr;
  bool holds(int unit) const {
    if (unit_runs.empty()) return true;
    for (auto [b, e] : unit_runs)
      if (unit >= b && unit < e) return true;
    return false;
  }
};

// How this rank lays out and holds the model.
struct ModelLayout {
  ShardSpec shard;
  int align = 1;            // every unit's range padded to a multiple of this (ZeRO shards units N ways)
  bool hold_params = true;  // false under ZeRO-3: weights are bound unit by unit when gathered
  bool hold_grads = true;   // false under ZeRO-2/3: gradient buffers are bound per unit in backward
};

// A hook with any number of subscribers, called in the order they were added (several
// techniques may act on the same unit: sequence-parallel norm reduction and DP on one mesh).
template <class... A> class Hook {
 public:
  void add(std::function<void(A...)> f) { subs_.push_back(std::move(f)); }
  void clear() { subs_.clear(); }
  bool empty() const { return subs_.empty(); }
  void operator()(A... a) const {
    for (const auto& f : subs_) f(a...);
  }
 private:
  std::vector<std::function<void(A...)>> subs_;
};

// What a swapped-in MLP block saves for its backward (MoE: moe.h's MoeActs, named tensors).
struct MlpState {
  virtual ~MlpState() = default;
};

// Saved activations of one decoder layer for one micro-batch (Tag::Activations). Under sequence
// parallelism the residual stream and the norms (x, h1, x_mid, h2, rstd) hold 1/tp of the
// micro-batch's tokens; f rebuilds the full-token inputs of the column-parallel matmuls.
struct LayerActs {
  Tensor x;                 // layer input (the residual stream)
  Tensor h1, rstd1;         // input_layernorm output (not kept under selective) and its 1/rms
  Tensor q, k, v;           // after RoPE, this rank's heads
  Tensor y, lse;            // attention output [B, S, H_local, hd] and its log-sum-exp [B, H_local, S]
  Tensor x_mid;             // x + g(o_proj(y))
  Tensor h2, rstd2;         // post_attention_layernorm
  Tensor g, u, act;         // SwiGLU's gate, up, silu(g)*u (act not kept under selective)
  std::shared_ptr<MlpState> mlp_state;  // what a swapped-in MLP block saves (MoE routing)
  double aux_loss = 0;      // the MLP block's auxiliary loss for this micro-batch (MoE balance), weighted
  void release() { *this = LayerActs(); }
};

// A weight-gradient matmul dW += dy^T · x whose input-gradient half has already run: zero-bubble
// pipeline schedules run a unit's backward as B (input gradient) now and W (this) later.
struct DeferredGrad {
  int unit;
  Tensor dW, dy, x;
  int entry = -1;  // a dense linear's table entry (its GEMMs go through Model::gemms), or -1
  std::weak_ptr<Buffer> x_from;  // the B's scratch that x was copied from, while it lives,
  size_t x_from_offset = 0;      // and where in it (Model::defer_weight_grad)
};

// What one forward pass of a micro-batch keeps for its backward.
struct ForwardState {
  int B = 0, S = 0;         // sequences, and tokens of each on this rank
  Tensor inputs, targets;   // int32 [B*S]
  Tensor pos;               // int32 [S]: absolute positions of this rank's tokens
  std::vector<LayerActs> layers;
  Tensor xf, hf, rstdf;     // final RMSNorm input/output
  Tensor logits;            // [N, V_local]; holds dlogits after the loss kernel
  double aux_loss = 0;      // the MLP blocks' auxiliary losses, summed over layers
  std::vector<DeferredGrad> deferred;  // weight gradients waiting for unit_backward_weights
};

// The extension points the techniques plug in, each in a header of its own (an identity or a
// default at degree 1): TpOps and LossFn (model/tp_ops.h, tensor parallelism), AttentionCore
// (model/attention_core.h, context parallelism), MlpBlock (model/mlp_block.h, experts) and
// LinearGemms (model/linear_gemms.h, FP8's quantized GEMMs). A chapter includes the one it uses.
struct AttentionCore;
struct MlpBlock;
struct TpOps;
struct LossFn;
struct LinearGemms;

// The token losses of a step's micro-batches, read on the host once per step: on a GPU each read
// is a device-to-host copy that waits for the whole queue, so reading per micro-batch would
// stall the launch of the next. Each micro-batch is summed in double in token order, then the
// micro-batches in the order they were added: the same value on every backend and mesh.
class LossTally {
 public:
  void add(const Tensor& losses);  // a CPU tensor is summed at once (free); a GPU one is kept
  double take();                   // the sum since the last take (one host sync on a GPU)
 private:
  std::vector<double> sums_;       // per micro-batch, in order, once read
  std::vector<Tensor> pending_;    // GPU tensors not yet read, after sums_
};

class Model {
 public:
  Model(const ModelConfig& cfg, Device dev, DType compute, Recompute rc, ModelLayout layout = {});
  ~Model();  // in model.cu, where the extension points' types are complete

  // ----- parameters ------------------------------------------------------------------------
  // Builds the table for this configuration and this rank's shard (a pure function of the
  // shapes; used by --dry-run). align > 1 pads each unit's range to a multiple of align (the
  // padding belongs to no tensor).
  static ParamTable make_table(const ModelConfig& cfg, int align = 1, const ShardSpec& shard = {});
  // Initialises the local range [b, e) of the flat parameters into dst (fp32, e - b elements):
  // every element gets the value of its global index (init is a pure function of it).
  static void init_range(const ParamTable& t, uint64_t seed, int64_t b, int64_t e, const Tensor& dst);

  const ModelConfig cfg;
  const Device dev;
  const DType dtype;  // compute dtype of weights and activations
  Recompute recompute;
  ParamTable table;
  const ShardSpec shard;
  // This rank's share of the dimensions tensor parallelism splits (from the table).
  int local_heads, local_kv_heads, local_vocab;
  int64_t vocab_start;  // the first vocabulary row this rank holds

  // The compute weights (dtype) and fp32 gradients, as flat buffers over the local table.
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
  bool holds(int u) const { return shard.holds(u); }

  // ----- extension points ------------------------------------------------------------------
  Hook<int> before_unit;       // before a unit's weights are read
  Hook<int> before_backward;   // before a unit's gradients are written
  Hook<int> unit_grads_ready;  // after a unit's gradients are complete
  Hook<int> after_unit;        // after a unit's forward/backward has used its weights
  Hook<> after_forward;        // loss computed, backward not yet started
  // The numerics' view (no-ops unless subscribed): a unit's output after its forward (u <= L:
  // the residual stream leaving it), and d(loss)/d(its input) after its backward.
  Hook<int, const Tensor&> unit_output;
  Hook<int, const Tensor&> unit_input_grad;
  std::unique_ptr<AttentionCore> attention;  // default: local causal attention
  std::unique_ptr<MlpBlock> mlp;             // default: SwiGLU
  std::unique_ptr<TpOps> tp;                 // default: identity f and g
  std::unique_ptr<LossFn> loss;              // default: the fused softmax-cross-entropy
  std::unique_ptr<LinearGemms> gemms;        // default: the compute dtype's matmuls
  float loss_scale = 1;  // the current micro-batch's grad_scale (set by unit_forward): MLP blocks scale their aux loss by it

  // ----- one micro-batch, unit by unit -----------------------------------------------------
  // inputs/targets: int32 [B*S] on dev, S = this rank's tokens per sequence; pos: int32 [S],
  // their absolute positions (undefined: 0..S-1).
  ForwardState begin_microbatch(const Tensor& inputs, const Tensor& targets, int B, const Tensor& pos = Tensor());
  // Unit u's forward: x is the residual stream in and out (built from the tokens at unit 0).
  // The head (u = L+1) runs its backward at once, because the fused loss turns the logits into
  // their gradient in place: it adds the token losses to `losses` and leaves d(loss)/d(head input) in x.
  // grad_scale multiplies every token's loss gradient. Fires before_unit/after_unit (and the
  // head's backward hooks).
  void unit_forward(int u, ForwardState& st, Tensor& x, float grad_scale);
  // Unit u's backward (u <= L): dx holds d(loss)/d(unit output) and leaves holding
  // d(loss)/d(unit input). defer_weights: compute only the input gradient now and queue the
  // weight-gradient matmuls in st.deferred for unit_backward_weights (zero-bubble B/W split).
  // Fires before_unit/before_backward, and unit_grads_ready/after_unit unless deferred.
  void unit_backward(int u, ForwardState& st, Tensor& dx, bool defer_weights = false);
  // The backward in progress's deferral (none outside one): a caller that suspends a backward
  // mid-unit to run another pass saves it, and puts it back when the backward resumes.
  struct Deferral { std::vector<DeferredGrad>* queue = nullptr; int unit = -1; };
  Deferral deferral() const { return defer_; }
  void set_deferral(Deferral d) { defer_ = d; }
  // The W half: runs the queued weight-gradient matmuls of unit u, then fires its
  // unit_grads_ready and after_unit.
  void unit_backward_weights(int u, ForwardState& st);

  // The token losses of the micro-batches run since the last take_loss, summed (not divided).
  LossTally losses;
  double take_loss() { return losses.take(); }

  // The whole model on one rank: forward 0..L+1, backward L..0. Adds the micro-batch's token
  // losses to `losses`; gradients += d(loss_sum * grad_scale)/dparams.
  void forward_backward(const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                          const Tensor& pos = Tensor());

  // Forward only (evaluation, sampling): units 0..L, then the head's norm and LM head, firing
  // before_unit/after_unit for each (ZeRO-3 gathers) and no gradient hook; every saved
  // activation is dropped as soon as the next unit has run. Returns the logits [B*S, V_local].
  Tensor forward_logits(const Tensor& inputs, int B);

  // dx [N, in] = dy @ W (or += when accumulate_dx); dW += dy^T @ x now, or queued when the
  // current backward defers weight gradients. What layers and MLP blocks call.
  void linear_backward(const Tensor& dx, const Tensor& dW, const Tensor& dy, const Tensor& x, const Tensor& W,
                       bool accumulate_dx = false);
  // The same for the dense linear at table entry e (its weight(e) and grad(e)), through `gemms`.
  void linear(int e, const Tensor& y, const Tensor& x);
  void linear_backward(int e, const Tensor& dx, const Tensor& dy, const Tensor& x, bool accumulate_dx = false);

 private:
  int e_idx(const std::string& name) const;
  struct LayerIdx {
    int ln1, q, k, v, o, ln2;
  };
  std::vector<LayerIdx> li_;
  int emb_ = -1, normf_ = -1, head_ = -1;
  std::vector<Tensor> w_, g_;
  Deferral defer_;  // where linear_backward queues dW while deferring, and for which unit
  void defer_weight_grad(int e, const Tensor& dW, const Tensor& dy, const Tensor& x);
  // The f and g around the MLP block: tp's, or the identity for a block replicated over tp.
  TpOps& mlp_tp();
  Tensor act(std::vector<int64_t> shape) const { return Tensor::empty(shape, dtype, dev, Tag::Activations); }
  Tensor work(std::vector<int64_t> shape) const { return Tensor::empty(shape, dtype, dev, Tag::Workspace); }
  void embed_forward(ForwardState& st, Tensor& x);
  void layer_forward(int layer, ForwardState& st, Tensor& x);
  Tensor layer_compute(int l, LayerActs& a, int B, int S, const Tensor& pos);
  Tensor head_logits(ForwardState& st, const Tensor& x);
  void head_forward_backward(ForwardState& st, Tensor& x, float grad_scale);
  void layer_backward(int layer, ForwardState& st, Tensor& dx);
  void embed_backward(ForwardState& st, const Tensor& dx);
};

double flops_per_token(const ModelConfig& cfg);
int64_t param_count(const ModelConfig& cfg, bool with_embedding = true);
// Parameters this rank holds (Ψ local): sum of the held blocks' sizes, padding excluded.
int64_t local_param_count(const ParamTable& t);

}  // namespace ts
