// lab/04_tensor_parallel.h — 04's lab: the bytes a tensor-parallel run sends and the step time it
// predicts, beside the chapter (04_tensor_parallel.cu holds the technique); 08's planner prices its
// tp group with the same functions. lab/04_tensor_parallel.cu holds the plan and the report 04's
// main calls.
#ifndef TS_LAB_04_TENSOR_PARALLEL_H
#define TS_LAB_04_TENSOR_PARALLEL_H
#include <map>
#include <string>

#include "../04_tensor_parallel.cu"
#include "model/tp_ops.h"
#include "model/model.h"
#include "training/config.h"
#include "training/step_time.h"

namespace tp {
using namespace ts;

// ----- predict: communication per rank (notes/04 derives each line) ----------------------------------

// Wire bytes per rank under the ring algorithm: all-reduce 2(t−1)/t·K, all-gather and
// reduce-scatter (t−1)/t·K each, K = one [tokens, dim] activation of a micro-batch. By piece of
// the model: a decoder layer, the embedding, the head with its loss.
enum class Piece { Layer, Embedding, Head };

// One micro-batch's bytes through one piece, forward and backward.
inline std::map<std::string, double> micro_batch_bytes(const RunConfig& rc, int tp, bool sp, Piece piece) {
  const ModelConfig& m = rc.model;
  const double f = (tp - 1.0) / tp, tokens = double(rc.micro_batch) * m.seq, K = tokens * m.dim * dtype_size(rc.dtype);
  const double full = rc.recompute == Recompute::Full ? 1 : 0;  // the layer forward runs again in backward
  const double loss = piece == Piece::Head ? 2 * f * tokens * 4 * 3 : 0;  // max (N floats) + stats (2N floats)
  std::map<std::string, double> c;
  if (!sp) {
    // A layer: g after each region forward, f before it backward (g again under full recompute),
    // around attention and, where the model splits it over tp, the MLP. The embedding: its g; the
    // head: its f.
    const double regions = mlp_split_over_tp(m) ? 2 : 1;
    c["all_reduce"] = 2 * f * K * (piece == Piece::Layer ? 2 * regions + regions * full : 1) + loss;
    return c;
  }
  // A layer forward: f, g, f, g = 2 all-gathers + 2 reduce-scatters. Backward: g' and f' for each
  // region (2 + 2), plus f again to rebuild each column-parallel input (+2 all-gathers). The
  // embedding: its g and g'; the head: its f and f'.
  c["all_gather"] = f * K * (piece == Piece::Layer ? 6 + 2 * full : 1);
  c["reduce_scatter"] = f * K * (piece == Piece::Layer ? 4 + 2 * full : 1);
  c["all_reduce"] = loss;
  return c;
}

// Under sequence parallelism, one all-reduce of the fp32 gradients of a piece's norms: a layer's
// two norms, the head's final norm.
inline double norm_grad_bytes(const ModelConfig& m, int tp, Piece piece) {
  const double norms = piece == Piece::Layer ? 2 : piece == Piece::Head ? 1 : 0;
  return 2 * (tp - 1.0) / tp * norms * m.dim * 4.0;
}

// Per step: every micro-batch through the L layers, the embedding and the head; the norm
// gradients once, after the last micro-batch (reduce_norm_grads).
inline std::map<std::string, double> predict_comm(const RunConfig& rc, int tp, bool sp) {
  const double mbs = double(rc.batch) / rc.micro_batch;
  std::map<std::string, double> c;
  const std::pair<Piece, double> pieces[] = {{Piece::Layer, rc.model.layers}, {Piece::Embedding, 1}, {Piece::Head, 1}};
  for (const auto& [piece, n] : pieces) {
    for (const auto& [op, b] : micro_batch_bytes(rc, tp, sp, piece)) c[op] += mbs * n * b;
    if (sp) c["all_reduce"] += n * norm_grad_bytes(rc.model, tp, piece);
  }
  return c;
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// Collective calls per step, for their latency: per layer 2 forward (g after attention and after
// the MLP) and 2 backward (their f), each an all-gather + reduce-scatter pair under SP.
inline double collective_calls(double micro_batches, double layers, bool sp) { return micro_batches * layers * (sp ? 8 : 4); }

// This run's step: the matmuls split tp ways (smaller, so further below peak: layer_efficiency),
// and every f/g on the critical path (nothing to hide them behind).
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int tp, bool sp) {
  StepTerms s = compute_terms(g, rc, tp, 1, 1, tp);
  const double mbs = double(rc.batch) / rc.micro_batch;
  if (tp > 1) s.t_tp = group_seconds(g.net, predict_comm(rc, tp, sp), collective_calls(mbs, rc.model.layers, sp), 1);
  s.total();
  return s;
}

}  // namespace tp
#endif  // TS_LAB_04_TENSOR_PARALLEL_H
