// lab/08_plan.h — the planner of `08_5d_mesh --plan`: predict a mesh's step time before booking a cluster.
//
// The playbook's first exercise, as code: for every mesh a cluster allows, memory from the very
// functions each run of 08 checks against its allocator (mesh5d::predict_memory, which calls 02–07's
// formulas), and time from the bytes each run measures (mesh5d::predict_comm; both in
// lab/08_5d_mesh.h, which this file includes, one way) priced by the step-time model of
// common/training/step_time.h, term by term with each chapter's own rule for what it hides
// (step_terms: 02's buckets, 03's stages, 04's f/g, 05's bubble, 06's ring, 07's all-to-all).
// This file adds the cluster (GPUs per node, the nodes each group spans), the search over meshes,
// the ranking and its explanations.
//
// notes/08 derives each factor, calibrates the one free constant on single-node runs, and reports
// the prediction error on the playbook's multi-node runs.
#ifndef TS_LAB_08_PLAN_H
#define TS_LAB_08_PLAN_H
#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "08_5d_mesh.h"  // the chapter, and its predictions: memory and bytes per rank
#include "kernels/kernels.h"
#include "07a_two_level_dispatch.h"  // ep::two_level_dispatch (07a's two levels, priced)
#include "08_frontier.h"             // --frontier: the overlaps frontier stacks run, priced
#include "08_nccl_tuner.h"           // each collective at the algorithm NCCL's tuner picks for it
#include "formats/json.h"
#include "training/config_flags.h"
#include "training/log.h"
#include "training/memory_model.h"
#include "training/report.h"
#include "training/step_time.h"
#include "training/train.h"

namespace mesh5d {
using namespace ts;

// The cluster and the job the planner sizes a mesh for.
struct Cluster {
  const Gpu* gpu;
  double mem_gib;  // memory per GPU (--gpu-mem overrides the table)
  int gpus, per_node;
  Frontier frontier = {};  // --frontier: what the stack overlaps beyond 02–07 (priced, not run)
  // Collectives at the algorithm and protocol NCCL's tuner picks per call (lab/08_nccl_tuner.h) on
  // the playbook's table (and the tables scaled from it); false, or another network: the table's
  // bus bandwidth and a flat latency per call. `trace` collects each group's choice (the plan's line).
  bool nccl_tuner = true;
  std::vector<TunedCall>* trace = nullptr;
};

// The network a group of `ranks` over `nodes` nodes is priced on (see Cluster::nccl_tuner).
inline Network group_network(const Cluster& cl, const std::string& group, int ranks, int nodes) {
  const Network& n = cl.gpu->net;
  if (!cl.nccl_tuner || n.source != h100_network().source) return n;
  return tuned_network(n, group, Span{ranks, nodes}, cl.per_node, cl.trace);
}

// Of the GPU's memory, the share a plan may fill: the rest is CUDA's context, NCCL's buffers,
// workspace and the caching allocator's fragmentation. The size of that rest comes from the
// playbook's 80B run on 4 nodes: 66 GB in use where the tensors this model counts come to 59 GB
// (notes/08). Plans above 90% of the share are warned about (print_warnings): that run, the one
// this close to the limit, ran at less than half the speed predicted for it.
constexpr double kMemoryHeadroom = 0.9;
inline double usable_bytes(const Cluster& c) { return c.mem_gib * kMemoryHeadroom * 1073741824.0; }

// The nodes a group spans: rank 0's group along `a` (every group of an axis spans as many).
inline int group_nodes(const Plan& p, Axis a, int per_node) {
  std::set<int> nodes;
  for (int r : mesh_group(p.mesh, 0, a)) nodes.insert(r / per_node);
  return int(nodes.size());
}
// HSDP's groups (03a_hsdp.cu: shard group = consecutive dense ranks, replicas every S-th): the
// nodes rank 0's shard group and its replica group span, {shard, replicas}.
inline std::pair<int, int> hsdp_nodes(const Plan& p, int per_node) {
  const std::vector<int> dense = mesh_group(p.mesh, 0, p.mesh.cp > 1 ? Axis::DP_CP : Axis::DP);
  std::set<int> shard, replicas;
  for (size_t i = 0; i < size_t(p.dp_shard); i++) shard.insert(dense[i] / per_node);
  for (size_t i = 0; i < dense.size(); i += size_t(p.dp_shard)) replicas.insert(dense[i] / per_node);
  return {int(shard.size()), int(replicas.size())};
}
// The HSDP shard sizes a search tries for `p`: the one --dp-shard gave, else none and, under ZeRO-3
// (where FSDP and torchtitan offer it), the dense ranks that share a node: the gathers on NVLink,
// only the all-reduce across nodes. A mesh given whole is priced as given.
inline std::vector<int> hsdp_choices(const Plan& p, int per_node) {
  const std::vector<int> dense = mesh_group(p.mesh, 0, p.mesh.cp > 1 ? Axis::DP_CP : Axis::DP);
  const int n = int(dense.size());
  if (p.dp_shard > 0) return p.zero > 0 && p.dp_shard < n && n % p.dp_shard == 0 ? std::vector<int>{p.dp_shard} : std::vector<int>{};
  int S = 0;
  while (S < n && dense[size_t(S)] / per_node == 0) S++;
  if (p.zero != 3 || S < 2 || S == n || n % S) return {0};
  return {0, S};
}

// ----- what many meshes share ----------------------------------------------------------------------------

// A search prices thousands of meshes that share their pieces: one pipeline schedule per (pp, m, V,
// schedule) serves every ZeRO stage, recompute mode and tp × cp that leave the same micro-batches;
// one parameter table per shard serves every micro-batch and recompute mode. 05's simulator and its
// rendezvous check, run once per schedule instead of once per mesh and stage, and each table built
// once, are most of what makes a search take seconds rather than minutes. Valid for one model,
// batch and set of options beside the mesh (a search's; step_terms alone makes its own).
struct Shared {
  // What the memory table's comm row holds under this schedule (pp::comm_holds, a replay of the
  // whole schedule's messages) is left out: a plan prints no memory table.
  struct Pipeline {
    pp::SimulatedPlan plan;  // on 05's simulated clock (lab/05_simulator.h)
    double bubble, busiest_share;
  };
  std::map<std::array<int, 4>, Pipeline> pipelines;  // by pp, m, V, schedule
  // The schedule places a rank's stages (round robin, or DualPipeV's V): part of a table's key.
  std::map<std::array<int, 7>, ParamTable> tables;   // by ZeRO's alignment, tp, pp, V, schedule, pp rank, ep
  std::map<std::array<int, 9>, MemoryPrediction> states;  // by the table's key, ZeRO stage, prefetch

