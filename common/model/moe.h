// moe.h — the mixture-of-experts MLP block (Mixtral's sparse MoE), its kernels, and its
// routing statistics.
//
//   h -> router (fp32 logits, softmax over E experts, top-k, the k weights renormalised)
//     -> each token's rows gathered per expert (expert 0's tokens first, each in token order)
//     -> E SwiGLU experts, each over its own rows -> y[t] = Σ_k w[t,k] · expert_{i(t,k)}(h[t])
//
// The block is an MlpBlock (model.h): --experts 0 keeps the dense SwiGLU MLP and every result
// of a dense model bit for bit. Capacity (--capacity-factor c > 0): each expert takes at most
// floor(c·T·K/E) tokens of each sequence, the earliest first (the sequence is the capacity group,
// so what is dropped does not depend on how the batch is split); a dropped assignment adds
// nothing and the token keeps its residual. The auxiliary load-balancing loss (Switch
// Transformer, eq. 4; Mixtral) per sequence b and layer: aux = E · Σ_e f_e · P_e, f_e the
// fraction of the sequence's T·K routing choices that picked e (before capacity), P_e the mean
// router probability of e over its T tokens; the training loss adds α · mean_b Σ_layers aux.
// Expert parallelism (07) replaces experts_forward/experts_backward: the routing, the gather and
// the combine stay here (a dispatch that weights and sums elsewhere, 07a's two-level one on the
// experts' nodes, replaces routed_forward/routed_backward).
//
// DeepSeekMoE as DeepSeek-V3 trains it (DeepSeek-V3 technical report §2.1.2; DeepSeekMoE, Dai et
// al. 2024; Hugging Face's DeepseekV3TopkRouter/DeepseekV3MoE), all off by default:
//   fine-grained experts  routed experts of width F_e (--expert-ffn) and S shared experts
//                         (--shared-experts) every token passes through, added to the routed sum;
//                         the S shared experts are one SwiGLU of width S·F_e, as Hugging Face
//                         stores them (the same function: S experts' hidden units side by side);
//   sigmoid router        s_{t,e} = sigmoid(u_t·e_e) in fp32; the choice ranks s + b_e, the gate
//                         weights are the unbiased s of the chosen K over their sum, times the
//                         routed scaling factor (--routed-scaling; DeepSeek-V3: 2.5);
//   bias b_e              selects only (no gradient, not the optimizer's): after each step
//                         b_e += γ·sign(mean load − load_e), loads summed over every rank that routes
//                         (--bias-update-rate γ; DeepSeek-V3: 0.001) — auxiliary-loss-free balancing;
//   sequence-wise loss    eq. 17–20: α Σ_e f_e P_e, f_e = E/(K·T)·(choices of e), P_e the mean of
//                         s' = s/Σ_e s over the sequence: the Switch formula above with s' for p;
//   group-limited routing E experts in G groups (--expert-groups), a group scored by the sum of its
//                         two largest biased scores (Hugging Face's code; the report says the K/M
//                         largest), each token keeps its M best groups (--group-limit) and takes its
//                         K experts among them: the other groups' experts are masked to −∞ (as
//                         transformers' DeepseekV3, Glm4Moe and Dots1 routers do), so a token's
//                         experts lie in at most M groups whatever the bias.
#pragma once
#include <string>
#include <vector>

#include "model/model.h"
#include "model/mlp_block.h"

