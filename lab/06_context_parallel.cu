// lab/06_context_parallel.cu — the lab's entry points 06's main calls (declared in
// 06_context_parallel.cu): the plan every run prints first, the reports at its end (the cp and
// dp_cp bytes against their predictions, each rank's attention work) and the step time it predicts.
#include <algorithm>
#include <string>
#include <vector>

#include "../06_context_parallel.cu"
#include "comm/watchdog.h"
#include "training/program.h"
#include "06_context_parallel.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "formats/json.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace cp {

void print_plan(RunLog& log, const RunConfig& rc, int C, const Options& o) {
  const MemoryPrediction p = predict_memory(rc, C);
  const ModelConfig& m = rc.model;
  print_model(log, m);
  log.line("cp %d, %s, %s: %d of %d tokens per sequence per rank", C, mode_name(o.mode),
           o.zigzag ? "zigzag (2·cp chunks, rank i holds i and 2cp−1−i)" : "contiguous blocks", m.seq / C, m.seq);
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (micro-batch %d, recompute %s)",
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str(), rc.micro_batch, recompute_name(rc.recompute));
  for (auto& [op, b] : predict_comm(rc, C, o))
    if (b > 0) log.line("per-rank cp %s per step: %s", op.c_str(), human_bytes(b).c_str());
  log.line("per-rank dp_cp all_reduce per step (gradients, 2(cp-1)/cp · 4Ψ): %s",
           human_bytes(dp::predict_allreduce_bytes(rc, C)).c_str());
  std::string blocks, pairs;
  for (int r = 0; r < C && r < 16; r++) {
    const AttentionWork w = predict_work(rc, C, o, r);
    blocks += " " + std::to_string(long(w.blocks));
    char b[32];
    snprintf(b, sizeof b, " %.4g", w.pairs);
    pairs += b;
  }
  log.line("attention work per step, rank 0..%d: blocks%s; score pairs%s", std::min(C, 16) - 1, blocks.c_str(),
           pairs.c_str());
}

// Every rank's measured work per step, next to the prediction (a metric: MPI directly, uncounted).
static Json work_report(RunLog& log, Mesh& mesh, const AttentionWork& w, long steps, const RunConfig& rc,
                        const Options& o) {
  const int C = mesh.cfg.cp;
  const double n = double(std::max(1L, steps)), mine[2] = {w.blocks / n, w.pairs / n};
  std::vector<double> all(2 * size_t(C));
  watched_allgather(mine, 2, MPI_DOUBLE, all.data(), mesh.cp().mpi(), "all_gather (the attention work report)");
  Json blocks = Json::array(), pairs = Json::array(), pred = Json::array();
  for (int r = 0; r < C; r++) {
    const AttentionWork p = predict_work(rc, C, o, r);
    blocks.push_back(all[2 * r]);
    pairs.push_back(all[2 * r + 1]);
    pred.push_back(p.pairs);
    log.line("attention work rank %d per step: %5.0f blocks, %.6g score pairs (predicted %.6g)", r, all[2 * r],
             all[2 * r + 1], p.pairs);
  }
  Json j = Json::object();
  j["blocks"] = std::move(blocks);
  j["pairs"] = std::move(pairs);
  j["predicted_pairs"] = std::move(pred);
  return j;
}

// The loop's predictions and reports: memory at T/cp tokens per rank; the cp group's bytes against
// predict_comm and the dp_cp all-reduce's against 02's; each rank's attention work.
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, const Options& o,
                 const std::function<AttentionWork()>& work, long first) {
  const int C = mesh.cfg.cp;
  loop.predicted = predict_memory(rc, C);
  loop.predicted.comm_also_holds(comm_holds(o, C));
  loop.comm = [&, C](long steps_run) {
    Json c = comm_report(log, mesh.cp(), steps_run, predict_comm(rc, C, o));
    Json d = comm_report(log, mesh.dp_cp(), steps_run, {{"all_reduce", dp::predict_allreduce_bytes(rc, C)}});
    c["dp_cp"] = d.at("dp_cp");
    return c;
  };
  loop.extra = [&, first](Json& s) { s["attention_work"] = work_report(log, mesh, work(), rc.steps - first, rc, o); };
}

// This run's step as predict_step_time prices it on a calibration's GPU (TrainingRun::train arms it).
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int C, const Options& o, double bucket_mb) {
  return [&rc, C, o, bucket_mb](const Gpu& g) { return predict_step_time(g, rc, C, o, bucket_mb); };
}

}  // namespace cp