  // The schedule of plan `p` at rc's micro-batch (pp > 1): mesh5d::pipeline_plan's.
  const Pipeline& pipeline(const RunConfig& rc, const Plan& p) {
    const std::array<int, 4> key{p.mesh.pp, rc.batch / p.mesh.dp / rc.micro_batch, p.virtual_stages, p.schedule->id};
    auto it = pipelines.find(key);
    if (it == pipelines.end()) {
      pp::SimulatedPlan pl = pp::simulate(pipeline_plan(rc, p));
      const double bubble = pl.bubble(), share = pl.busiest_share();
      it = pipelines.emplace(key, Pipeline{std::move(pl), bubble, share}).first;
    }
    return it->second;
  }
  // The table of the rank at tp rank 0, ep rank 0 and pipeline stage pp_rank: mesh5d::local_table's.
  const ParamTable& table(const RunConfig& rc, const Plan& p, int pp_rank) {
    const std::array<int, 7> key{p.zero > 0 ? shard_group_size(p) : 1, p.mesh.tp, p.mesh.pp, p.virtual_stages,
                                 p.schedule->id, pp_rank, p.mesh.ep};
    auto it = tables.find(key);
    if (it == tables.end()) it = tables.emplace(key, local_table(rc, p, 0, pp_rank)).first;
    return it->second;
  }
  // What that rank holds besides activations: mesh5d::predict_states of its table.
  const MemoryPrediction& rank_states(const RunConfig& rc, const Plan& p, int pp_rank) {
    const std::array<int, 9> key{p.zero > 0 ? shard_group_size(p) : 1, p.mesh.tp, p.mesh.pp, p.virtual_stages,
                                 p.schedule->id, pp_rank, p.mesh.ep, p.zero, p.prefetch};
    auto it = states.find(key);
    if (it == states.end()) it = states.emplace(key, predict_states(rc, p, table(rc, p, pp_rank))).first;
    return it->second;
  }
};

// ----- a candidate --------------------------------------------------------------------------------------

// A mesh's step terms (common/training/step_time.h), its memory, and what they give per GPU.
struct Candidate : StepTerms {
  Plan plan;
  int micro_batch = 1;
  Recompute recompute = Recompute::None;
  MemoryPrediction mem;
  double mem_total = 0, tokens_per_s_gpu = 0, mfu = 0;
  int mem_stage = 0;   // the pipeline stage whose memory mem is (the fullest)
  std::string reject;  // why it cannot run ("" = it fits)
};

// A MoE model's term (07's, common/training/step_time.h): every rank of an ep group routes its dp
// share of the tokens through the experts of every layer of its stage, whole on each tp rank
// (expert tensor parallel 1), at the even stage's layers (price_pipeline scales the compute to the
// busiest stage); the all-to-all is 07's flat one, the busiest stage's `ep_ops` over its layers, or
// under --dispatch two-level 07's two levels over the nodes the ep group spans.
// Routing priced balanced: kAssumedImbalance. A dense model: no MoE term.
// Under --dtype fp8 on a GPU with an FP8 rate (fp8_speedup), half the crossings in FP8 (kFp8DispatchShare).
inline MoeShape moe_shape(const Gpu& g, const RunConfig& rc, const Plan& p, double mbs,
                          const std::map<std::string, double>& ep_ops, double busiest_layers, int ep_nodes) {
  const auto a2a = ep_ops.find("all_to_all");
  const double bytes = a2a == ep_ops.end() ? 0 : a2a->second;
  RunConfig stage = rc;  // the busiest stage's layers, as predict_comm prices its flat all-to-all
  stage.model.layers = int(busiest_layers);
  MoeShape x = ep::moe_shape(rc, p.mesh.dp, p.mesh.ep, double(rc.model.layers) / p.mesh.pp, kAssumedImbalance,
                             p.two_level && ep_nodes > 1 && busiest_layers > 0
                                 ? ep::two_level_dispatch(stage, p.mesh.dp, p.mesh.ep, ep_nodes, mbs)
                                 : ep::flat_dispatch(bytes, mbs, busiest_layers, ep_nodes));
  if (fp8_speedup(g, rc) > 1)
    for (DispatchLevel& l : x.dispatch) l.bytes *= kFp8DispatchShare;
  return x;
}

// The step of plan `p` on cluster `cl`: the terms of 02–07, each group's collectives (08's
// predict_comm, from the chapters' formulas) at the bandwidth of the nodes it spans, each hidden by
// its own chapter's rule.
inline StepTerms step_terms(const RunConfig& rc, const Cluster& cl, const Plan& p, Shared& shared) {
  const Gpu& g = *cl.gpu;
  StepTerms s = compute_terms(g, rc, p.mesh.tp, p.mesh.cp, p.mesh.pp, cl.gpus);
  const Frontier& fr = cl.frontier;
  if (fr.flash) flash_attention(s, rc);
  const double mbs = micro_batches_per_rank(rc, p);
  // The busiest stage sets the pace: its layers' tp, cp and ep collectives are on the critical
  // path (price_pipeline scales the compute to it). The dense group's reduction is stage 0's: its
  // last backward ends the step.
  const int busy = busiest_stage(rc, p);
  const double layers = stage_layers(rc, p, busy);
  const ParamTable& t0 = shared.table(rc, p, 0);
  const int units = t0.num_units();
  const pp::Plan* pl = p.mesh.pp > 1 ? &shared.pipeline(rc, p).plan : nullptr;  // DualPipeV's sends are counted off it
  const auto comm = predict_comm(rc, p, busy, &shared.table(rc, p, busy), pl);
  const auto comm0 = busy == 0 ? comm : predict_comm(rc, p, 0, &t0, pl);
  auto ops = [&](const std::string& group) {
    const bool stage0 = group == dense_group_name(p) || group == "ep_dp" || group == "dp_shard" || group == "dp_replicate";
    const auto& c = stage0 ? comm0 : comm;
    const auto it = c.find(group);
    return it == c.end() ? std::map<std::string, double>{} : it->second;
  };
  auto nodes = [&](Axis a) { return group_nodes(p, a, cl.per_node); };
  auto net = [&](const std::string& group, Axis a) {
    return group_network(cl, group, int(mesh_group(p.mesh, 0, a).size()), nodes(a));
  };
  s.t_tp = group_seconds(net("tp", Axis::TP), ops("tp"), tp::collective_calls(mbs, layers, p.sp), nodes(Axis::TP));
  if (fr.async_tp && p.sp && p.mesh.tp > 1) {  // the layers' ten collectives as ring steps behind their GEMMs
    const Overlapped o = async_tp_layer(g, rc, double(rc.micro_batch) * rc.model.seq / p.mesh.cp, p.mesh.tp, nodes(Axis::TP));
    s.hidden_tp = std::min(s.t_tp, mbs * layers * (o.whole - o.exposed));
    s.t_tp -= s.hidden_tp;
  }
  s.t_cp = group_seconds(net("cp", Axis::CP), ops("cp"), cp::collective_calls(mbs, layers, p.mesh.cp), nodes(Axis::CP));
  s.t_cp_exposed = cp::exposed_seconds(p.cp.mode, s.t_cp, s.t_compute, rc.model);
  // The dense group (dp × cp) and, with experts, ep_dp: 02's buckets, or 03's stage.
  const std::string dense = dense_group_name(p);
  const int dense_nodes = nodes(p.mesh.cp > 1 ? Axis::DP_CP : Axis::DP);
  const Network dense_net = net(dense, p.mesh.cp > 1 ? Axis::DP_CP : Axis::DP);
  if (p.zero == 0) {
    const bool bucketed = p.dp_mode != "naive";
    const double grad = 4.0 * double(t0.total);  // the fp32 gradients this rank holds: what plain DP reduces
    const double calls = dp::reduction_calls(bucketed, stage_layers(rc, p, 0), grad, p.bucket_mb);
    s.t_dp = group_seconds(dense_net, ops(dense), calls, dense_nodes) +
             group_seconds(net("ep_dp", Axis::EP_DP), ops("ep_dp"), calls, nodes(Axis::EP_DP));
    s.t_dp_exposed = dp::exposed_seconds(bucketed, s.t_dp, s.last_backward(mbs), grad, p.bucket_mb);
  } else if (p.dp_shard == 0) {
    zero::price_collectives(s, dense_net, ops(dense), p.zero, units, mbs, p.prefetch, dense_nodes);
  } else {  // HSDP: 03's collectives inside the shard group, the chunks' all-reduce across replicas
    const auto [shard_nodes, replica_nodes] = hsdp_nodes(p, cl.per_node);
    const int dense_ranks = p.mesh.dp * p.mesh.cp;
    zero::price_collectives(s, group_network(cl, "dp_shard", p.dp_shard, shard_nodes), ops("dp_shard"), p.zero, units,
                            mbs, p.prefetch, shard_nodes);
    zero::price_replicas(s, group_network(cl, "dp_replicate", dense_ranks / p.dp_shard, replica_nodes), ops("dp_replicate"),
                         units * (p.zero == 1 ? 1 : mbs), replica_nodes);
  }
  if (fr.dp_overlap && p.zero < 3) {  // Megatron's overlapped reduce-scatter and gather, chunk by chunk
    const double ag = p.zero == 0 ? 0 : group_seconds(dense_net, ops(dense), zero::collective_calls(p.zero, units, mbs), dense_nodes, "all_gather");
    const double e = dp_overlap_exposed(s.t_dp_exposed - ag, ag, s.t_compute, mbs, p.mesh.pp, p.virtual_stages, units);
    s.hidden_dp = std::max(0.0, s.t_dp_exposed - e);
    s.t_dp_exposed -= s.hidden_dp;
  }
  add_moe_term(s, g, rc, moe_shape(g, rc, p, mbs, ops("ep"), layers, nodes(Axis::EP)));
  if (fr.a2a_overlap && s.t_ep > 0) s.hidden_ep = s.t_ep - overlap_all_to_all(s, g), s.t_ep -= s.hidden_ep;
  if (p.mesh.pp > 1) pp::price_pipeline(s, g.net, rc, shared.pipeline(rc, p).plan, token_share(p), mbs, nodes(Axis::PP));
  s.total();
  return s;
}
inline StepTerms step_terms(const RunConfig& rc, const Cluster& cl, const Plan& p) {
  Shared shared;
  return step_terms(rc, cl, p, shared);
}

// No step is shorter than its compute and the bubble that idles it: step_terms' t_compute (scaled
// to the busiest stage) and t_bubble at t_tp = 0, every other term adding >= 0 (the bubble is
// idle over compute, >= 0). Floating-point addition and multiplication are monotone, so this holds
// for the computed numbers too, not only for the real ones: the bound prunes exactly.
inline double step_floor(const RunConfig& rc, const Cluster& cl, const Plan& p, Shared& shared) {
  StepTerms s = compute_terms(*cl.gpu, rc, p.mesh.tp, p.mesh.cp, p.mesh.pp, cl.gpus);
  if (cl.frontier.flash) flash_attention(s, rc);
  add_moe_term(s, *cl.gpu, rc, moe_shape(*cl.gpu, rc, p, micro_batches_per_rank(rc, p), {}, 0, 1));  // step_terms' compute
  if (p.mesh.pp == 1) return s.t_compute;
  const Shared::Pipeline& pipe = shared.pipeline(rc, p);
  s.t_compute *= pipe.busiest_share;
  return s.t_compute + pipe.bubble * s.t_compute;
}

// The run a candidate is: the job's, at its micro-batch and recomputation.
inline RunConfig candidate_run(const RunConfig& base, const Candidate& c) {
  RunConfig rc = base;
  rc.micro_batch = c.micro_batch;
  rc.recompute = c.recompute;
  return rc;
}

// Memory from the same functions a run prints as "predicted": the fullest pipeline stage's
// (the first: the embedding, most micro-batches in flight; the last: head and logits; or, split
// unevenly, a middle one with a layer more), and whether it fits.
inline void predict_fit(Candidate& c, const RunConfig& base, const Cluster& cl, Shared& shared) {
  const RunConfig rc = candidate_run(base, c);
  const Plan& p = c.plan;
  const Shared::Pipeline* pipe = p.mesh.pp > 1 ? &shared.pipeline(rc, p) : nullptr;
  auto total = [](const MemoryPrediction& m) { return m.params + m.grads + m.optimizer + m.activations; };
  for (int s = 0; s < p.mesh.pp; s++) {
    const MemoryPrediction m = predict_memory(rc, p, s, pipe ? &pipe->plan : nullptr, "", shared.rank_states(rc, p, s));
    if (s == 0 || total(m) > c.mem_total) c.mem = m, c.mem_total = total(m), c.mem_stage = s;
  }
  if (c.mem_total > usable_bytes(cl))
    c.reject = "does not fit: " + human_bytes(c.mem_total) + " > " + human_bytes(usable_bytes(cl));
}

// Tokens per second per GPU at a step of `step` seconds.
inline double tokens_per_s_gpu(const RunConfig& rc, const Cluster& cl, double step) {
  return double(rc.batch) * rc.model.seq / step / double(cl.gpus);
}

// Time from step_terms, and what it gives per GPU.
inline void price(Candidate& c, const RunConfig& base, const Cluster& cl, Shared& shared) {
  const RunConfig rc = candidate_run(base, c);
  static_cast<StepTerms&>(c) = step_terms(rc, cl, c.plan, shared);
  c.tokens_per_s_gpu = tokens_per_s_gpu(rc, cl, c.step);
  c.mfu = flops_per_token_of(rc.model) * c.tokens_per_s_gpu / (cl.gpu->peak_tflops * 1e12);
}

// One mesh, its memory and its time.
inline Candidate evaluate(const RunConfig& base, const Cluster& cl, const Plan& p, int mb, Recompute r) {
  Candidate c;
  c.plan = p;
  c.micro_batch = mb;
  c.recompute = r;
  Shared shared;
  predict_fit(c, base, cl, shared);
  price(c, base, cl, shared);
  return c;
}

// ----- the search -----------------------------------------------------------------------------------------

// What the user fixed (0 or -1: open, searched): any of the mesh's axes, the ZeRO stage, the
// micro-batch, the virtual stages, the recomputation, the stage split.
struct Fixed {
  int dp = 0, tp = 0, pp = 0, cp = 0, ep = 0, zero = -1, micro_batch = 0, virtual_stages = 0, recompute = -1;
  Plan base;  // the other options as given (cp mode, schedule, buckets, --stage-layers)
  bool mesh_fixed() const { return dp || tp || pp || cp || ep; }
  // The values of one knob to search: the fixed one, or the powers of two up to `most`.
  static std::vector<int> values(int fixed, int most) {
    if (fixed > 0) return {fixed};
    std::vector<int> v;
    for (int x = 1; x <= most; x *= 2) v.push_back(x);
    return v;
  }
  bool all_fixed() const { return dp && tp && pp && cp && zero >= 0 && micro_batch && virtual_stages && recompute >= 0; }
};

// The plan of one mesh with the given options: sequence parallel with tp (not with experts),
// interleaved when V > 1, else the schedule given (1F1B by default); DualPipeV as given (V = 2).
inline Plan make_plan(const Plan& base, const MeshConfig& mesh, int zero, int V, const ModelConfig& m) {
  Plan p = base;
  p.mesh = mesh;
  p.mesh.pp_outer = base.mesh.pp_outer;  // the rank order is given, not searched
  p.zero = zero;
  p.sp = mesh.tp > 1 && m.experts == 0;
  p.virtual_stages = V;
  if (p.schedule == pp::kDualPipeV) return p;
  if (V > 1) p.schedule = pp::kInterleaved;
  else if (p.schedule == pp::kInterleaved) p.schedule = pp::kOneFOneB;
  return p;
}
// What validate() refuses that the search would otherwise reach.
inline bool composes(const Plan& p, const ModelConfig& m) {
  const std::string& split = p.stage_layers;
  if (!split.empty() && int(std::count(split.begin(), split.end(), ',')) + 1 != p.mesh.pp * p.virtual_stages) return false;
  if (p.mesh.pp > 1 && pp::splits_backward(p.schedule) && p.zero >= 2) return false;
  // DualPipeV: pp > 1, its two chunks per rank, 2·pp equal stages (pp::validate_dualpipev).
  if (p.schedule == pp::kDualPipeV && (p.mesh.pp == 1 || p.virtual_stages != 2 || m.layers % (2 * p.mesh.pp)))
    return false;
  return m.layers >= p.mesh.pp * p.virtual_stages;
}

// Every valid mesh of the cluster (within what `f` fixes): tp dividing the heads and kv heads,
// cp (ring, zigzag) dividing the sequence into 2·cp chunks, pp up to the layers (uneven stages
// where it does not divide them: 05's balanced_split), 1F1B or interleaved with 2 or 4 chunks per
// rank, dp the rest; each ZeRO stage (0–2 with pp), the micro-batches that divide the batch, each
// recompute mode; sequence parallel with tp. With experts: each ep dividing dp and the experts
// (ZeRO only at ep 1), no cp and no sequence parallelism (validate says why). Neither memory nor
// time yet: Search predicts them.
inline std::vector<Candidate> candidates(const RunConfig& rc, const Cluster& cl, const Fixed& f = {}) {
  std::vector<Candidate> all;
  const ModelConfig& m = rc.model;
  for (int tp : Fixed::values(f.tp, cl.gpus))
    for (int cpn : Fixed::values(f.cp, std::min(16, cl.gpus / tp)))
      for (int pp : Fixed::values(f.pp, std::min(m.layers, cl.gpus / (tp * cpn)))) {
        if (cl.gpus % (tp * cpn * pp) || m.heads % tp || m.kv_heads % tp || m.ffn % tp || m.vocab % tp) continue;
        // cp for long sequences only: below ~1k tokens per rank a ring's K/V transfer outlasts the
        // attention it hides behind (notes/06).
        if (m.seq % (2 * cpn) || (cpn > 1 && m.seq / cpn < 1024 && !f.cp)) continue;
        if (m.experts > 0 && cpn > 1) continue;
        const int dp = cl.gpus / (tp * cpn * pp);
        if (rc.batch % dp || (f.dp && f.dp != dp)) continue;
        for (int V : Fixed::values(f.virtual_stages, pp > 1 ? 4 : 1)) {
          if (V > 1 && pp == 1) continue;
          for (int zero = 0; zero <= (pp > 1 ? 2 : 3); zero++) {
            if (f.zero >= 0 && zero != f.zero) continue;
            for (int mb : Fixed::values(f.micro_batch, rc.batch / dp)) {
              if ((rc.batch / dp) % mb) continue;
              // m micro-batches: DualPipeV needs m >= 2·pp, interleaved a multiple of pp.
              const int m_mb = rc.batch / dp / mb;
              if (f.base.schedule == pp::kDualPipeV ? m_mb < 2 * pp : V > 1 && m_mb % pp) continue;
              for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
                if (f.recompute >= 0 && int(r) != f.recompute) continue;
                for (int ep : Fixed::values(f.ep, m.experts > 0 ? dp * cpn : 1)) {
                  if ((dp * cpn) % ep || (m.experts > 0 && m.experts % ep) || (ep > 1 && zero > 0)) continue;
                  if (dp * cpn == 1 && zero > 0) continue;
                  Plan p = make_plan(f.base, {dp, pp, cpn, tp, ep}, zero, V, m);
                  if (!composes(p, m)) continue;
                  for (int S : f.all_fixed() ? std::vector<int>{p.dp_shard} : hsdp_choices(p, cl.per_node)) {
                    p.dp_shard = S;
                    all.emplace_back();
                    all.back().plan = p, all.back().micro_batch = mb, all.back().recompute = r;
                  }
                }
              }
            }
          }
        }
      }
  return all;
}

