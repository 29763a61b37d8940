// lab/07_expert_parallel.cu — the entry points 07's main calls into its lab (declared in the chapter,
// "the lab"): the plan and the memory predicted before the run, the reports after it, the step-time
// prediction priced at the run's routing. Which dispatch ran decides the bytes reported and priced:
// the flat one's here, the two-level one's from lab/07a_two_level_dispatch.h.
#include <memory>

#include "../07_expert_parallel.cu"
#include "training/program.h"
#include "../07a_two_level_dispatch.cu"
#include "07_expert_parallel.h"
#include "07a_two_level_dispatch.h"
#include "training/memory_model.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace ep {

MemoryPrediction predict_memory(const RunConfig& rc, int ep, const Schedule* schedule) {
  const ParamSplit s = param_split(rc, ep);
  MemoryPrediction p = predict_states(s.dense + s.experts, s.dense + s.experts, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);  // balanced routing
  if (schedule) p.activations *= schedule->live_microbatches;  // --overlap-a2a: a pair's, both alive
  p.comm_also_holds(comm_holds(ep));
  return p;
}

void print_plan(RunLog& log, const RunConfig& rc, int dp, int ep, const Schedule* schedule) {
  const ParamSplit s = param_split(rc, ep);
  const MemoryPrediction p = predict_memory(rc, ep, schedule);
  const ModelConfig& m = rc.model;
  print_model(log, m);
  const double e = dtype_size(rc.dtype);
  log.line("dp %d, ep %d: per rank %d of %d experts per layer; expert params %s, dense params %s (replicated)", dp, ep,
           m.experts / ep, m.experts, human_bytes(e * s.experts).c_str(), human_bytes(e * s.dense).c_str());
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (balanced routing)",
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str());
  const double rows = double(rc.micro_batch) * m.seq * m.top_k;
  log.line("per layer and micro-batch: N·K = %.0f routed rows of %s; balanced, (ep-1)/ep of them cross ranks: "
           "dispatch %s + combine %s forward, the same backward",
           rows, human_bytes(m.dim * e).c_str(), human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str(),
           human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str());
  log.line("per-rank all_to_all per step (balanced): %s", human_bytes(predict_balanced_bytes(rc, dp, ep)).c_str());
}

// The loop's predicted memory (balanced routing) and its comm report: the all-to-all bytes against
// the balanced prediction and this run's routing (the flat dispatch's, or the two-level one's
// levels); both reductions' bytes.
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, ExpertParallelMoe& moe,
                 const Schedule* schedule) {
  loop.predicted = predict_memory(rc, mesh.cfg.ep, schedule);
  loop.comm = [&](long steps_run) {
    const double n = double(std::max(1L, steps_run));
    const ParamSplit split = param_split(rc, mesh.cfg.ep);
    const double balanced = predict_balanced_bytes(rc, mesh.cfg.dp, mesh.cfg.ep), routed = moe.routed_bytes / n;
    Json c = comm_report(log, mesh.ep(), steps_run, {{"all_to_all", balanced}});
    if (c.at("ep").contains("all_to_all")) {
      c["ep"]["all_to_all"]["from_routing"] = routed;
      c["ep"]["all_to_all"]["inter_node"] = moe.inter_node_bytes / n;
    }
    if (auto* two = dynamic_cast<TwoLevelMoe*>(&moe)) {
      levels_report(c, log, rc, mesh, *two, steps_run);
    } else {
      print_imbalance(log, balanced, routed, moe.busiest_rows);
      log.line("  of it across nodes (rank 0): %s per step, inside its node: %s", human_bytes(moe.inter_node_bytes / n).c_str(),
               human_bytes(routed - moe.inter_node_bytes / n).c_str());
    }
    Json d = comm_report(log, mesh.dp(), steps_run, {{"all_reduce", dp::allreduce_bytes(split.dense, mesh.cfg.dp)}});
    Json x = comm_report(log, mesh.ep_dp(), steps_run,
                         {{"all_reduce", dp::allreduce_bytes(split.experts, mesh.ep_dp().size())}});
    for (const Json* j : {&d, &x})
      for (const auto& [k, v] : j->items()) c[k] = v;
    return c;
  };
}

// The run's prediction, priced at the imbalance its routing has shown by the time it is asked
// (RoutedLoads tallies each step's loads), its dispatch flat or two-level over the ep group's nodes.
std::function<StepTerms(const Gpu&)> predictor(Loop& loop, const RunConfig& rc, int dp, int ep, double bucket_mb,
                                                const ExpertParallelMoe& moe, const Schedule* schedule) {
  auto loads = std::make_shared<RoutedLoads>(rc.model, ep);
  loop.step = loads->tally(loop.step);
  const auto* two = dynamic_cast<const TwoLevelMoe*>(&moe);
  const int nodes = two ? two->topology().nodes : 0;
  return [&rc, dp, ep, bucket_mb, loads, nodes, schedule](const Gpu& g) {
    const double mbs = double(rc.batch) / dp / rc.micro_batch;
    StepTerms s = predict_step_time(g, rc, dp, ep, bucket_mb, loads->imbalance(),
                                    nodes > 1 ? two_level_dispatch(rc, dp, ep, nodes, mbs) : std::vector<DispatchLevel>{});
    if (schedule && schedule->step_time) schedule->step_time(s);  // --overlap-a2a: the all-to-all it hides
    return s;
  };
}
}  // namespace ep