namespace ts {

// ----- kernels (CPU reference here, CUDA twin in the same file; no float atomics) ---------------
// logits [N, E] fp32 -> probs [N, E] fp32 = softmax (in double); idx [N, K] int32 = the k
// largest probabilities, descending, ties to the lower expert index; w [N, K] fp32 = those
// probabilities divided by their sum.
void moe_router_forward(const Tensor& probs, const Tensor& idx, const Tensor& w, const Tensor& logits);
// dlogits [N, E] fp32 (overwritten) from dw [N, K] fp32 (d loss / d renormalised weights) and
// daux [B, E] fp32 (d loss / d probs of every token of sequence b: the aux loss's gradient;
// undefined: none), S tokens per sequence. With s = Σ_k p_{i_k} and w_k = p_{i_k}/s:
//   dp_j = [j = i_k] (dw_k − Σ_k' dw_k' w_k') / s + daux[b, j];  dz_j = p_j (dp_j − Σ_i p_i dp_i).
void moe_router_backward(const Tensor& dlogits, const Tensor& dw, const Tensor& probs, const Tensor& idx,
                         const Tensor& daux, int64_t S);
// DeepSeek-V3's router: logits [N, E] fp32 -> scores [N, E] fp32 = sigmoid(z) (in double); the
// biased scores s + bias (bias [E] fp32, undefined: 0; added in fp32) pick `group_limit` of
// `groups` groups and then idx [N, K], each the largest remaining, ties to the lower index (groups
// likewise); w [N, K] fp32 = scale · s_{i_k} / (Σ_k s_{i_k} + 1e-20). groups ≤ 64.
void moe_router_sigmoid_forward(const Tensor& scores, const Tensor& idx, const Tensor& w, const Tensor& logits,
                                const Tensor& bias, int groups, int group_limit, float scale);
// dlogits [N, E] fp32 (overwritten) from dw [N, K] and daux [B, E] (d loss / d s'_{t,e} of every
// token of sequence b, s' = s / Σ_e s; undefined: none), S tokens per sequence. With
// σ = Σ_k s_{i_k} + 1e-20 and Σ = Σ_e s_e:
//   ds_j = Σ_k [j = i_k] scale·(dw_k − Σ_k' dw_k' s_{i_k'}/σ)/σ + (daux_j − Σ_i s'_i daux_i)/Σ;
//   dz_j = ds_j · s_j (1 − s_j).
void moe_router_sigmoid_backward(const Tensor& dlogits, const Tensor& dw, const Tensor& scores, const Tensor& idx,
                                 const Tensor& daux, int64_t S, float scale);
// Auxiliary-loss-free balancing, one layer: bias[e] += rate · sign(mean_e load − load[e]) (float).
void moe_bias_update(float* bias, const int64_t* load, int E, float rate);
// out [M, D] (T): out[a] = scale[a] · x[rows[a]] (scale undefined: 1); rows int32 [M].
void moe_gather(const Tensor& out, const Tensor& x, const Tensor& rows, const Tensor& scale);
// y [N, D] (T, overwritten): y[t] = Σ_k w[t,k] · x[src[t,k]] in slot order, skipping src = −1
// (w undefined: 1). The scatter-add of expert rows back to tokens, written as a gather: each
// output row is owned by one thread, so no atomics.
void moe_combine(const Tensor& y, const Tensor& x, const Tensor& src, const Tensor& w);
// dw [N, K] fp32 (overwritten): dw[t,k] = dy[t] · x[src[t,k]] (0 where src = −1), in double.
void moe_combine_backward_weights(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& src);

// ----- the routing plan (host side: small, and the counts are what all-to-all needs first) ------
// From the top-k choices of B sequences of S tokens: the expert-grouped order of the kept
// assignments (perm: their tokens, wa: their weights), src[t,k] (the row of assignment (t,k) in
// that order, −1 if dropped), the kept rows per expert, the choices per sequence and expert (for
// the aux loss), and the number dropped. cap = rows per expert and sequence (< 0: no limit).
struct RoutingPlan {
  std::vector<int32_t> perm, src;
  std::vector<float> wa;
  std::vector<int64_t> kept;        // [E]
  std::vector<int64_t> seq_counts;  // [B, E] choices before capacity
  int64_t dropped = 0;
};
RoutingPlan make_routing_plan(const std::vector<int32_t>& idx, const std::vector<float>& w, int B, int S, int E,
                              int K, int64_t cap);
// floor(c·S·K/E) rows per expert and sequence; −1 (no limit) when c is 0.
int64_t expert_capacity(const ModelConfig& c, int S);

// ----- routing statistics of a step -------------------------------------------------------------
struct MoeStats {
  std::vector<int64_t> counts;  // [L, E] routing choices (before capacity) summed over the step's tokens
  int64_t assignments = 0, dropped = 0;
  double aux_sum = 0;           // Σ over sequences and layers of aux (unweighted)
  int64_t sequences = 0;        // sequences seen (each counted once per step)
  void reset(int L, int E) { *this = MoeStats(); counts.assign(size_t(L) * E, 0); }
};

bool is_expert_param(const ParamEntry& e);  // "...block_sparse_moe.experts.{j}..." or "...mlp.experts.{j}..."
// The router and expert j's matrices of layer l, `role` gate_proj, up_proj or down_proj, in the
// names of the transformers class that computes the same function (checkpoint.cu: hf_config):
// Mixtral's (block_sparse_moe.gate, experts.{j}.w1/w3/w2) for the softmax router, Glm4Moe's (the
// DeepseekV3 layout: mlp.gate, mlp.experts.{j}.gate_proj/up_proj/down_proj) for the sigmoid one.
std::string moe_gate_name(const ModelConfig& c, int l);
std::string moe_expert_name(const ModelConfig& c, int l, int j, const char* role);
// DeepSeek-V3's names: the routing bias, and the shared experts' gate_proj/up_proj/down_proj.
std::string moe_bias_name(int l);
std::string moe_shared_name(int l, const char* w);
bool is_moe_bias(const ParamEntry& e);

// What the block saves for its backward in LayerActs::mlp_state, one micro-batch of one layer:
// device tensors (Tag::Activations unless said) and two host tensors of bookkeeping. A subclass
// that saves more extends it (07's EpActs) and says so in MoeBlock::new_acts.
struct MoeActs : MlpState {
  Tensor probs, idx;     // router probabilities (or sigmoid scores) [N, E] fp32, choices [N, K] int32
  Tensor src, perm, wa;  // the routing plan: src [N, K], perm and wa [M] (make_routing_plan)
  Tensor out, in;        // the experts' outputs and grouped input rows [M, D] (in: where they ran)
  Tensor host_counts;    // CPU int32: choices per sequence and expert [B·E], kept rows per expert [E], dropped
  Tensor host_aux;       // CPU fp32 [B]: aux per sequence
  Tensor shared_g, shared_u, shared_act;  // the shared experts' gate and up outputs and their product
};

class MoeBlock : public MlpBlock {
 public:
  explicit MoeBlock(const Model& m);
  void forward(Model& m, int layer, const Tensor& y, const Tensor& h, LayerActs& a) override;
  void backward(Model& m, int layer, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) override;
  void drop_recomputable(LayerActs& a) override { a.act = Tensor(); }
  bool split_over_tp() const override { return false; }  // router and experts whole on every tp rank