inline std::string describe(const Candidate& c) {
  const MeshConfig& m = c.plan.mesh;
  std::string s = "dp " + std::to_string(m.dp);
  if (m.pp > 1 && c.plan.schedule == pp::kDualPipeV) s += " pp " + std::to_string(m.pp) + " dualpipev";
  else if (m.pp > 1) s += " pp " + std::to_string(m.pp) + (c.plan.virtual_stages > 1 ? "×" + std::to_string(c.plan.virtual_stages) : "");
  if (m.cp > 1) s += " cp " + std::to_string(m.cp);
  s += " tp " + std::to_string(m.tp) + (c.plan.sp ? "+sp" : "");
  if (m.ep > 1) s += " ep " + std::to_string(m.ep);
  s += c.plan.zero ? " ZeRO-" + std::to_string(c.plan.zero) : " DP";
  if (c.plan.dp_shard) s += " HSDP " + std::to_string(c.plan.mesh.dp * c.plan.mesh.cp / c.plan.dp_shard) + "×" +
                            std::to_string(c.plan.dp_shard);
  return s + ", micro-batch " + std::to_string(c.micro_batch) + ", recompute " + recompute_name(c.recompute);
}

// The axes on which `w` differs from `best`, named with both values: "tp 8 (best 2), micro-batch 4 (best 1)".
inline std::string differences(const Candidate& w, const Candidate& best) {
  std::string s;
  auto add = [&](const char* name, const std::string& a, const std::string& b) {
    if (a != b) s += (s.empty() ? "" : ", ") + std::string(name) + " " + a + " (best " + b + ")";
  };
  auto str = [](int v) { return std::to_string(v); };
  const MeshConfig &a = w.plan.mesh, &b = best.plan.mesh;
  add("dp", str(a.dp), str(b.dp));
  add("tp", str(a.tp), str(b.tp));
  add("pp", str(a.pp), str(b.pp));
  add("virtual stages", str(w.plan.virtual_stages), str(best.plan.virtual_stages));
  add("cp", str(a.cp), str(b.cp));
  add("ep", str(a.ep), str(b.ep));
  add("ZeRO", str(w.plan.zero), str(best.plan.zero));
  add("HSDP shard group", str(w.plan.dp_shard), str(best.plan.dp_shard));
  add("micro-batch", str(w.micro_batch), str(best.micro_batch));
  add("recompute", recompute_name(w.recompute), recompute_name(best.recompute));
  return s;
}

