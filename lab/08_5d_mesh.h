// lab/08_5d_mesh.h — chapter 08's lab: what a mesh costs each rank, predicted from 02–07's own
// formulas at this rank's share (memory: parameters, gradients, optimizer states and activations;
// bytes per group per step), and the plan a run prints before it trains. Read after
// 08_5d_mesh.cu (which it includes); the planner (lab/08_plan.h) and the tests include it; the
// entry points 08's main calls are in lab/08_5d_mesh.cu.
#ifndef TS_LAB_08_5D_MESH_H
#define TS_LAB_08_5D_MESH_H
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../08_5d_mesh.cu"
#include "02_data_parallel.h"    // dp::reduction_calls, dp::exposed_seconds (the planner's dense group)
#include "03_zero.h"             // zero::predict_memory, zero::predict_comm, zero::price_collectives
#include "04_tensor_parallel.h"  // tp::micro_batch_bytes, tp::collective_calls
#include "05_pipeline_parallel.h"  // pp::predict_stage_activations, pp::comm_holds, pp::price_pipeline
#include "06_context_parallel.h"  // cp::predict_comm, cp::collective_calls, cp::exposed_seconds
#include "07_expert_parallel.h"  // ep::param_split, ep::comm_holds
#include "model/model.h"
#include "training/config.h"
#include "training/memory_model.h"
#include "training/program.h"  // print_model
#include "training/report.h"   // human_bytes

