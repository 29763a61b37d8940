// lab/04_tensor_parallel.cu — the lab's entry points 04's main calls (declared in
// 04_tensor_parallel.cu): the plan every run prints first, the bytes sent against predict_comm,
// and the step time it predicts.
#include <map>
#include <string>

#include "../04_tensor_parallel.cu"
#include "training/program.h"
#include "04_tensor_parallel.h"
#include "comm/mesh.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace tp {

void print_plan(RunLog& log, const RunConfig& rc, int tp, bool sp) {
  const MemoryPrediction p = predict_memory(rc, tp, sp);
  print_model(log, rc.model);
  const ModelConfig& m = rc.model;
  log.line("tp %d%s: per rank %d of %d heads, %d of %d kv heads, ffn %d of %d, vocab %d of %d", tp,
           sp ? " + sequence parallel" : "", m.heads / tp, m.heads, m.kv_heads / tp, m.kv_heads, m.ffn / tp, m.ffn,
           m.vocab / tp, m.vocab);
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (micro-batch %d, recompute %s)",
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str(), rc.micro_batch, recompute_name(rc.recompute));
  const double K = double(rc.micro_batch) * m.seq * m.dim * dtype_size(rc.dtype), f = (tp - 1.0) / tp;
  log.line("per layer and micro-batch: K = b·s·h·bytes = %s; %s sent per rank forward, %s backward",
           human_bytes(K).c_str(), human_bytes(4 * f * K).c_str(), human_bytes((sp ? 6 : 4) * f * K).c_str());
  for (auto& [op, b] : predict_comm(rc, tp, sp)) log.line("per-rank %s per step: %s", op.c_str(), human_bytes(b).c_str());
}

// The loop's report: the bytes the tp group sent against predict_comm (as a variant sends them).
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, int tp, bool sp, const Variant* variant) {
  std::map<std::string, double> predicted = predict_comm(rc, tp, sp);
  if (variant && variant->comm) variant->comm(predicted, rc, tp);
  loop.comm = [&log, &mesh, predicted](long n) { return comm_report(log, mesh.tp(), n, predicted); };
}

// This run's step as predict_step_time prices it on a calibration's GPU (TrainingRun::train arms it).
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int tp, bool sp) {
  return [&rc, tp, sp](const Gpu& g) { return predict_step_time(g, rc, tp, sp); };
}

}  // namespace tp