// Which part of the step `w` loses the most time in, against `best`.
inline std::string where_slower(const Candidate& w, const Candidate& best, int per_node) {
  const std::pair<double, std::string> parts[] = {
      {w.t_compute - best.t_compute, w.recompute != Recompute::None ? "recomputation's extra forward"
                                     : w.efficiency < best.efficiency ? "smaller matmuls run further below peak"
                                                                      : "more compute per GPU"},
      {w.t_tp - best.t_tp, w.plan.mesh.tp > per_node ? "tp crosses nodes: its collectives at inter-node bandwidth"
                                                     : "TP communication on the critical path"},
      {w.t_cp_exposed - best.t_cp_exposed, "the ring's K/V transfers outlast the attention they hide behind"},
      {w.t_dp_exposed - best.t_dp_exposed, "DP/ZeRO communication that backward cannot hide"},
      {w.t_bubble - best.t_bubble, "the pipeline bubble"},
      {w.t_pp - best.t_pp, "the pipeline's p2p transfers"},
      {w.t_ep - best.t_ep, "the all-to-alls of expert parallelism"}};
  const auto* worst = &parts[0];
  for (const auto& q : parts)
    if (q.first > worst->first) worst = &q;
  if (worst->first <= 0) return "less throughput per GPU";
  char b[64];
  snprintf(b, sizeof b, " (+%.3f s)", worst->first);
  return worst->second + b;
}