namespace mesh5d {
using namespace ts;

// ----- predict: memory and communication per rank, from the pieces' own formulas ------------------

// The model one tp rank holds (dim, heads, kv heads over tp), at this dp rank's sequences: what
// 06's formulas see on this mesh.
inline RunConfig tp_share(const RunConfig& rc, const Plan& p) {
  RunConfig l = rc;
  l.model.dim /= p.mesh.tp;
  l.model.heads /= p.mesh.tp;
  l.model.kv_heads /= p.mesh.tp;
  l.batch = rc.batch / p.mesh.dp;  // this dp rank's sequences
  return l;
}

inline double micro_batches_per_rank(const RunConfig& rc, const Plan& p) {
  return double(rc.batch) / p.mesh.dp / rc.micro_batch;
}

// The two largest units of table t, summed (elements).
inline double largest_two_units(const ParamTable& t) {
  std::vector<double> sizes;
  for (int u = 0; u < t.num_units(); u++) sizes.push_back(zero::unit_size(t, u));
  std::sort(sizes.begin(), sizes.end(), std::greater<double>());
  return sizes[0] + sizes[1];
}

// What the rank with table `t` (local_table) holds besides activations: parameters, gradients and
// optimizer states, whole (02) or ZeRO's shards and unit buffers (03). The micro-batch and the
// recomputation do not change it (the planner shares it between the meshes that differ in those).
inline MemoryPrediction predict_states(const RunConfig& rc, const Plan& p, const ParamTable& t) {
  MemoryPrediction m;
  if (p.zero == 0) {
    const int64_t psi = local_param_count(t);
    m = predict_states(psi, psi, rc.dtype, rc.master_weights);
  } else {
    // 03's two unit buffers in flight: consecutive units in one backward; under a pipeline any two
    // the stage holds (a chunk's last unit is in flight while the next action's first runs).
    m = zero::predict_memory(rc, {p.zero, shard_group_size(p), int(micro_batches_per_rank(rc, p)), p.prefetch, t,
                                  dense_group_size(p) / shard_group_size(p)},
                             p.mesh.pp > 1 ? largest_two_units(t) : zero::largest_consecutive_pair(t));
  }
  return m;
}
// For the rank at pipeline stage pp_rank (rank 0's, stage 0, is the one every run reports), from
// its predict_states; `pl`: the pipeline's schedule (pp > 1), `pl_holds` its pp::comm_holds. The
// planner passes the states and schedule it shares between meshes.
inline MemoryPrediction predict_memory(const RunConfig& rc, const Plan& p, int pp_rank, const pp::Plan* pl,
                                       const std::string& pl_holds, MemoryPrediction m) {
  const ModelConfig local = cp::local_model(rc.model, p.mesh.cp);
  if (pl)
    m.activations = pp::predict_stage_activations(*pl, pp_rank, local, rc.micro_batch, rc.dtype, rc.recompute,
                                                  p.mesh.tp, p.sp);
  else  // --overlap-a2a (07b): a pair of micro-batches alive at once
    m.activations = predict_activations(local, rc.micro_batch, rc.dtype, rc.recompute, p.mesh.tp, p.sp) *
                    (p.ep_schedule ? p.ep_schedule->live_microbatches : 1);
  m.comm_also_holds(pl_holds);
  m.comm_also_holds(cp::comm_holds(p.cp, p.mesh.cp));
  m.comm_also_holds(ep::comm_holds(p.mesh.ep));
  return m;
}
inline MemoryPrediction predict_memory(const RunConfig& rc, const Plan& p, int pp_rank = 0) {
  const MemoryPrediction states = predict_states(rc, p, local_table(rc, p, 0, pp_rank));
  if (p.mesh.pp == 1) return predict_memory(rc, p, pp_rank, nullptr, "", states);
  const pp::Plan pl = pipeline_plan(rc, p);
  return predict_memory(rc, p, pp_rank, &pl, pp::comm_holds(pl), states);
}

// The name of the dense group on the mesh: dp, or dp_cp when cp ranks join it.
inline std::string dense_group_name(const Plan& p) { return p.mesh.cp > 1 ? "dp_cp" : "dp"; }

// 04's bytes at this rank's share, piece by piece (tp::micro_batch_bytes): its dp rank's
// micro-batches at s/cp tokens through its stage's layers, the embedding on the first stage and
// the head on the last. Under SP the norm gradients are reduced once per step, or every
// micro-batch where ZeRO-2/3 reduce-scatters each unit's gradients as they finish (Composed).
inline std::map<std::string, double> tp_bytes(const RunConfig& rc, const Plan& p, int pp_rank) {
  const RunConfig l = local_run(rc, p);
  const double mbs = micro_batches_per_rank(rc, p), norm_reductions = p.zero >= 2 ? mbs : 1;
  const std::pair<tp::Piece, double> pieces[] = {{tp::Piece::Layer, stage_layers(rc, p, pp_rank)},
                                                 {tp::Piece::Embedding, pp_rank == 0 ? 1 : 0},
                                                 {tp::Piece::Head, holds_head(p, pp_rank) ? 1 : 0}};
  std::map<std::string, double> c;
  for (const auto& [piece, n] : pieces) {
    for (const auto& [op, b] : tp::micro_batch_bytes(l, p.mesh.tp, p.sp, piece)) c[op] += mbs * n * b;
    if (p.sp) c["all_reduce"] += n * norm_reductions * tp::norm_grad_bytes(l.model, p.mesh.tp, piece);
  }
  return c;
}

// Wire bytes per rank per step, per group: tp from 04's pieces at this rank's share (tp_bytes),
// cp from 06's at this tp rank's heads, the dense group from 02's all-reduce or 03's
// reduce-scatter/all-gather over the tp-local Ψ. With --ep, 07's: the dense group reduces
// the dense Ψ only, ep_dp this rank's experts, and ep's all-to-alls are predicted for balanced
// routing (a run reports them from its own routing counts instead).
// A pipeline stage's share: its layers, the embedding on the first, the head on the last.
// `table`: the rank's local_table where the caller holds it (nullptr: built here); `pl`: likewise
// its pipeline_plan, which DualPipeV's sends are counted off.
inline std::map<std::string, std::map<std::string, double>> predict_comm(const RunConfig& rc, const Plan& p,
                                                                         int pp_rank = 0,
                                                                         const ParamTable* table = nullptr,
                                                                         const pp::Plan* pl = nullptr) {
  const double mbs = micro_batches_per_rank(rc, p);
  const int P = p.mesh.pp, layers = stage_layers(rc, p, pp_rank);
  std::map<std::string, std::map<std::string, double>> c;
  if (p.mesh.tp > 1) c["tp"] = tp_bytes(rc, p, pp_rank);
  if (p.mesh.cp > 1) {
    RunConfig stage = tp_share(rc, p);
    stage.model.layers = layers;
    c["cp"] = cp::predict_comm(stage, p.mesh.cp, p.cp);
  }
  if (P > 1 && p.schedule == pp::kDualPipeV) {  // the V: the ranks at its ends send half (05)
    const pp::Plan built_pl = pl ? pp::Plan{} : pipeline_plan(rc, p);
    c["pp"] = {{"send", pp::predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl ? *pl : built_pl, pp_rank,
                                               token_share(p))},
               {"recv", 0.0}};
  } else if (P > 1) {  // m micro-batches of this dp rank through V chunks (pipeline_plan's m and V)
    const int m = rc.batch / p.mesh.dp / rc.micro_batch;
    c["pp"] = {{"send", pp::predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, P, m, p.virtual_stages, pp_rank,
                                               token_share(p))},
               {"recv", 0.0}};
  }
  const int n = dense_group_size(p), E = p.mesh.ep;
  const ParamTable built = table ? ParamTable{} : local_table(rc, p, 0, pp_rank);
  const ParamTable& t = table ? *table : built;
  const ep::ParamSplit split = ep::param_split(t);
  if (n > 1) {
    if (p.zero == 0) c[dense_group_name(p)] = {{"all_reduce", dp::allreduce_bytes(E > 1 ? split.dense : t.total, n)}};
    else if (p.dp_shard == 0) c[dense_group_name(p)] = zero::predict_comm(rc, {p.zero, n, int(mbs), p.prefetch, t});
    else {  // HSDP (03a): 03's collectives inside the shard group, the chunks' all-reduce across replicas
      const zero::ZeroPlan z{p.zero, p.dp_shard, int(mbs), p.prefetch, t, n / p.dp_shard};
      c["dp_shard"] = zero::predict_comm(rc, z);
      c["dp_replicate"] = zero::predict_replica_comm(z);
    }
  }
  if (E > 1) {
    RunConfig stage = rc;
    stage.model.layers = layers;
    c["ep"] = {{"all_to_all", ep::predict_balanced_bytes(stage, p.mesh.dp, E)}};
    if (n / E > 1) c["ep_dp"] = {{"all_reduce", dp::allreduce_bytes(split.experts, n / E)}};
  }
  return c;
}

