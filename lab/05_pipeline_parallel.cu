// lab/05_pipeline_parallel.cu — the lab's entry points 05's main calls (declared in
// 05_pipeline_parallel.cu): the deadlock check on the simulated clock, the plan every run prints
// first, the memory it predicts, the loop's reports (the p2p bytes and each stage's memory, sends
// and bubble) and the step time predicted.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "../05_pipeline_parallel.cu"
#include "tensor/allocator.h"
#include "comm/watchdog.h"
#include "training/program.h"
#include "05_pipeline_parallel.h"
#include "05_simulator.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/threads.h"
#include "formats/json.h"
#include "training/checkpoint.h"
#include "training/report.h"
#include "training/start.h"
#include "training/step_time.h"
#include "training/train.h"

namespace pp {

MemoryPrediction predict_memory(const RunConfig& rc, const Plan& pl, int rank) {
  const int64_t psi = local_param_count(Model::make_table(rc.model, 1, shard_spec(pl, rank)));
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_stage_activations(pl, rank, rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

bool order_completes(const Plan& pl) { return simulate(pl).complete; }

void print_plan(RunLog& log, const RunConfig& rc, const Plan& plan, bool chart) {
  const SimulatedPlan pl = simulate(plan);
  print_model(log, rc.model);
  log.line("pp %d, schedule %s, %d virtual stage%s per rank, layers per virtual stage %s; m = %d micro-batch%s of %d",
           pl.p, schedule_name(pl.schedule), pl.V, pl.V > 1 ? "s" : "", split_text(pl.layers).c_str(), pl.m,
           pl.m > 1 ? "es" : "", rc.micro_batch);
  for (int s = 0; s < pl.p; s++) {
    const MemoryPrediction mp = predict_memory(rc, pl, s);
    log.line("  stage %d: params %s, grads %s, optimizer %s, activations %s; p2p sent per step %s", s,
             human_bytes(mp.params).c_str(), human_bytes(mp.grads).c_str(), human_bytes(mp.optimizer).c_str(),
             human_bytes(mp.activations).c_str(),
             human_bytes(predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, s)).c_str());
  }
  log_bubble(log, pl);
  // The default micro-batch is the whole batch (m = 1): the stages then take turns.
  const int most = pl.m * rc.micro_batch;  // micro-batches of one sequence each
  if (pl.p > 1 && pl.m < pl.p && rc.micro_batch > 1)
    log.line("hint: with m = %d the stages mostly wait for one another; split the batch with --micro-batch "
             "(--micro-batch 1 gives m = %d, bubble formula %.4f)", pl.m, most,
             bubble_formula(pl.schedule, pl.p, most, pl.V));
  if (!chart) return;
  for (const std::string& r : schedule_chart(pl)) log.line("%s", r.c_str());
  const PrintsAlso& also = prints_also()[pl.schedule];
  if (!also.chart_also) return;
  log.line("%s", also.chart_also_heading);
  for (const std::string& r : schedule_chart(also.chart_also(pl))) log.line("%s", r.c_str());
}

// The bubble a rank measures, note: where ranks share cores it also counts waits for a core.
static void note_crowded(RunLog& log, Json& r) {
  const ThreadChoice& t = thread_choice();
  const bool crowded = t.local_ranks * t.threads > t.cores;
  if (crowded)
    log.line("(bubble measured: %d ranks × %d thread%s share %d cores here, so it also counts the time a rank "
             "waits for a core; the schedule's own idle time is the simulated one)", t.local_ranks, t.threads,
             t.threads > 1 ? "s" : "", t.cores);
  r["bubble_measured_counts_core_waits"] = crowded;
}

// Per stage, gathered to rank 0 for the summary: activations measured and predicted, p2p bytes
// sent per step measured and predicted, and the idle and busy time of the pipeline phase.
static Json stage_report(RunLog& log, Mesh& mesh, const RunConfig& rc, const SimulatedPlan& pl, const Pipeline& pipe) {
  const Comm& g = mesh.pp();
  double sent = 0;
  for (auto& [op, s] : g.stats()) sent += s.wire_bytes;
  const double mine[6] = {double(mem_stats(mesh.device).peak[int(Tag::Activations)]),
                          predict_stage_activations(pl, mesh.pp_rank, rc.model, rc.micro_batch, rc.dtype, rc.recompute),
                          sent / double(std::max(1L, pipe.steps_run)),
                          predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, mesh.pp_rank),
                          pipe.span_us - pipe.busy_us, pipe.busy_us};
  std::vector<double> all(size_t(6 * pl.p));
  watched_gather(mine, 6, MPI_DOUBLE, all.data(), 0, g.mpi(), "gather (the stage report)");
  Json stages = Json::array();
  log.line("stage   activations measured / predicted      p2p sent per step measured / predicted   bubble measured");
  for (int s = 0; s < pl.p; s++) {
    const double* v = &all[size_t(6 * s)];
    Json j = Json::object();
    j["activations_measured"] = v[0];
    j["activations_predicted"] = v[1];
    j["send_bytes"] = v[2];
    j["send_predicted"] = v[3];
    j["bubble_measured"] = v[5] > 0 ? v[4] / v[5] : 0.0;
    log.line("  %d   %14s %14s            %14s %14s          %.4f", s, human_bytes(v[0]).c_str(),
             human_bytes(v[1]).c_str(), human_bytes(v[2]).c_str(), human_bytes(v[3]).c_str(),
             v[5] > 0 ? v[4] / v[5] : 0.0);
    stages.push_back(std::move(j));
  }
  log_bubble(log, pl);
  Json r = Json::object();
  note_crowded(log, r);
  r["stages"] = std::move(stages);
  r["bubble_simulated"] = pl.bubble();
  r["bubble_formula"] = bubble_formula(pl.schedule, pl.p, pl.m, pl.V);
  r["schedule"] = schedule_name(pl.schedule);
  return r;
}

// The checkpoint: every stage writes its units at their global offsets (the file is the same for
// any mesh). Stage 0's memory (the one the memory table reports) with what the comm row holds; the
// p2p bytes against predict_send_bytes; each stage's memory, sends and bubble. The pipeline counts
// the steps it ran, so the stage report divides its bytes by them.
void add_reports(Loop& loop, TrainingRun& run, Model& model, AdamW& opt, const Pipeline& pipe, const Plan& pl) {
  const RunConfig& rc = run.rc;
  RunLog& log = run.log();
  Mesh& mesh = run.mesh;
  loop.save = [&rc, &model, &opt, &pl](long step) {
    Json m = Json::object();
    m["pp"] = pl.p;
    m["schedule"] = schedule_name(pl.schedule);
    m["virtual_stages"] = pl.V;
    save_checkpoint(rc.save_dir, rc, model.table, {{0, model.table.total, weights_f32(model.params, opt), &opt}},
                    step, m);
  };
  loop.predicted = predict_memory(rc, pl, 0);
  loop.predicted.comm_also_holds(comm_holds(pl));
  loop.comm = [&rc, &log, &mesh, &pl](long n) {
    std::map<std::string, double> pred = {
        {"send", predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, 0)}, {"recv", 0.0}};
    return comm_report(log, mesh.pp(), n, pred);
  };
  loop.extra = [&rc, &log, &mesh, &pl, &pipe](Json& s) { s["pp"] = stage_report(log, mesh, rc, simulate(pl), pipe); };
}

std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, const Plan& pl) {
  return [&rc, &pl](const Gpu& g) { return predict_step_time(g, rc, pl); };
}

}  // namespace pp
