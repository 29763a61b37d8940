// lab/02_data_parallel.cu — the lab's entry points 02's main calls (declared in 02_data_parallel.cu):
// the plan every run prints first, the reports at its end, and the step time it predicts.
#include <string>

#include "../02_data_parallel.cu"
#include "training/program.h"
#include "02_data_parallel.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "formats/json.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace dp {

// The plan every run prints first (and --dry-run alone): memory per rank and the all-reduce's bytes.
void print_plan(RunLog& log, const RunConfig& rc, int dp) {
  const MemoryPrediction p = predict_memory(rc);
  print_model(log, rc.model);
  log.line("per rank at dp %d: params %s, grads %s, optimizer %s, activations %s (micro-batch %d)", dp,
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str(), rc.micro_batch);
  log.line("all-reduce per step and rank: 2(N-1)/N · 4Ψ = %s", human_bytes(predict_allreduce_bytes(rc, dp)).c_str());
}

// The loop's reports: the memory predicted, the bytes sent against 2(N-1)/N · 4Ψ, and how much of
// the all-reduce backward hid.
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, GradReducer& reducer, Program& prog) {
  loop.predicted = predict_memory(rc);
  loop.comm = [&](long steps_run) {
    return comm_report(log, mesh.dp(), steps_run, {{"all_reduce", predict_allreduce_bytes(rc, mesh.cfg.dp)}});
  };
  loop.extra = [&](Json& s) {
    // One rank sends nothing (the all-reduce of a group of one is a no-op): no fraction to report.
    if (mesh.cfg.dp == 1) return log.line("communication hidden behind backward: nothing to hide at dp 1 (0 bytes sent)");
    // The fraction is timed on the host. With NCCL the host does not wait for the all-reduces
    // (the compute stream does), so the host's clock cannot see what the GPU overlapped.
    if (std::string(mesh.dp().transport(prog.dev)) == "nccl")
      return log.line("communication hidden behind backward: not measured with NCCL (the host does not wait for "
                      "it; see the overlap on a GPU profile, e.g. nsys)");
    s["comm_hidden_fraction"] = reducer.hidden_fraction();
    log.line("communication hidden behind backward: %.1f%%", 100 * reducer.hidden_fraction());
  };
}

// This run's step as predict_step_time prices it on a calibration's GPU (TrainingRun::train arms it).
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int dp, bool bucketed, double bucket_mb) {
  return [&rc, dp, bucketed, bucket_mb](const Gpu& g) { return predict_step_time(g, rc, dp, bucketed, bucket_mb); };
}

}  // namespace dp