inline Json candidate_json(const Candidate& c) {
  Json j = Json::object();
  j["dp"] = c.plan.mesh.dp;
  j["tp"] = c.plan.mesh.tp;
  j["cp"] = c.plan.mesh.cp;
  j["pp"] = c.plan.mesh.pp;
  j["ep"] = c.plan.mesh.ep;
  if (c.plan.mesh.pp > 1) j["schedule"] = pp::schedule_name(c.plan.schedule);
  j["virtual_stages"] = c.plan.virtual_stages;
  j["bubble"] = c.bubble;
  j["zero"] = c.plan.zero;
  j["dp_shard"] = c.plan.dp_shard;
  j["sequence_parallel"] = c.plan.sp;
  j["micro_batch"] = c.micro_batch;
  j["recompute"] = recompute_name(c.recompute);
  j["memory_bytes"] = c.mem_total;
  j["matmul_efficiency"] = c.efficiency;
  j["step_s"] = c.step;
  j["tokens_per_s_per_gpu"] = c.tokens_per_s_gpu;
  j["mfu"] = c.mfu;
  j["exposed_comm_s"] = c.exposed();
  j["reject"] = c.reject;
  return j;
}

// ----- the ranking --------------------------------------------------------------------------------------

// The order of the ranking: meshes that fit first; then throughput in per-mille steps of the fastest
// (a strict order that still treats near-equal as equal); at equal speed the lower memory (room for a
// longer sequence or a larger batch); then the simpler mesh (lower ZeRO stage, less recomputation,
// less tp, cp, pp, ep; larger micro-batches: fewer kernel launches).
struct Ranking {
  double top = 1e-30;
  explicit Ranking(const std::vector<Candidate>& all) {
    for (const Candidate& c : all) top = std::max(top, c.tokens_per_s_gpu);
  }
  explicit Ranking(double fastest) : top(fastest) {}
  long level(const Candidate& c) const { return std::llround(1000.0 * c.tokens_per_s_gpu / top); }
  bool ties(const Candidate& a, const Candidate& b) const { return level(a) == level(b); }
  static bool simpler(const Candidate& a, const Candidate& b) {
    const MeshConfig &x = a.plan.mesh, &y = b.plan.mesh;
    if (a.plan.zero != b.plan.zero) return a.plan.zero < b.plan.zero;
    if (a.recompute != b.recompute) return int(a.recompute) < int(b.recompute);
    if (x.tp != y.tp) return x.tp < y.tp;
    if (x.cp != y.cp) return x.cp < y.cp;
    if (x.pp != y.pp) return x.pp < y.pp;
    if (x.ep != y.ep) return x.ep < y.ep;
    return a.micro_batch > b.micro_batch;
  }
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.reject.empty() != b.reject.empty()) return a.reject.empty();
    if (!ties(a, b)) return level(a) > level(b);
    if (a.mem_total != b.mem_total) return a.mem_total < b.mem_total;
    return simpler(a, b);
  }
};

inline void sort_ranking(std::vector<Candidate>& all) { std::stable_sort(all.begin(), all.end(), Ranking(all)); }

// The search, branch and bound on step_floor: every candidate's bound, and its memory and time
// only where they can change what the plan prints. The ranking is fitting first, then the
// per-mille level of tokens/s against the fastest of all, fitting or not (`top`), so
//  * top: candidates priced in order of their bound, until no bound is above the fastest priced;
//  * the first k a filter selects: in order of the bound too, each one's memory predicted (does
//    it fit?) and its time priced, until the bound's level falls below the k-th found — a tie on
//    level is still priced: memory and simplicity break it — if that k-th fits; if it does not,
//    any later one that fits ranks above it, so every one's memory is needed (its time not).
// What is never priced cannot rank above what is printed: the output is the exhaustive search's,
// number for number (tests/test_plan.cpp compares them; --plan-exhaustive predicts everything and
// sorts it, the reference).
using Filter = std::function<bool(const Candidate&)>;  // reads the mesh, micro-batch and recompute
class Search {
 public:
  Search(const RunConfig& rc, const Cluster& cl, const Fixed& f, bool exhaustive)
      : rc_(rc), cl_(cl), exhaustive_(exhaustive), all_(candidates(rc, cl, f)), done_(all_.size(), 0) {
    for (const Candidate& c : all_)
      bound_.push_back(tokens_per_s_gpu(rc, cl, step_floor(candidate_run(rc, c), cl, c.plan, shared_)));
    by_bound_.resize(all_.size());
    for (size_t i = 0; i < all_.size(); i++) by_bound_[i] = i;
    std::stable_sort(by_bound_.begin(), by_bound_.end(), [&](size_t a, size_t b) { return bound_[a] > bound_[b]; });
    double top = 1e-30;
    for (size_t i : by_bound_) {
      if (bound_[i] <= top && !exhaustive) break;
      top = std::max(top, priced(i).tokens_per_s_gpu);
    }
    rank_ = Ranking(top);
    if (exhaustive) {
      for (size_t i = 0; i < all_.size(); i++) fitted(i);
      sorted_ = all_;
      sort_ranking(sorted_);
    }
  }
  // Every candidate, in the order enumerated; those not yet predicted hold only their plan.
  const std::vector<Candidate>& all() const { return all_; }
  const Ranking& ranking() const { return rank_; }
  size_t priced() const { return size_t(std::count_if(done_.begin(), done_.end(), [](int d) { return d & kPriced; })); }
  // Candidate `c` of all(), its memory predicted and its time priced.
  const Candidate& predicted(const Candidate& c) {
    const size_t i = size_t(&c - all_.data());
    fitted(i);
    return priced(i);
  }
  // The least memory of any candidate.
  double least_memory() {
    double least = 0;
    for (size_t i = 0; i < all_.size(); i++) least = i == 0 ? fitted(i).mem_total : std::min(least, fitted(i).mem_total);
    return least;
  }