inline void print_plan(RunLog& log, const RunConfig& rc, const Plan& p) {
  print_model(log, rc.model);
  const MemoryPrediction m = predict_memory(rc, p);
  const double mbs = micro_batches_per_rank(rc, p);
  log.line("mesh dp %d × pp %d × cp %d × tp %d%s, %s%s; %d sequences per dp rank in %g micro-batch%s of %d",
           p.mesh.dp, p.mesh.pp, p.mesh.cp, p.mesh.tp, p.sp ? " (sequence parallel)" : "",
           p.zero ? ("ZeRO-" + std::to_string(p.zero)).c_str() : "plain DP",
           p.mesh.cp > 1 ? (std::string(", ") + cp::mode_name(p.cp.mode) + (p.cp.zigzag ? " zigzag" : "")).c_str() : "",
           rc.batch / p.mesh.dp, mbs, mbs == 1 ? "" : "es", rc.micro_batch);
  if (p.mesh.ep > 1)
    log.line("ep %d (groups cut from dp × cp): per rank %d of %d experts per layer; dense gradients over %s, expert "
             "gradients over ep_dp of %d", p.mesh.ep, rc.model.experts / p.mesh.ep, rc.model.experts,
             dense_group_name(p).c_str(), dense_group_size(p) / p.mesh.ep);
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s%s", human_bytes(m.params).c_str(),
           human_bytes(m.grads).c_str(), human_bytes(m.optimizer).c_str(), human_bytes(m.activations).c_str(),
           p.mesh.ep > 1 ? " (balanced routing)" : "");
  for (auto& [group, ops] : predict_comm(rc, p))
    for (auto& [op, b] : ops) log.line("per-rank %s %s per step: %s", group.c_str(), op.c_str(), human_bytes(b).c_str());
  if (p.mesh.pp > 1) {
    const pp::SimulatedPlan pl = pp::simulate(pipeline_plan(rc, p));
    log.line("pipeline: %s, %d virtual stage(s) per rank of %s layers, m = %d; bubble simulated %.4f, formula %.4f%s",
             pp::schedule_name(pl.schedule), pl.V, pp::split_text(pl.layers).c_str(), pl.m, pl.bubble(), pp::bubble_formula(pl.schedule, pl.p, pl.m, pl.V),
             p.zero == 0 && dense_group_size(p) > 1 && p.dp_mode == "bucketed" ? "; dense gradients reduced in buckets as the last micro-batch's backward completes them" : "");
  }
}

}  // namespace mesh5d
#endif  // TS_LAB_08_5D_MESH_H
