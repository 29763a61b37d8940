// lab/06_context_parallel.h — 06's lab: the bytes a context-parallel run sends, the attention work
// each rank does and the step time it predicts, beside the chapter (06_context_parallel.cu holds
// the technique); 08's planner prices its cp group with the same functions.
// lab/06_context_parallel.cu holds the plan and the reports 06's main calls.
#ifndef TS_LAB_06_CONTEXT_PARALLEL_H
#define TS_LAB_06_CONTEXT_PARALLEL_H
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "../06_context_parallel.cu"
#include "02_data_parallel.h"  // dp::reduction_seconds: the gradients are all-reduced over cp
#include "model/model.h"
#include "training/config.h"
#include "training/step_time.h"

namespace cp {
using namespace ts;

// ----- predict: bytes and attention work per rank (notes/06 derives each line) ---------------------

// Bytes this rank sends per step on the cp group. With kv = one K (or V) block of a micro-batch,
// b·(s/cp)·kv_heads·hd·bytes, and a = one q-sized block, b·(s/cp)·h·bytes, per layer:
//   ring     forward (cp−1)·2kv (K and V, cp−1 hops); backward (cp−1)·2kv again plus (cp−1)·2kv
//            for dK/dV (cp−1 hops home);
//   ulysses  all-to-all sends (cp−1)/cp of its input: forward q, k, v and the output,
//            (cp−1)/cp·(2a + 2kv); backward dout, the output and dq, dk, dv, (cp−1)/cp·(3a + 2kv).
// Full recompute runs each layer's forward again in backward.
inline std::map<std::string, double> predict_comm(const RunConfig& rc, int C, const Options& o) {
  const ModelConfig& m = rc.model;
  const double e = dtype_size(rc.dtype), L = m.layers, mbs = double(rc.batch) / rc.micro_batch;
  const double tokens = double(rc.micro_batch) * m.seq / C, kv = tokens * m.kv_dim() * e, a = tokens * m.dim * e;
  const double fwd = rc.recompute == Recompute::Full ? 2 : 1;
  std::map<std::string, double> c;
  if (C == 1) return c;
  if (o.mode == Mode::Ring) {
    c["send"] = mbs * L * (C - 1) * (fwd * 2 * kv + 4 * kv);
    c["recv"] = 0;  // the sender counts the wire bytes
  } else {
    c["all_to_all"] = mbs * L * (C - 1.0) / C * (fwd * (2 * a + 2 * kv) + 3 * a + 2 * kv);
  }
  return c;
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// Collective calls per step: cp−1 ring steps per layer forward and as many backward (Ulysses'
// all-to-alls priced alike).
inline double collective_calls(double micro_batches, double layers, int C) { return micro_batches * layers * 2 * (C - 1); }

// The ring overlaps its K/V transfers with attention (attention_share of the compute): what
// outlasts it shows. Ulysses' all-to-alls sit between the projections and attention, exposed.
inline double exposed_seconds(Mode mode, double t_cp, double t_compute, const ModelConfig& m) {
  return mode == Mode::Ring ? std::max(0.0, t_cp - attention_share(m) * t_compute) : t_cp;
}

// This run's step: each rank computes its T/C tokens of every sequence; then the ring (or
// all-to-all), and the gradients all-reduced over the cp ranks as 02 reduces them over dp.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int C, const Options& o, double bucket_mb) {
  StepTerms s = compute_terms(g, rc, 1, C, 1, C);
  const int64_t psi = param_count(rc.model);
  const double mbs = double(rc.batch) / rc.micro_batch, grad_bytes = 4.0 * double(psi);
  const int L = rc.model.layers;
  s.t_cp = group_seconds(g.net, predict_comm(rc, C, o), collective_calls(mbs, L, C), 1);
  s.t_cp_exposed = exposed_seconds(o.mode, s.t_cp, s.t_compute, rc.model);
  s.t_dp = dp::reduction_seconds(g.net, psi, C, dp::reduction_calls(true, L, grad_bytes, bucket_mb), 1);
  s.t_dp_exposed = dp::exposed_seconds(true, s.t_dp, s.last_backward(mbs), grad_bytes, bucket_mb);
  s.total();
  return s;
}

// Attention work of rank r per step (see AttentionWork): the blocks its queries see and their
// visible pairs, times heads and sequences, for every layer forward (twice under full recompute).
inline AttentionWork predict_work(const RunConfig& rc, int C, const Options& o, int r) {
  const ModelConfig& m = rc.model;
  const double runs = double(m.layers) * (rc.batch / rc.micro_batch) * (rc.recompute == Recompute::Full ? 2 : 1);
  AttentionWork w;
  if (o.mode == Mode::Ulysses) {
    std::vector<int32_t> all;
    for (int s = 0; s < C; s++)
      for (int32_t p : positions(m.seq, C, s, o.zigzag)) all.push_back(p);
    w.blocks = runs;
    w.pairs = runs * visible_pairs(all, all) * rc.micro_batch * (m.heads / C);
    return w;
  }
  const std::vector<int32_t> mine = positions(m.seq, C, r, o.zigzag);
  for (int s = 0; s < C; s++) {
    const double p = visible_pairs(mine, positions(m.seq, C, s, o.zigzag));
    if (p > 0) w.blocks += runs, w.pairs += runs * p * rc.micro_batch * m.heads;
  }
  return w;
}

}  // namespace cp
#endif  // TS_LAB_06_CONTEXT_PARALLEL_H