  // The first k candidates that `pick` selects (those that fit only, with `fitting`), in ranking order.
  std::vector<const Candidate*> first(size_t k, const Filter& pick, bool fitting = false) {
    std::vector<const Candidate*> found;
    if (k == 0) return found;
    if (exhaustive_) {
      for (const Candidate& c : sorted_)
        if (found.size() < k && pick(c) && (!fitting || c.reject.empty())) found.push_back(&c);
      return found;
    }
    // Equal in the ranking: the earlier enumerated first, as sort_ranking's stable sort leaves them.
    auto before = [&](const Candidate* a, const Candidate* b) { return rank_(*a, *b) || (!rank_(*b, *a) && a < b); };
    for (size_t i : by_bound_) {
      if (!pick(all_[i])) continue;
      const bool full = found.size() == k, level_below = full && std::llround(1000.0 * bound_[i] / rank_.top) < rank_.level(*found.back());
      if (level_below && found.back()->reject.empty()) break;  // the k-th fits: nothing later ranks above it
      const Candidate& c = fitted(i);
      if ((fitting && !c.reject.empty()) || (level_below && !c.reject.empty())) continue;
      found.insert(std::upper_bound(found.begin(), found.end(), &priced(i), before), &c);
      if (found.size() > k) found.pop_back();
    }
    return found;
  }

 private:
  static constexpr int kFitted = 1, kPriced = 2;
  const Candidate& fitted(size_t i) {
    if (!(done_[i] & kFitted)) predict_fit(all_[i], rc_, cl_, shared_), done_[i] |= kFitted;
    return all_[i];
  }
  const Candidate& priced(size_t i) {
    if (!(done_[i] & kPriced)) price(all_[i], rc_, cl_, shared_), done_[i] |= kPriced;
    return all_[i];
  }

  const RunConfig& rc_;
  const Cluster& cl_;
  bool exhaustive_;
  Shared shared_;
  std::vector<Candidate> all_, sorted_;
  std::vector<int> done_;         // per candidate: kFitted (memory predicted), kPriced (time priced)
  std::vector<double> bound_;     // per candidate: tokens/s/GPU at step_floor, >= its own
  std::vector<size_t> by_bound_;  // the candidates by bound, highest first
  Ranking rank_{1e-30};
};

// Warnings that make a ranking untrustworthy if unread: a batch too small to feed data parallelism
// (the mesh is then forced, not chosen), a plan at the edge of memory, and a pipeline that idles
// more than a fifth of its time.
constexpr double kBubbleWarning = 0.2, kMemoryWarning = 0.9;
inline void print_warnings(RunLog& log, const RunConfig& rc, const Cluster& cl, const Candidate* best, bool ranked) {
  if (ranked && rc.batch < cl.gpus)
    log.line("warning: %d sequences per step for %d GPUs: fewer than one sequence per data-parallel rank at dp %d, so "
             "dp ≤ %d and tp, cp or pp must fill the rest; raise --global-batch-tokens", rc.batch, cl.gpus, cl.gpus,
             rc.batch);
  if (best && best->reject.empty() && best->mem_total > kMemoryWarning * usable_bytes(cl))
    log.line("warning: %s is over %.0f%% of the usable %s: runs this close to the limit lose time to the allocator "
             "(the playbook's 80B on 4 nodes ran at 15%% MFU); prefer a mesh with room", human_bytes(best->mem_total).c_str(),
             100 * kMemoryWarning, human_bytes(usable_bytes(cl)).c_str());
  if (best && best->bubble > kBubbleWarning)
    log.line("warning: the pipeline bubble is %.0f%% of compute (over %.0f%%): more micro-batches (a larger batch or "
             "--micro-batch) or interleaving shrink it", 100 * best->bubble, 100 * kBubbleWarning);
}

// Days, GPU-hours and dollars to train `train_tokens` at the best candidate's throughput.
inline void print_cost(RunLog& log, const Cluster& cl, const Candidate& c, double train_tokens, bool tokens_given,
                       double usd_per_gpu_hour) {
  const double seconds = train_tokens / (c.tokens_per_s_gpu * cl.gpus), gpu_hours = seconds * cl.gpus / 3600;
  log.line("to train %.3g tokens%s: %.1f days on %d GPUs, %.0f GPU-hours, $%.0f at $%.2f per GPU-hour", train_tokens,
           tokens_given ? "" : " (20 per parameter, Chinchilla)", seconds / 86400, cl.gpus, gpu_hours,
           gpu_hours * usd_per_gpu_hour, usd_per_gpu_hour);
}

// The model as the plan names it: its preset, or, when flags changed the preset's shape, the
// shape itself with its Ψ ("126 layers, h 16384, …, Ψ = 405.9B").
inline std::string model_name(const RunConfig& rc) {
  ModelConfig p;
  const ModelConfig& m = rc.model;
  if (apply_preset(rc.preset, p) && p.dim == m.dim && p.layers == m.layers && p.heads == m.heads &&
      p.kv_heads == m.kv_heads && p.ffn == m.ffn && p.vocab == m.vocab && p.experts == m.experts &&
      (m.experts == 0 || p.top_k == m.top_k))
    return rc.preset;
  char b[200];
  snprintf(b, sizeof b, "%d layers, h %d, %d heads, %d kv heads, ffn %d, vocab %d%s, Ψ = %.1fB", m.layers, m.dim, m.heads,
           m.kv_heads, m.ffn, m.vocab,
           m.experts ? (", " + std::to_string(m.experts) + " experts top-" + std::to_string(m.top_k)).c_str() : "",
           double(param_count(m)) / 1e9);
  return b;
}

inline std::string fixed3(double x) {
  char b[32];
  snprintf(b, sizeof b, "%.3f", x);
  return b;
}

