// lab/07_expert_parallel.h — chapter 07's lab: what expert parallelism costs, predicted before a
// run and compared with what it measured. Read after 07_expert_parallel.cu (which it includes);
// 08's planner and the tests include it too. The two-level dispatch's predictions are in
// lab/07a_two_level_dispatch.h; the entry points 07's main calls in lab/07_expert_parallel.cu.
#ifndef TS_LAB_07_EXPERT_PARALLEL_H
#define TS_LAB_07_EXPERT_PARALLEL_H
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "../07_expert_parallel.cu"
#include "kernels/kernels.h"
#include "02_data_parallel.h"
#include "model/moe.h"
#include "training/memory_model.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace ep {
using namespace ts;

// ----- predict: memory and bytes per rank ----------------------------------------------------------

struct ParamSplit {
  int64_t dense, experts;  // parameters this rank holds
};
// Of any rank's table.
inline ParamSplit param_split(const ParamTable& t) {
  ParamSplit s{0, 0};
  for (const ParamEntry& e : t.entries) (is_expert_param(e) ? s.experts : s.dense) += e.numel;
  return s;
}
inline ParamSplit param_split(const RunConfig& rc, int ep) { return param_split(Model::make_table(rc.model, 1, shard_spec(ep, 0))); }

// What the memory table's comm row holds (Tag::Comm): the counts, not the rows (those are activations).
inline std::string comm_holds(int ep) { return ep > 1 ? "the per-expert row counts exchanged before each all-to-all" : ""; }

