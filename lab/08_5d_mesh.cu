// lab/08_5d_mesh.cu — the entry points 08's main calls into its lab (declared in the chapter,
// "the lab"): the planner's flags and --plan itself (lab/08_plan.h's search and ranking), the plan
// and the memory a run predicts before it trains, the reports after it, and the step time it
// predicts on this machine (the planner's step_terms at the run's mesh).
#include <algorithm>
#include <map>
#include <memory>
#include <string>

#include "../08_5d_mesh.cu"
#include "08_5d_mesh.h"
#include "08_plan.h"
#include "comm/mesh.h"
#include "formats/json.h"
#include "training/checkpoint.h"
#include "training/config.h"
#include "training/flags.h"
#include "training/log.h"
#include "training/memory_model.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace mesh5d {

// --plan's cluster and job, and --calibration (which --plan --gpu local and a run's predicted
// step time read).
struct PlanRequest {
  Cluster cluster{nullptr, 0, 8, 8};
  PlanJob job;
  Fixed fixed;  // --plan: what the flags fix (the rest is searched)
  Calibration calibration;
  std::string gpu, network;
  double gpu_mem = 0, batch_tokens = 0;
};

// --plan's cluster and job (and --calibration, which --gpu local also reads).
void read_planner_flags(Args& a, Options& o) {
  o.planner = std::make_shared<PlanRequest>();
  PlanRequest& q = *o.planner;
  q.job.exhaustive = a.get_bool("--plan-exhaustive", "--plan: price every candidate and sort them all (the reference "
                                "the default search's pruning is tested against; slower: minutes on large clusters)");
  q.gpu = a.get_str("--gpu", "h100", "--plan: h100 | h200 | h800 | a100 | local (this machine, as make bench measured it)");
  q.calibration = read_calibration(a);  // also --plan --gpu local's
  q.gpu_mem = a.get_double("--gpu-mem", 0, "--plan: usable GiB per GPU (0: the GPU's)");
  q.network = a.get_str("--network", "", "--plan: the cluster's bus bandwidths by collective and node count (JSON, the "
                        "calibration's keys; default: the playbook's H100 table)");
  q.cluster.gpus = a.get_int("--gpus", 8, "--plan: GPUs in the cluster");
  q.cluster.per_node = a.get_int("--gpus-per-node", 8, "--plan: GPUs per node");
  q.cluster.frontier = parse_frontier(a.get_str("--frontier", "none", "--plan: price overlaps frontier stacks run and 02–07 "
                                                "do not: async-tp, a2a-overlap, dp-overlap, flash (comma-separated), all "
                                                "or none (lab/08_frontier.h)"));
  const std::string model = a.get_str("--collective-model", "nccl", "--plan: nccl (each collective at the algorithm and "
                                      "protocol NCCL's tuner picks for its size and span, lab/08_nccl_tuner.h) | flat (the "
                                      "bus-bandwidth table and one latency per call)");
  if (model != "nccl" && model != "flat") config_error("--collective-model must be nccl or flat (got '%s')", model.c_str());
  q.cluster.nccl_tuner = model == "nccl";
  q.batch_tokens = a.get_double("--global-batch-tokens", 0, "--plan: tokens per step (0: --batch × --seq, or 1M when neither is given)");
  q.job.train_tokens = a.get_double("--train-tokens", 0, "--plan: tokens to train, for days and cost (0: 20 per parameter)");
  q.job.usd_per_gpu_hour = a.get_double("--usd-per-gpu-hour", 2.0, "--plan: price of one GPU-hour, for the cost to train");
}

// --plan-exhaustive is a way of running --plan. --plan runs nothing: the cluster's GPU, the batch
// it is sized for, and no mesh unless one was given.
void set_up_plan(Args& a, RunConfig& rc, MeshConfig& mc, Options& o) {
  PlanRequest& q = *o.planner;
  if (q.job.exhaustive && !o.planning) config_error("--plan-exhaustive is a way of running --plan: pass --plan too");
  if (q.cluster.frontier.any() && !o.planning)
    config_error("--frontier prices a plan: pass --plan too (a run of 08 runs its chapters' own overlaps)");
  if (!o.planning) return;
  Cluster& cluster = q.cluster;
  const std::string& gpu = q.gpu;
  rc.dry_run = true;  // a plan runs nothing: no launch check against the job's ranks
  static Gpu local;
  if (gpu == "local") local = q.calibration.found ? q.calibration.gpu : local_gpu(q.calibration.path);
  cluster.gpu = gpu == "local" ? &local : find_gpu(gpu);
  if (!cluster.gpu) config_error("--gpu must be h100, h200, h800, a100 or local (got '%s')", gpu.c_str());
  static Gpu on_network;  // the GPU on the cluster's own network
  if (!q.network.empty()) {
    on_network = *cluster.gpu;
    on_network.net = read_network(q.network);
    cluster.gpu = &on_network;
  }
  cluster.mem_gib = q.gpu_mem > 0 ? q.gpu_mem : cluster.gpu->mem_gib;
  if (cluster.gpus < 1 || cluster.per_node < 1) config_error("--gpus and --gpus-per-node must be >= 1");
  if (!a.has("--dtype")) rc.dtype = DType::BF16;  // plans are for mixed-precision training
  q.job.default_batch = q.batch_tokens <= 0 && !a.has("--batch");
  if (q.batch_tokens > 0 || q.job.default_batch) rc.batch = int((q.job.default_batch ? kDefaultBatchTokens : q.batch_tokens) / rc.model.seq);
  if (rc.batch < 1) config_error("--global-batch-tokens %.0f is less than one sequence of %d", q.batch_tokens, rc.model.seq);
  if (!o.mesh_given) mc = MeshConfig{};  // the batch is split per candidate
  Fixed& f = q.fixed;
  auto given = [&](const char* flag, int v) { return a.has(flag) ? v : 0; };
  f.dp = given("--dp", mc.dp), f.tp = given("--tp", mc.tp), f.pp = given("--pp", mc.pp), f.cp = given("--cp", mc.cp);
  f.ep = given("--ep", mc.ep);
  f.zero = a.has("--zero") ? o.plan.zero : -1;
  f.micro_batch = given("--micro-batch", rc.micro_batch);
  f.virtual_stages = given("--virtual-stages", o.plan.virtual_stages);
  if (a.has("--schedule") && o.plan.schedule != pp::kInterleaved && !f.virtual_stages)
    f.virtual_stages = o.plan.virtual_stages;  // 1, or DualPipeV's 2
  f.recompute = a.has("--recompute") ? int(rc.recompute) : -1;
}