// Which algorithm each group's collectives were priced at (Cluster::nccl_tuner): one line per group
// and collective, the message of one call, the pick with its time, and the best of the other
// algorithm beside it (and, across nodes, what 02–08's --collectives two-level would take).
inline void print_collectives(RunLog& log, const RunConfig& rc, const Cluster& cl, const Candidate& c) {
  std::vector<TunedCall> trace;
  Cluster traced = cl;
  traced.trace = &trace;
  step_terms(candidate_run(rc, c), traced, c.plan);
  std::set<std::string> shown;
  double latency = 0;
  for (const TunedCall& t : trace) {
    if (!shown.insert(t.group + " " + t.op).second) continue;
    const Collective op = collective_of(t.op);
    const double beta = table_beta(cl.gpu->net, op, t.span.nodes, cl.per_node);
    std::string other;
    for (Algo a : {Algo::Ring, Algo::Tree}) {
      if (a == t.choice.algo || (a == Algo::Tree && (op != Collective::AllReduce || t.span.ranks <= 2))) continue;
      double best = 1e300;
      for (Proto p : {Proto::LL, Proto::LL128, Proto::Simple}) best = std::min(best, nccl_seconds(op, a, p, t.span, beta, t.bytes));
      other += std::string(", ") + algo_name(a) + " " + fixed3(1e3 * best) + " ms";
    }
    if (op == Collective::AllReduce && t.span.nodes > 1 && t.span.ranks % t.span.nodes == 0)
      other += ", two-level " + fixed3(1e3 * two_level_seconds(t.span, table_beta(cl.gpu->net, op, 1, cl.per_node), beta, t.bytes)) + " ms";
    log.line("  %s %s: %s a call × %.0f over %d ranks on %d node(s): %s/%s %.3f ms a call, %.3f of it latency (NCCL's "
             "pick%s)", t.group.c_str(), t.op.c_str(), human_bytes(t.bytes).c_str(), t.calls, t.span.ranks, t.span.nodes,
             algo_name(t.choice.algo), proto_name(t.choice.proto), 1e3 * t.choice.seconds, 1e3 * t.choice.latency_s,
             other.c_str());
    latency += t.calls * t.choice.latency_s;
  }
  if (!shown.empty()) log.line("  collectives' latency terms: %.3f s a step, before what each technique hides", latency);
}

// One candidate's parts.
inline void print_candidate(RunLog& log, const RunConfig& rc, const Cluster& cl, const Candidate& c) {
  log.line("plan: %s on %d × %s: %s", model_name(rc).c_str(), cl.gpus, cl.gpu->name.c_str(), describe(c).c_str());
  auto span = [&](Axis a) { return group_nodes(c.plan, a, cl.per_node); };
  log.line("  ranks %s, %d per node: a group spans dp %d, pp %d, cp %d, tp %d, ep %d node(s)", rank_order_name(c.plan.mesh),
           cl.per_node, span(Axis::DP), span(Axis::PP), span(Axis::CP), span(Axis::TP), span(Axis::EP));
  log.line("  memory per GPU %s (params %s, grads %s, optimizer %s, activations %s)%s%s", human_bytes(c.mem_total).c_str(),
           human_bytes(c.mem.params).c_str(), human_bytes(c.mem.grads).c_str(), human_bytes(c.mem.optimizer).c_str(),
           human_bytes(c.mem.activations).c_str(), c.reject.empty() ? "" : " — ", c.reject.c_str());
  log.line("  step %.3f s: compute %.3f s (matmuls at %.1f%% of peak), tp %.3f s, cp %.3f s (%.3f exposed), dp %.3f s "
           "(%.3f exposed), bubble %.3f s, pp p2p %.3f s; %.0f tok/s/GPU, MFU %.1f%%", c.step, c.t_compute,
           100 * c.efficiency, c.t_tp, c.t_cp, c.t_cp_exposed, c.t_dp, c.t_dp_exposed, c.t_bubble, c.t_pp,
           c.tokens_per_s_gpu, 100 * c.mfu);
  if (c.plan.mesh.ep > 1 && cl.frontier.a2a_overlap)
    log.line("  ep all-to-all %.3f s exposed: %s, behind the other micro-batch's compute on 112 of 132 SMs (DualPipe)",
             c.t_ep, c.moe.level_s.size() == 2 ? ("across nodes " + fixed3(c.moe.level_s[0]) + " s and inside nodes " +
                                                  fixed3(c.moe.level_s[1]) + " s at once").c_str()
                                               : (fixed3(c.moe.dispatch_s) + " s, flat").c_str());
  else if (c.plan.mesh.ep > 1 && c.moe.level_s.size() == 2)
    log.line("  ep all-to-all %.3f s = across nodes %.3f + inside nodes %.3f (07's two-level dispatch, balanced routing, "
             "one level after the other, on the critical path)", c.t_ep, c.moe.level_s[0], c.moe.level_s[1]);
  else if (c.plan.mesh.ep > 1)
    log.line("  ep all-to-all %.3f s (balanced routing, on the critical path)", c.t_ep);
  if (cl.frontier.any())
    log.line("  --frontier took off: tp %.3f s (async TP), dp %.3f s (overlapped reduce-scatter and gather), ep %.3f s "
             "(all-to-all behind the other micro-batch)%s", c.hidden_tp, c.hidden_dp, c.hidden_ep,
             cl.frontier.flash ? "; the attention core as FlashAttention-2 runs it" : "");
  print_collectives(log, rc, cl, c);
  if (c.t_moe > 0)
    log.line("  of compute, the MoE blocks %.3f s: router %.3f + experts %.3f (routing priced at %.2f × balanced) + "
             "shared experts %.3f + row copies %.3f", c.t_moe, c.moe.router_s, c.moe.experts_s, c.moe.imbalance,
             c.moe.shared_s, c.moe.copies_s);
}

// The rows the ranking prints, and the candidates the summary lists without --plan-exhaustive.
constexpr size_t kRankedShown = 8, kRankedListed = 10;

