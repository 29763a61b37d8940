// mlp_block.h — the model's MLP block, the extension point the mixture of experts swaps (model.h), and the
// SwiGLU MLP the dense block and the shared experts both run.
#pragma once
#include "model/model.h"

namespace ts {

// The MLP block (post-attention RMSNorm output h -> the residual branch) is swappable: expert
// parallelism replaces SwiGLU by a routed mixture of experts. It sees h after f and returns its
// output before g (partial sums under tensor parallelism).
struct MlpBlock {
  virtual ~MlpBlock() = default;
  // y [N, D] = MLP_layer(h); saves in `a` what backward needs (Tag::Activations), and may set
  // a.aux_loss (its gradient is the block's to add in backward).
  virtual void forward(Model& m, int layer, const Tensor& y, const Tensor& h, LayerActs& a) = 0;
  // dh [N, D] := (dy/dh)^T · dy, overwritten; the block's weight gradients accumulate through
  // Model::linear_backward (so they can be deferred).
  virtual void backward(Model& m, int layer, const Tensor& dh, const Tensor& dy, const Tensor& h, LayerActs& a) = 0;
  // Selective recompute: drops the saved tensors backward can rebuild without a matmul.
  virtual void drop_recomputable(LayerActs& a) = 0;
  // Split over tp (SwiGLU: column- then row-parallel, between f and g), or replicated over tp
  // (the MoE block, Megatron's expert tensor parallel 1: every tp rank holds the router and the
  // experts whole and runs the block on the same full tokens, so f and g do not wrap it).
  virtual bool split_over_tp() const { return true; }
};

// The SwiGLU MLP y = down(silu(gate h) * up h) over the weights of table entries `w`, through
// Model::linear (so under tp the widths are the held blocks'); saves g, u and their product. The
// dense MLP block and the mixture of experts' shared experts (moe.h) both run it.
struct SwiGluWeights {
  int gate, up, down;
};
void swiglu_mlp_forward(Model& m, const SwiGluWeights& w, const Tensor& y, const Tensor& h, Tensor& g, Tensor& u,
                        Tensor& act);
// dh [N, D] (overwritten, or added to with accumulate_dh) from dy; act is rebuilt from g and u
// when selective recompute dropped it.
void swiglu_mlp_backward(Model& m, const SwiGluWeights& w, const Tensor& dh, const Tensor& dy, const Tensor& h,
                         const Tensor& g, const Tensor& u, Tensor& act, bool accumulate_dh);

// FLOPs per token of a training step: the playbook's 6·N + 12·L·h·s, N without the embedding.

}  // namespace ts
