// tp_ops.h — tensor parallelism's extension points in the model (model.h): f and g around the
// column- and row-parallel matmuls, and the loss on the LM head's logits; what a model shape
// allows under sequence parallelism.
#pragma once
#include "model/model.h"

namespace ts {

// What a model of shape `c` builds as its MLP block, known from the shape alone (for the
// predictions and the checks made before any model exists): whether it is split over tp.
inline bool mlp_split_over_tp(const ModelConfig& c) { return c.experts == 0; }
// Sequence parallelism hands the MLP block only this tp rank's tokens. A block split over tp
// gets them all back from f's all-gather; the MoE block, whole over tp, would route only its own
// tokens. Why this shape cannot run so (a config error's text), or nullptr where it can.
inline const char* sequence_parallel_refusal(const ModelConfig& c) {
  return mlp_split_over_tp(c) ? nullptr
                              : "--sequence-parallel with --experts is not composed: each tp rank would route only its "
                                "own tokens and the expert gradients would be partial over tp";
}

// Tensor parallelism's conjugate operators around the column- and row-parallel matmuls
// (Megatron's f and g). The defaults are the identity: tp = 1.
//   f enters a column-parallel region (before q/k/v, gate/up and lm_head): forward identity,
//     backward all-reduce; under sequence parallelism all-gather forward, reduce-scatter backward.
//   g leaves a row-parallel region (after o_proj, down_proj and the vocabulary-parallel
//     embedding): forward all-reduce, backward identity; under sequence parallelism
//     reduce-scatter forward, all-gather backward.
struct TpOps {
  virtual ~TpOps() = default;
  virtual Tensor f_forward(const Tensor& x) { return x; }
  // f where its output goes only to dense linears (Model::linear: q/k/v, gate/up), which a
  // variant may fuse with it (04a_async_tp.cu gathers ring step by step inside the GEMM).
  virtual Tensor f_forward_into_linears(const Tensor& x) { return f_forward(x); }
  virtual Tensor f_backward(const Tensor& dx) { return dx; }
  // `tag`: what a new output is counted as (the embedding's becomes the saved residual stream).
  virtual Tensor g_forward(const Tensor& y, Tag tag = Tag::Workspace) { (void)tag; return y; }
  virtual Tensor g_backward(const Tensor& dy) { return dy; }
};

// The loss on the LM head's logits, swappable: tensor parallelism computes cross-entropy over a
// vocabulary split across ranks without gathering the logits.
struct LossFn {
  virtual ~LossFn() = default;
  // logits [N, V_local] (this rank's vocabulary rows from vocab_start), targets int32 [N].
  // losses [N] fp32 := the per-token loss of all N tokens; dlogits (may alias logits) :=
  // d(grad_scale · Σ losses)/dlogits for this rank's columns.
  virtual void forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                const Tensor& targets, int64_t vocab_start, float grad_scale) = 0;
};

}  // namespace ts
