// lab/07a_two_level_dispatch.h — the two-level dispatch's lab (07a_two_level_dispatch.cu): its bytes
// per level predicted under balanced routing, its MoE term's levels, and the report of what a run
// moved per level against both. 08's planner prices --dispatch two-level with it.
#ifndef TS_LAB_07A_TWO_LEVEL_DISPATCH_H
#define TS_LAB_07A_TWO_LEVEL_DISPATCH_H
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "../07a_two_level_dispatch.cu"
#include "07_expert_parallel.h"
#include "training/report.h"
#include "training/step_time.h"

namespace ep {
using namespace ts;

// The nodes a token's K rows reach under balanced routing over Nn nodes: where the routing's groups
// are the nodes (--expert-groups = Nn, as 07's two-level dispatch requires) min(M, K, Nn), M the
// --group-limit; otherwise K experts drawn uniformly reach Nn·(1 − (1 − 1/Nn)^K) of them.
inline double nodes_per_token(const ModelConfig& m, int Nn) {
  if (m.expert_groups == Nn) return std::min({double(m.group_limit), double(m.top_k), double(Nn)});
  return Nn * (1 - std::pow(1 - 1.0 / Nn, m.top_k));
}

// Balanced routing over Nn nodes of Q ep ranks, per step and rank, of the two levels' bytes: of a
// micro-batch's N tokens each reaches r nodes (nodes_per_token), (Nn−1)/Nn of them others, so
// U = N·r·(Nn−1)/Nn copies go out and as many come in. Across nodes, forward: U·(row + 8K) (each
// copy with its K ids and K gate weights), U rows back (the combine's partial sums), one int to
// each other node; backward: U dy rows out, U dh rows and U·K dw floats back.
// Inside the node an entry fans out N·K pairs, (Q−1)/Q of them to other ranks, and as many come
// back, forward and backward; plus per·Nn ints to each other rank. Full recompute repeats the forward.
inline std::pair<double, double> predict_two_level_bytes(const RunConfig& rc, int dp, int ep, int Nn) {
  const ModelConfig& m = rc.model;
  const double N = double(rc.micro_batch) * m.seq, K = m.top_k, row = m.dim * dtype_size(rc.dtype), Q = double(ep) / Nn;
  const double f = (Nn - 1.0) / Nn, r = nodes_per_token(m, Nn), fwd = 1 + (rc.recompute == Recompute::Full);
  const double U = N * r * f, fan = N * K * (Q - 1) / Q;
  const double inter = fwd * (U * (row + 8 * K) + U * row + (Nn - 1) * 4) + U * row + U * (row + 4 * K);
  const double intra = fwd * (2 * fan * row + (Q - 1) * (m.experts / ep) * Nn * 4) + 2 * fan * row;
  const double steps = double(rc.batch / dp) / rc.micro_batch * m.layers;
  return {steps * inter, steps * intra};
}

// 07's two-level dispatch as the MoE term's levels: across the Nn nodes (the rail) and inside one
// (NVLink), each with a dispatch and a combine per layer and micro-batch, forward and backward.
inline std::vector<DispatchLevel> two_level_dispatch(const RunConfig& rc, int dp, int ep, int Nn, double micro_batches) {
  const auto [inter, intra] = predict_two_level_bytes(rc, dp, ep, Nn);
  const double calls = all_to_all_calls(micro_batches, rc.model.layers);
  return {{inter, calls, Nn}, {intra, calls, 1}};
}

// This run's counts per step (rank 0's) next to the balanced prediction and to what the flat
// dispatch would send across nodes for the same routing: every (token, expert) row, both ways.
inline void print_levels(RunLog& log, const LevelCounts& c, double n, const RunConfig& rc) {
  const double row = rc.model.dim * dtype_size(rc.dtype);
  log.line("ep two-level (this run's routing, rank 0, per step): across nodes %.0f token copies out, %.0f in, one row "
           "each on every hop (dispatch, combine, and both backward): %s",
           c.copies / n, c.copies_in / n, human_bytes(c.inter_bytes / n).c_str());
  log.line("  they stand for %.0f (token, expert) rows out and %.0f in; a flat dispatch of the same routing moves each "
           "of those across, both ways: %s of rows",
           c.pairs_out / n, c.pairs_in / n, human_bytes(2 * (c.pairs_out + c.pairs_in) / n * row).c_str());
  log.line("  inside nodes (forward and backward): %.0f rows fanned out, %.0f back: %s", c.fan_out / n, c.fan_in / n,
           human_bytes(c.intra_bytes / n).c_str());
}

// The two levels' bytes: measured by their communicators, counted from the routing, predicted.
inline void levels_report(Json& c, RunLog& log, const RunConfig& rc, Mesh& mesh, TwoLevelMoe& moe, long steps) {
  const double n = double(std::max(1L, steps));
  const auto [inter, intra] = predict_two_level_bytes(rc, mesh.cfg.dp, mesh.cfg.ep, moe.topology().nodes);
  const LevelCounts& l = moe.levels;
  for (auto [comm, predicted, routed] : {std::tuple<Comm*, double, double>{&moe.inter(), inter, l.inter_bytes / n},
                                         {&moe.intra(), intra, l.intra_bytes / n}}) {
    Json j = comm_report(log, *comm, steps, {{"all_to_all", predicted}});
    if (j.at(comm->name()).contains("all_to_all")) j[comm->name()]["all_to_all"]["from_routing"] = routed;
    c[comm->name()] = j.at(comm->name());
  }
  c["ep_inter"]["all_to_all"]["copies"] = l.copies / n;
  c["ep_inter"]["all_to_all"]["copies_in"] = l.copies_in / n;
  c["ep_inter"]["all_to_all"]["pairs_out"] = l.pairs_out / n;
  c["ep_inter"]["all_to_all"]["pairs_in"] = l.pairs_in / n;
  print_levels(log, l, n, rc);
}
}  // namespace ep
#endif  // TS_LAB_07A_TWO_LEVEL_DISPATCH_H