// Ranks the candidates that fit by tokens/s/GPU and says, for the best of those that differ from the
// winner on one axis, on which axes they differ and where they lose.
inline const Candidate* print_ranking(RunLog& log, const RunConfig& rc, const Cluster& cl, Search& search) {
  const Ranking& rank = search.ranking();
  log.line("%-4s %-58s %10s %12s %7s %10s %7s", "rank", "mesh", "memory", "tok/s/GPU", "MFU", "exposed", "bubble");
  const std::vector<const Candidate*> shown = search.first(kRankedShown, [](const Candidate&) { return true; }, true);
  for (size_t i = 0; i < shown.size(); i++) {
    const Candidate& c = *shown[i];
    log.line("%-4zu %-58s %10s %12.0f %6.1f%% %8.1f ms %6.1f%%", i + 1, describe(c).c_str(),
             human_bytes(c.mem_total).c_str(), c.tokens_per_s_gpu, 100 * c.mfu, 1e3 * c.exposed(), 100 * c.bubble);
  }
  const std::vector<Candidate>& all = search.all();
  if (all.empty()) {  // every factorisation broke a divisibility rule of 02–07
    log.line("no valid mesh on %d GPUs: dp must divide the %d sequences of a step, pp the %d layers, tp the %d heads "
             "and %d kv heads, cp the %d tokens of a sequence (in 2·cp chunks); change --gpus or --global-batch-tokens",
             cl.gpus, rc.batch, rc.model.layers, rc.model.heads, rc.model.kv_heads, rc.model.seq);
    return nullptr;
  }
  if (shown.empty()) {
    log.line("no mesh fits: the smallest needs %s per GPU", human_bytes(search.least_memory()).c_str());
    return nullptr;
  }
  const Candidate& best = *shown.front();
  // The first candidate in ranking order that `pick` selects, preferring one that differs from the
  // best on that axis alone, and why it ranks below.
  auto why = [&](const char* what, const Filter& pick) {
    const auto other = [&](const Candidate& c) { return &c != &best && pick(c); };
    const auto first = search.first(1, other);
    // One that differs alone counts only if it fits: the first that fits is the first of them all
    // when any fits (the ranking puts them first).
    const auto alone = search.first(1, [&](const Candidate& c) {
      return other(c) && differences(c, best).find(',') == std::string::npos;
    }, true);
    if (first.empty()) return;
    const Candidate* w = alone.empty() ? first[0] : alone[0];
    const std::string reason = !w->reject.empty() ? w->reject
                               : rank.ties(*w, best) ? "as fast; ranked below for " +
                                                           std::string(w->mem_total > best.mem_total ? "its higher memory"
                                                                                                     : "being less simple")
                                                     : where_slower(*w, best, cl.per_node);
    log.line("  %-24s %s: %.0f tok/s/GPU — %s; %s", what, describe(*w).c_str(), w->tokens_per_s_gpu,
             differences(*w, best).c_str(), reason.c_str());
  };
  log.line("best: %s; alternatives:", describe(best).c_str());
  why("plain data parallel", [](const Candidate& c) {
    return c.plan.mesh.tp == 1 && c.plan.mesh.pp == 1 && c.plan.mesh.cp == 1 && c.plan.mesh.ep == 1 && c.plan.zero == 0;
  });
  why("more tensor parallel", [&](const Candidate& c) { return c.plan.mesh.tp > best.plan.mesh.tp; });
  why("less tensor parallel", [&](const Candidate& c) { return c.plan.mesh.tp < best.plan.mesh.tp; });
  why("other ZeRO stage", [&](const Candidate& c) { return c.plan.zero != best.plan.zero; });
  why("other recomputation", [&](const Candidate& c) { return c.recompute != best.recompute; });
  why("context parallel", [&](const Candidate& c) { return c.plan.mesh.cp != best.plan.mesh.cp; });
  why("pipeline parallel", [&](const Candidate& c) { return c.plan.mesh.pp != best.plan.mesh.pp; });
  why("other expert parallel", [&](const Candidate& c) { return c.plan.mesh.ep != best.plan.mesh.ep; });
  return &best;
}

// What --plan was asked, beyond the run's flags.
struct PlanJob {
  bool default_batch = false;   // no --batch or --global-batch-tokens: kDefaultBatchTokens
  double train_tokens = 0;      // 0: 20 per parameter (Chinchilla, Hoffmann et al. 2022)
  double usd_per_gpu_hour = 2;
  bool exhaustive = false;      // --plan-exhaustive: price every candidate (Search's reference)
};
// The playbook's benchmark grid trains 1M tokens per step (sequences of 4096): the default batch.
constexpr double kDefaultBatchTokens = 1048576;

// --plan: runs nothing; ranks every valid mesh for the cluster within what `fixed` fixes (with
// the mesh given, the micro-batch, virtual stages, ZeRO stage and recomputation left open are
// searched), and prices the best; everything fixed: that one plan.
inline int plan_only(RunLog& log, const RunConfig& rc, const Cluster& cl, const Fixed& fixed, const PlanJob& job) {
  log.line("plan: %s on %d × %s (%.1f GiB usable = %.0f%% of %.0f GiB, %d per node), seq %d, %d sequences per step "
           "(%.0f tokens%s)", model_name(rc).c_str(), cl.gpus, cl.gpu->name.c_str(), usable_bytes(cl) / 1073741824.0,
           100 * kMemoryHeadroom, cl.mem_gib, cl.per_node, rc.model.seq, rc.batch, double(rc.batch) * rc.model.seq,
           job.default_batch ? "; the default: set --global-batch-tokens" : "");
  print_assumptions(log, *cl.gpu);
  if (group_network(cl, "", 2, 1).price)
    log.line("collectives: all-reduce, all-gather and reduce-scatter at the algorithm and protocol NCCL's tuner picks for "
             "each call's size, ranks and nodes (lab/08_nccl_tuner.h: tuning.cc's latencies, β from the table at its 256 MB), "
             "in place of the flat latency; sends and all-to-all as above");
  const std::string beyond = beyond_table(cl.gpu->net, (cl.gpus + cl.per_node - 1) / cl.per_node);
  if (!beyond.empty()) log.line("%s", beyond.c_str());
  Search search(rc, cl, fixed, job.exhaustive);
  const std::vector<Candidate>& all = search.all();
  const auto any = [](const Candidate&) { return true; };
  const Candidate* best = nullptr;
  if (fixed.all_fixed() && all.size() == 1) {
    best = &search.predicted(all[0]);
  } else {
    best = print_ranking(log, rc, cl, search);
  }
  if (fixed.mesh_fixed() && !all.empty()) {  // the plan priced in full: the best, or the smallest that does not fit
    const Candidate* shown = best;
    if (!shown) {  // none fits: every memory is predicted (least_memory), so the filter may read it
      const double least = search.least_memory();
      shown = search.first(1, [&](const Candidate& c) { return c.mem_total == least; })[0];
    }
    print_candidate(log, rc, cl, *shown);
  }
  print_warnings(log, rc, cl, best, !fixed.mesh_fixed());
  if (best && best->reject.empty()) {
    const double tokens = job.train_tokens > 0 ? job.train_tokens : 20.0 * double(param_count(rc.model));
    print_cost(log, cl, *best, tokens, job.train_tokens > 0, job.usd_per_gpu_hour);
  }
  // The ranking's head (--plan-exhaustive: every candidate, ranked).
  Json cands = Json::array();
  for (const Candidate* c : search.first(job.exhaustive ? all.size() : kRankedListed, any)) cands.push_back(candidate_json(*c));
  Json s = Json::object();
  s["candidates"] = std::move(cands);
  s["searched"] = double(all.size());
  s["priced"] = double(search.priced());
  log.summary(s);
  return 0;
}

// This run's step on this machine (02–07 compose their own, from the same chapter functions):
// the cluster is every rank of the run, on one node.
inline void predict_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Plan& p, const Calibration& cal,
                              Device dev) {
  const std::string dense = dense_group_name(p) + (p.zero ? " ZeRO-" + std::to_string(p.zero) : "");
  const int world = p.mesh.dp * p.mesh.pp * p.mesh.cp * p.mesh.tp;
  ts::predict_step_time(loop, log, rc, cal, dev, dense, [rc, p, world](const Gpu& g) {
    StepTerms s = step_terms(rc, Cluster{&g, g.mem_gib, world, world}, p);
    if (p.ep_schedule && p.ep_schedule->step_time) p.ep_schedule->step_time(s);  // --overlap-a2a (07b)
    return s;
  });
}

}  // namespace mesh5d
#endif  // TS_LAB_08_PLAN_H
