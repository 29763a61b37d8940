// lab/03_zero.h — 03's lab: the bytes a ZeRO run sends and the step time it predicts, beside the
// chapter (03_zero.cu holds the technique and its memory formula); 08's planner prices its dense
// group with the same functions. lab/03_zero.cu holds the plan and the reports 03's main calls.
#ifndef TS_LAB_03_ZERO_H
#define TS_LAB_03_ZERO_H
#include <algorithm>
#include <map>
#include <string>

#include "../03_zero.cu"
#include "model/model.h"
#include "training/config.h"
#include "training/step_time.h"

namespace zero {
using namespace ts;

// ----- predict: memory per rank (the chapter's zero_states, and what it leaves to this file) ----------

// Unit u's elements in table t, the largest unit, and the largest sum of two consecutive units.
inline double unit_size(const ParamTable& t, int u) { return double(t.unit_begin[u + 1] - t.unit_begin[u]); }
inline double largest_unit(const ParamTable& t) {
  double largest = 0;
  for (int u = 0; u < t.num_units(); u++) largest = std::max(largest, unit_size(t, u));
  return largest;
}
inline double largest_consecutive_pair(const ParamTable& t) {
  double pair = 0;
  for (int u = 0; u + 1 < t.num_units(); u++) pair = std::max(pair, unit_size(t, u) + unit_size(t, u + 1));
  return pair;
}

// `pair`: the elements of the two unit buffers live at once (ZeRO-2/3's gradients, ZeRO-3's
// gathered weights under prefetch; without prefetch ZeRO-3 holds the largest unit gathered).
// (The chapter declares predict_memory(rc, p), lab/03_zero.cu defines it: the same with the pair
// one backward holds.)
inline MemoryPrediction predict_memory(const RunConfig& rc, const ZeroPlan& p, double pair) {
  MemoryPrediction m = zero_states(rc, p, pair, p.prefetch ? pair : largest_unit(p.table));
  m.staging = 12.0 * (double(p.table.total) / p.n);  // --async-save stages the shard it writes: fp32 weights, m and v
  m.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  if (p.stage >= 2) m.comm_also_holds("the reduce-scatter output of the unit in flight (ZeRO-2/3)");
  return m;
}

// ----- predict: communication per rank (notes/03 derives each line) ---------------------------------

// Wire bytes per rank per step, ring algorithm: reduce-scatter and all-gather each (N-1)/N·K.
inline std::map<std::string, double> predict_comm(const RunConfig& rc, const ZeroPlan& p) {
  const double f = double(p.n - 1) / p.n, e = double(dtype_size(rc.dtype)), P = double(p.table.total);
  const int L = rc.model.layers;
  const double layers = double(p.table.unit_begin[L + 1] - p.table.unit_begin[1]);
  std::map<std::string, double> c;
  // Stage 1 reduces the accumulated gradients once; stages 2/3 hold no full buffer to
  // accumulate in, so every micro-batch is reduce-scattered.
  c["reduce_scatter"] = f * 4.0 * P * (p.stage == 1 ? 1 : p.micro_batches);
  // Stages 1/2 gather the updated weights once; stage 3 gathers every unit for the forward and
  // the layers again for the backward, per micro-batch: ≈ 2Ψ + Ψ (reduce-scatter) = the playbook's 3Ψ.
  c["all_gather"] = p.stage < 3 ? f * e * P : f * e * (P + layers) * p.micro_batches;
  return c;
}

// Shards replicated over R = p.replicas groups (03a_hsdp.cu): every reduced chunk (K/n of the
// fp32 gradients) is all-reduced across its R holders, 2(R−1)/R of it on the wire per rank, once a
// step under stage 1 and once per micro-batch under stages 2/3 (as the reduce-scatter).
inline std::map<std::string, double> predict_replica_comm(const ZeroPlan& p) {
  const double R = p.replicas, chunk = 4.0 * double(p.table.total) / p.n;
  if (p.replicas < 2) return {};
  return {{"all_reduce", 2 * (R - 1) / R * chunk * (p.stage == 1 ? 1 : p.micro_batches)}};
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// Collective calls per step, for their latency, per unit: ZeRO-1 one reduce-scatter and one
// all-gather; ZeRO-2 a reduce-scatter per micro-batch and one all-gather; ZeRO-3 per micro-batch a
// reduce-scatter and two gathers (forward and backward).
inline double collective_calls(int stage, int units, double micro_batches) {
  return units * (stage == 1 ? 2 : stage == 2 ? micro_batches + 1 : 3 * micro_batches);
}

// ZeRO-3 gathers each unit before its forward and backward and prefetches the next one during the
// current one (FSDP; the playbook's ZeRO-3 overlap): the first unit's gather and what outlasts the
// compute show. Without prefetch every gather waits.
inline double zero3_exposed(double t_comm, double t_compute, int units, bool prefetch) {
  if (!prefetch) return t_comm;
  return std::max(0.0, t_comm - t_compute) + t_comm / std::max(1, units);
}

// ZeRO's terms of a step, from its predicted bytes `ops`: ZeRO-1 reduce-scatters once,
// behind the last micro-batch's backward (ZeRO-2 every micro-batch, behind each backward); the
// updated weights are gathered after the optimizer step, with nothing left to hide behind.
inline void price_collectives(StepTerms& s, const Network& net, const std::map<std::string, double>& ops, int stage,
                              int units, double micro_batches, bool prefetch, int nodes) {
  const double calls = collective_calls(stage, units, micro_batches);
  s.t_dp = group_seconds(net, ops, calls, nodes);
  if (stage == 3) {
    s.t_dp_exposed = zero3_exposed(s.t_dp, s.t_compute, units, prefetch);
    return;
  }
  const double rs = group_seconds(net, ops, calls, nodes, "reduce_scatter"), ag = group_seconds(net, ops, calls, nodes, "all_gather");
  s.t_dp_exposed = reduction_exposed(rs, stage == 1 ? s.last_backward(micro_batches) : s.backward(), 1.0 / units) + ag;
}

// HSDP's all-reduce across replicas, `calls` of them: it runs inside the backward hook that waits
// for it (Zero::reduce_replicas), so none of it is hidden.
inline void price_replicas(StepTerms& s, const Network& net, const std::map<std::string, double>& ops, double calls, int nodes) {
  const double t = group_seconds(net, ops, calls, nodes);
  s.t_dp += t, s.t_dp_exposed += t;
}

// This run's step: each of the n·R ranks computes 1/(n·R) of the tokens, then the stage's
// collectives; replicas add their all-reduce, which waits in the backward it follows (exposed).
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, const ZeroPlan& p) {
  const int dp = p.n * p.replicas;
  StepTerms s = compute_terms(g, rc, 1, 1, 1, dp);
  const double mbs = double(rc.batch) / dp / rc.micro_batch;
  price_collectives(s, g.net, p.n > 1 ? predict_comm(rc, p) : std::map<std::string, double>{}, p.stage,
                    p.table.num_units(), mbs, p.prefetch, 1);
  price_replicas(s, g.net, predict_replica_comm(p), p.table.num_units() * (p.stage == 1 ? 1 : mbs), 1);
  s.total();
  return s;
}

}  // namespace zero
#endif  // TS_LAB_03_ZERO_H