// --plan: every mesh within what the flags fix, ranked; a mesh given whole is checked against
// the cluster and 02–07's rules first.
int plan_cluster(RunLog& log, const RunConfig& rc, Options& o) {
  Plan& plan = o.plan;
  PlanRequest& q = *o.planner;
  const Fixed& f = q.fixed;
  if (f.dp && f.pp && f.cp && f.tp) {
    plan.sp = plan.sp || (plan.mesh.tp > 1 && rc.model.experts == 0);  // the MoE block is not composed with SP
    if (plan.mesh.dp * plan.mesh.pp * plan.mesh.cp * plan.mesh.tp != q.cluster.gpus)
      config_error("--plan: dp %d × pp %d × cp %d × tp %d is not --gpus %d", plan.mesh.dp, plan.mesh.pp, plan.mesh.cp,
                   plan.mesh.tp, q.cluster.gpus);
    validate(rc, plan, /*training=*/false);
  } else if (f.pp > 1 || (!f.pp && plan.schedule == pp::kDualPipeV)) {  // a pipeline, whatever is searched
    validate_split_backward(plan);  // the ZeRO stage given (0 when open: searched)
  }
  q.fixed.base = plan;
  return plan_only(log, rc, q.cluster, q.fixed, q.job);
}

// Which rank holds which piece (the chapter's picture, for this run: once the mesh is open), then
// the plan's predictions.
void print_run_plan(RunLog& log, const RunConfig& rc, const Options& o, const Mesh& mesh) {
  if (!rc.dry_run && (mesh.world <= 16 || o.show_mesh)) print_mesh(mesh);
  else if (!rc.dry_run) log.line("(%d ranks: --show-mesh prints the rank-to-group table)", mesh.world);
  print_plan(log, rc, o.plan);
}

// The memory of the rank at pipeline stage pp_rank (predict_memory, lab/08_5d_mesh.h).
MemoryPrediction predict_rank_memory(const RunConfig& rc, const Plan& p, int pp_rank) {
  return predict_memory(rc, p, pp_rank);
}

// The loop's checkpoint and reports: every rank writes its shard at its global offsets; each
// group's bytes against 08's predict_comm (ep's against this run's routing, as 07).
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, const Plan& plan, Composed& run) {
  loop.save = [&](long step) {
    Json m = Json::object();
    m["dp"] = plan.mesh.dp;
    m["tp"] = plan.mesh.tp;
    m["zero"] = plan.zero;
    if (plan.dp_shard) m["dp_shard"] = plan.dp_shard;
    m["cp"] = plan.mesh.cp;
    m["pp"] = plan.mesh.pp;
    m["ep"] = plan.mesh.ep;
    m["sequence_parallel"] = plan.sp;
    save_checkpoint(rc.save_dir, rc, run.model().table, run.checkpoint_slices(), step, m);
  };
  loop.comm = [&](long steps_run) {
    const auto pred = predict_comm(rc, plan);
    Json c = Json::object();
    for (Comm* g : run.groups()) {
      std::map<std::string, double> want = pred.count(g->name()) ? pred.at(g->name()) : std::map<std::string, double>{};
      // As 07: the all-to-alls from this run's own routing counts (the balanced figure is the plan's).
      if (g->name() == "ep") want["all_to_all"] = run.ep_predicted_bytes() / double(std::max(1L, steps_run));
      Json one = comm_report(log, *g, steps_run, want);
      c[g->name()] = one.at(g->name());
    }
    return c;
  };
  // Plain DP: the share of the reduction's time that ran behind compute (02's measure).
  loop.extra = [&](Json& s) {
    if (plan.zero > 0 || dense_group_size(plan) == 1) return;
    s["comm_hidden_fraction"] = run.hidden_fraction();
    log.line("dense gradients' all-reduce hidden behind backward: %.1f%%", 100 * run.hidden_fraction());
  };
}

// This run's step time on this machine, priced as the planner prices a mesh (predict_step_time,
// lab/08_plan.h) with --calibration's rates.
void predict_run_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Options& o, Device dev) {
  predict_step_time(loop, log, rc, o.plan, o.planner->calibration, dev);
}

}  // namespace mesh5d
