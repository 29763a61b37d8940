// lab/03_zero.cu — the lab's entry points 03's main calls (declared in 03_zero.cu): the plan every
// run prints first, the loop's evaluation, checkpoint and reports, and the step time it predicts.
#include <string>

#include "../03_zero.cu"
#include "training/program.h"
#include "03_zero.h"
#include "comm/mesh.h"
#include "formats/json.h"
#include "training/checkpoint.h"
#include "training/report.h"
#include "training/start.h"
#include "training/step_time.h"
#include "training/train.h"

namespace zero {

// A forward-only pass `f` (the held-out loss): ZeRO-3 gathers each unit as in training, in
// forward order only (0..L+1, then the next micro-batch's 0), and drops whatever is still
// gathered afterwards. Its collectives are not counted with the training steps'.
double evaluate(Zero& z, const std::function<double()>& f) {
  const auto counted = z.dp_.stats();
  z.forward_only_ = true;
  z.use_pos_ = 0;
  const double loss = f();
  for (Zero::Gathered& g : z.gathered_) {
    if (g.in_flight) g.work.wait();
    g = Zero::Gathered();
  }
  z.forward_only_ = false;
  z.dp_.set_stats(counted);
  return loss;
}

// One backward holds two consecutive units at once: the unit whose gradients are being written
// and the one above, whose reduce-scatter is in flight (or, under prefetch, the one in use and the
// one being gathered).
MemoryPrediction predict_memory(const RunConfig& rc, const ZeroPlan& p) {
  return predict_memory(rc, p, largest_consecutive_pair(p.table));
}

void print_plan(RunLog& log, const RunConfig& rc, const ZeroPlan& p) {
  const MemoryPrediction m = predict_memory(rc, p);
  print_model(log, rc.model);
  const int64_t psi = param_count(rc.model);
  log.line("ZeRO-%d over %d ranks: Ψ = %lld parameters, padded per unit to %lld (%lld padding)", p.stage, p.n,
           (long long)psi, (long long)p.table.total, (long long)(p.table.total - psi));
  if (p.replicas > 1)
    log.line("HSDP: dp %d = %d replicas × shard groups of %d ranks; each chunk all-reduced across its %d replicas",
             p.n * p.replicas, p.replicas, p.n, p.replicas);
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (micro-batch %d)",
           human_bytes(m.params).c_str(), human_bytes(m.grads).c_str(), human_bytes(m.optimizer).c_str(),
           human_bytes(m.activations).c_str(), rc.micro_batch);
  for (auto& [op, b] : predict_comm(rc, p)) log.line("per-rank %s per step: %s", op.c_str(), human_bytes(b).c_str());
  for (auto& [op, b] : predict_replica_comm(p))
    log.line("per-rank %s per step across replicas: %s", op.c_str(), human_bytes(b).c_str());
}

// The loop's evaluation, checkpoint and bytes: each rank writes its shards of the weights and
// the moments at their global offsets, and the bytes sent are checked against predict_comm.
void add_reports(Loop& loop, TrainingRun& run, Model& model, Zero& zero, const ZeroPlan& plan) {
  RunLog& log = run.log();
  const RunConfig& rc = run.rc;
  Mesh& mesh = run.mesh;
  Program& prog = run;
  loop.predicted = predict_memory(rc, plan);
  // Each rank evaluates its slice of every evaluation batch, as it trains on its slice of a step's.
  loop.eval = [&] {
    const int local = rc.batch / mesh.cfg.dp;
    return evaluate(zero, [&] { return held_out_loss(model, prog.held_out, rc, mesh.dp_rank * local, local, {mesh.dp().mpi()}); });
  };
  loop.save = [&](long step) {
    Json m = Json::object();
    m["dp"] = mesh.cfg.dp;
    m["zero"] = plan.stage;
    if (plan.replicas > 1) m["dp_shard"] = plan.n;
    save_checkpoint(rc.save_dir, rc, model.table, zero.checkpoint_slices(), step, m);
  };
  // The shard group's reduce-scatters and gathers, and the replicas' all-reduces (if any).
  loop.comm = [&](long steps_run) {
    Json c = comm_report(log, zero.group(), steps_run, predict_comm(rc, plan));
    if (Comm* r = zero.replicas()) c[r->name()] = comm_report(log, *r, steps_run, predict_replica_comm(plan))[r->name()];
    return c;
  };
}

// This run's step as predict_step_time prices it on a calibration's GPU (TrainingRun::train arms it).
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, const ZeroPlan& p) {
  return [&rc, p](const Gpu& g) { return predict_step_time(g, rc, p); };
}

}  // namespace zero