  // The experts over the expert-grouped rows x [M, D] (counts[e] rows of global expert e, in
  // order): returns their outputs [M, D] (Tag::Activations). Local here; 07 dispatches.
  virtual Tensor experts_forward(Model& m, int l, const Tensor& x, const std::vector<int64_t>& counts, LayerActs& a);
  // dx [M, D] (overwritten) from dout [M, D]; expert weight gradients accumulate.
  virtual void experts_backward(Model& m, int l, const Tensor& dx, const Tensor& dout,
                                const std::vector<int64_t>& counts, LayerActs& a);

  // The routed experts with their gate weighting, the part a subclass may own whole (07's two-level
  // dispatch weights and sums a token's experts on their node, DeepSeek-V3 §3.2.2).
  // Forward: y [N, D] (overwritten) = Σ_k w[t,k] · expert_{i(t,k)}(h[t]) from the expert-grouped
  // rows x and w [N, K] fp32; here experts_forward, then moe_combine in slot order k = 0..K−1.
  virtual void routed_forward(Model& m, int l, const Tensor& y, const Tensor& x, const Tensor& w,
                              const std::vector<int64_t>& counts, LayerActs& a);
  // Backward, from dy [N, D]: dh [N, D] (overwritten) = Σ_k dx_k[t] (each expert's input gradient
  // for its row w[t,k]·dy[t]), dw [N, K] fp32 (overwritten) = dy[t] · expert_{i(t,k)}(h[t]) (0 where
  // dropped); the experts' weight gradients accumulate.
  virtual void routed_backward(Model& m, int l, const Tensor& dh, const Tensor& dw, const Tensor& dy,
                               const std::vector<int64_t>& counts, LayerActs& a);

  // Runs n consecutive experts e0.. over rows x (counts[i] rows of expert e0 + i): saves g, u,
  // act in `a`, writes out [rows, D]. The piece 01 and 07 share.
  void run_experts(Model& m, int l, int e0, const std::vector<int64_t>& counts, const Tensor& x, const Tensor& out,
                   LayerActs& a);
  void run_experts_backward(Model& m, int l, int e0, const std::vector<int64_t>& counts, const Tensor& x,
                            const Tensor& dout, const Tensor& dx, LayerActs& a);

  // After the optimizer step: each layer's bias moved by the step's loads [L, E] (summed over
  // every rank that routes); master: the optimizer's fp32 copy of the flat buffer (undefined: none).
  void update_bias(Model& m, const std::vector<int64_t>& loads, const Tensor& master);

  MoeStats stats;  // accumulated by backward (which runs once per micro-batch, recompute or not)
  // The layer's saved state (LayerActs::mlp_state) as what this block's forward made it.
  template <class A = MoeActs> static A& acts(LayerActs& a) { return static_cast<A&>(*a.mlp_state); }
  template <class A = MoeActs> static const A& acts(const LayerActs& a) { return static_cast<const A&>(*a.mlp_state); }

 protected:
  // The state forward starts each layer's micro-batch with: MoeActs here, a subclass's own extension.
  virtual std::shared_ptr<MoeActs> new_acts() const { return std::make_shared<MoeActs>(); }
  bool keeps_input_ = true;  // the local experts keep their grouped input rows (07 keeps what it received)
  struct Expert {
    int w1, w3, w2;  // gate, up, down
  };
  void route(Model& m, int l, const Tensor& h, const Tensor& probs, const Tensor& idx, const Tensor& w);
  void shared_forward(Model& m, int l, const Tensor& y, const Tensor& h, LayerActs& a);
  void shared_backward(Model& m, int l, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a);
  std::vector<int> gate_, bias_;           // [L] router entries, routing biases (sigmoid router)
  std::vector<SwiGluWeights> shared_;      // [L] shared experts (--shared-experts)
  std::vector<std::vector<Expert>> exp_;   // [L][E]
};

// The step's routing statistics are summed over the ranks and reset by moe_step_report
// (training/train.h).
}  // namespace ts