// Saved activations at the peak: one micro-batch's (predict_activations), or under a schedule that
// keeps a pair alive (07b's --overlap-a2a) the pair's. A leads B by one turn, so whenever A stands
// at its own peak (the end of its forward or its last layer's forward) B has posted its last
// layer's combine and waits there: at its last-layer moment, that layer's whole set (the combine's
// receive buffer in it) and its output allocated. The two moments are activation_moments'; the
// turns that follow hold less (notes/07's "What it costs" derives it).
inline double schedule_activations(const Schedule* s, const ModelConfig& c, int64_t b, DType dt, Recompute rc,
                                   int tp = 1, bool sp = false) {
  if (!s || s->live_microbatches < 2) return predict_activations(c, b, dt, rc, tp, sp);
  const ActivationMoments m = activation_moments(c, b, dt, rc, tp, sp);
  return std::max(m.end_of_forward, m.last_layer) + m.last_layer;
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// All-to-all calls per step: per layer a dispatch and a combine forward, and both again backward.
inline double all_to_all_calls(double micro_batches, double layers) { return micro_batches * layers * 4; }

// 07's dispatch as the MoE term's levels: one flat all-to-all over the ep group, `bytes` per rank
// and step (predict_balanced_bytes' for the layers priced), 4 calls per layer and micro-batch.
inline std::vector<DispatchLevel> flat_dispatch(double bytes, double micro_batches, double layers, int nodes) {
  return {{bytes, all_to_all_calls(micro_batches, layers), nodes}};
}

// The MoE term's shape (common/training/step_time.h) for a rank of dp that runs `layers` of the
// model's MoE layers: its tokens, the routing imbalance its experts are priced at, its dispatch.
inline MoeShape moe_shape(const RunConfig& rc, int dp, int ep, double layers, double imbalance,
                          std::vector<DispatchLevel> dispatch) {
  MoeShape x;
  x.tokens = double(rc.batch) / dp * rc.model.seq;
  x.layers = layers;
  x.ep = ep;
  x.imbalance = imbalance;
  x.dispatch = std::move(dispatch);
  return x;
}

// The routing imbalance as the step feels it, from the loads every step's report sums over the dp
// ranks (moe_tokens_per_expert, [layer][expert]): each layer's all-to-all waits for the ep rank
// whose experts received the most rows, so per step Σ_l max_p rows(l, p) / Σ_l mean_p rows(l, p),
// averaged over the steps after this process's first (the warm-up the measured median leaves
// out). With dp > ep the dp/ep groups' loads are summed first: their sum stands for each group.
struct RoutedLoads {
  RoutedLoads(const ModelConfig& m, int ep) : m(m), ep(ep) {}
  const ModelConfig& m;
  const int ep;
  double sum = 0;
  long steps = 0, seen = 0;
  // A training step that also tallies its loads.
  std::function<StepResult(long)> tally(std::function<StepResult(long)> step) {
    return [this, step](long s) {
      StepResult r = step(s);
      add(r);
      return r;
    };
  }
  void add(const StepResult& r) {
    if (seen++ == 0 || !r.extra.contains("moe_tokens_per_expert")) return;
    const auto& v = r.extra.at("moe_tokens_per_expert").as_array();
    const int E = m.experts, per = E / ep;
    double busiest = 0, balanced = 0;
    for (int l = 0; l < m.layers; l++) {
      double most = 0, all = 0;
      for (int p = 0; p < ep; p++) {
        double rows = 0;
        for (int i = 0; i < per; i++) rows += v[size_t(l * E + p * per + i)].as_double();
        most = std::max(most, rows);
        all += rows;
      }
      busiest += most;
      balanced += all / ep;
    }
    if (balanced > 0) sum += busiest / balanced, steps++;
  }
  double imbalance() const { return steps > 0 ? sum / double(steps) : kAssumedImbalance; }
};

// This run's step: the dp ranks compute 1/dp of the tokens each, the MoE blocks as the MoE term
// prices them (the busiest rank's experts at `imbalance`; the all-to-alls on the critical path);
// the dense gradients are all-reduced over dp and each expert's over the ep_dp ranks that hold
// it, bucketed as 02 does, behind the last micro-batch's backward. `levels`: the dispatch's
// all-to-alls as the MoE term's levels (empty: the flat dispatch's, flat_dispatch).
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int dp, int ep, double bucket_mb,
                                   double imbalance = kAssumedImbalance, std::vector<DispatchLevel> levels = {}) {
  StepTerms s = compute_terms(g, rc, 1, 1, 1, dp);
  const int L = rc.model.layers;
  const double mbs = double(rc.batch) / dp / rc.micro_batch;
  if (levels.empty()) levels = flat_dispatch(predict_balanced_bytes(rc, dp, ep), mbs, L, 1);
  add_moe_term(s, g, rc, moe_shape(rc, dp, ep, L, imbalance, levels));
  const ParamTable t = Model::make_table(rc.model, 1, shard_spec(ep, 0));
  const ParamSplit split = param_split(t);
  const double grad_bytes = 4.0 * double(t.total);
  const double calls = dp::reduction_calls(true, L, grad_bytes, bucket_mb);
  s.t_dp = dp::reduction_seconds(g.net, split.dense, dp, calls, 1) + dp::reduction_seconds(g.net, split.experts, dp / ep, calls, 1);
  s.t_dp_exposed = dp::exposed_seconds(true, s.t_dp, s.last_backward(mbs), grad_bytes, bucket_mb);
  s.total();
  return s;
}

// The predictions above assume balanced routing; a real router is not. Its imbalance, from this
// run's routing counts (rank 0's): the all-to-all bytes over the balanced prediction, and the most
// rows rank 0's experts received in a layer over the balanced N·K (its MoE activations grow so).
inline void print_imbalance(RunLog& log, double balanced, double routed, double busiest_rows) {
  log.line("ep routing imbalance (this run's counts, rank 0): all_to_all %s per step = %.4f × the balanced %s;",
           human_bytes(routed).c_str(), balanced > 0 ? routed / balanced : 0.0, human_bytes(balanced).c_str());
  log.line("  its experts received up to %.2f × the balanced N·K rows in one layer, so its MoE activations can exceed "
           "the balanced prediction by up to that factor", busiest_rows);
}
}  // namespace ep
#endif  // TS_LAB_07_EXPERT_PARALLEL_H
