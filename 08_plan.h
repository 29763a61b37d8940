// 08_plan.h — the planner of `08_5d_mesh --plan`: predict a mesh's step time before booking a cluster.
//
// The playbook's first exercise, as code: for every mesh a cluster allows, memory from the very
// functions each run of 08 checks against its allocator (mesh5d::predict_memory, which calls 02–07's
// formulas), and time from the bytes each run measures (mesh5d::predict_comm) priced by a time
// model whose every factor is a named function below, with its source:
//
//   collectives   wire bytes / the bus bandwidth NCCL reaches for that collective over that many
//                 nodes (the playbook's measurements, NCCL-tests' busbw convention) + a latency per call
//   compute       FLOPs / (peak × the efficiency a roofline allows the rank's matmul shapes)
//   overlap       per technique: what DP / ZeRO hide behind backward, what TP, SP, the pipeline's
//                 p2p and bubble and recomputation add to the critical path
//
// notes/08 derives each factor, calibrates the one free constant on single-node runs, and reports
// the prediction error on the playbook's multi-node runs.
#ifndef TS_08_PLAN_H
#define TS_08_PLAN_H
#include <filesystem>
#include <fstream>
#include <set>

#include "08_5d_mesh.cu"

namespace mesh5d {
using namespace ts;

// ----- the hardware ----------------------------------------------------------------------------------

enum class Collective { AllReduce, AllGather, ReduceScatter, P2P };

// What a collective of NCCL reaches, by the number of nodes its group spans. Bus bandwidth is
// NCCL-tests' convention (doc/PERFORMANCE.md): busbw = algbw · 2(n−1)/n for all-reduce and
// algbw · (n−1)/n for all-gather and reduce-scatter, so that the time of a collective is exactly
// the wire bytes per rank (what predict_comm counts) over busbw, whatever n is.
struct Network {
  std::vector<double> nodes, all_reduce, all_gather, reduce_scatter;  // GB/s at each node count
  double p2p_inter_gbs;    // one GPU's share of the network: a send between nodes
  double latency_intra_s;  // per call, inside a node
  double latency_inter_s;  // per call, across nodes
};

// The Ultra-Scale Playbook's measurement (pipeline-parallelism chapter, "communication bandwidth
// by number of nodes", 256 MB messages, medians) on its cluster of 8-H100 nodes. Latency: the
// order of NCCL-tests' small-message times on such clusters (not calibrated here).
inline const Network& h100_network() {
  static const Network n{{1, 2, 4, 8, 16, 32, 64},
                         {436.0, 361.7, 160.1, 99.6, 84.7, 64.9, 32.9},
                         {249.8, 184.6, 119.0, 69.0, 55.0, 28.0, 11.0},
                         {249.7, 181.6, 115.8, 68.6, 54.5, 27.9, 11.1},
                         50,  // 8 × 400 Gb/s NICs per node of 8 GPUs
                         20e-6,
                         40e-6};
  return n;
}

// A GPU: memory, dense peak, memory bandwidth (the roofline's slope), the fraction of peak its
// matmuls reach at large shapes, and the network of the cluster it sits in.
struct Gpu {
  std::string name;
  double mem_gib, peak_tflops, hbm_gbs, achievable;
  Network net;
};

// The fraction of the bf16 peak that large matmuls reach end to end, calibrated on the playbook's
// three single-node runs (notes/08): MFU × (1 + bubble) of 44.3%, 46.7% and 45.2%.
constexpr double kH100Achievable = 0.47;

// The A100's network: the H100 table scaled by NVLink 3 / NVLink 4 (600 / 900 GB/s) inside a node
// and by 200 / 400 Gb/s NICs across nodes (an assumption: no measurement of our own).
inline Network scaled(const Network& n, double intra, double inter) {
  Network s = n;
  for (auto* v : {&s.all_reduce, &s.all_gather, &s.reduce_scatter})
    for (size_t i = 0; i < v->size(); i++) (*v)[i] *= i == 0 ? intra : inter;
  s.p2p_inter_gbs *= inter;
  return s;
}

inline const Gpu* find_gpu(const std::string& name) {
  static const std::vector<Gpu> kGpus = {
      {"h100", 80, 989, 3350, kH100Achievable, h100_network()},
      {"h200", 141, 989, 4800, kH100Achievable, h100_network()},
      {"a100", 80, 312, 2039, kH100Achievable, scaled(h100_network(), 600.0 / 900, 0.5)}};
  for (const Gpu& g : kGpus)
    if (name == g.name) return &g;
  return nullptr;
}

// This machine, as `make bench` measured it (scripts/bench.sh writes the file): the rate one rank
// reaches on a whole training step of 01 (F × tokens/s, so the non-matmul work is in it and the
// achievable fraction is 1), and the bus bandwidths and small-message latency of bench_comm at
// 2 ranks. One "node": every rank on this machine.
//   {"gflops": 21.3, "memory_gib": 7.7, "all_reduce_gbs": 0.9, "all_gather_gbs": 0.6,
//    "reduce_scatter_gbs": 0.5, "latency_s": 2e-05}
inline Gpu local_gpu(const std::string& path) {
  std::ifstream f(path);
  if (!f) config_error("--calibration: cannot read %s (make bench writes it; or pass --calibration FILE)", path.c_str());
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  try {
    const Json j = Json::parse(text);
    auto num = [&](const char* key) {
      const double v = j.at(key).as_double();
      if (!(v > 0)) throw FormatError(std::string(key) + " must be > 0");
      return v;
    };
    const double ar = num("all_reduce_gbs"), ag = num("all_gather_gbs"), rs = num("reduce_scatter_gbs"), lat = num("latency_s");
    // Memory bandwidth is not measured: the roofline is left out (the step rate already holds it).
    return {"local", num("memory_gib"), num("gflops") / 1e3, 1e9, 1.0, Network{{1}, {ar}, {ag}, {rs}, ag, lat, lat}};
  } catch (const FormatError& e) {
    config_error("--calibration %s: %s", path.c_str(), e.what());
  }
}

// The calibration a run prices itself with: --calibration FILE, else calibration.json in the
// folder of the running binary, where make bench writes it (BUILD/calibration.json). A file named
// by the flag must exist; the default may be absent (found = false: nothing to predict with).
struct Calibration {
  std::string path;
  Gpu gpu;
  bool found = false;
};
inline std::string default_calibration_path() {
  std::error_code e;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", e);
  return ((e ? std::filesystem::path("build") : exe.parent_path()) / "calibration.json").string();
}
constexpr const char* kCalibrationHelp =
    "this machine as make bench measured it (the file it writes; default: calibration.json beside the binary): "
    "the rates the run's predicted step time uses";
// Declares --calibration and reads the file, before any collective: a bad file is a config_error
// on every rank.
inline Calibration read_calibration(Args& a) {
  Calibration c;
  // The default is recorded as "" (trainer.json keeps every flag): a run repeated from its
  // checkpoint on another machine, or from another build folder, looks beside its own binary.
  const std::string named = a.get_str("--calibration", "", kCalibrationHelp);
  const bool given = !named.empty();
  c.path = given ? named : default_calibration_path();
  if (given || std::filesystem::exists(c.path)) {
    c.gpu = local_gpu(c.path);
    c.found = true;
  }
  return c;
}

// The cluster and the job the planner sizes a mesh for.
struct Cluster {
  const Gpu* gpu;
  double mem_gib;  // memory per GPU (--gpu-mem overrides the table)
  int gpus, per_node;
};

// Of the GPU's memory, the share a plan may fill: the rest is CUDA's context, NCCL's buffers,
// workspace and fragmentation.
constexpr double kMemoryHeadroom = 0.9;
inline double usable_bytes(const Cluster& c) { return c.mem_gib * kMemoryHeadroom * 1073741824.0; }

// Backward's share of a step's compute (2 of the 6 FLOPs per parameter and token are forward):
// what DP's reduction can hide behind.
constexpr double kBackwardShare = 2.0 / 3;

// ----- the time model: each factor ---------------------------------------------------------------------

// Bus bandwidth of `op` over a group spanning `nodes` nodes (GB/s): the table, linear in log2(nodes)
// between its points; past its last point it falls ∝ 1/nodes (an assumption: the table's trend from
// 32 to 64 nodes).
inline double bus_bandwidth(const Network& n, Collective op, int nodes) {
  if (op == Collective::P2P) return nodes > 1 ? n.p2p_inter_gbs : n.all_gather[0];
  const std::vector<double>& bw = op == Collective::AllReduce ? n.all_reduce
                                  : op == Collective::AllGather ? n.all_gather
                                                                : n.reduce_scatter;
  const size_t last = n.nodes.size() - 1;
  if (nodes >= n.nodes[last]) return bw[last] * n.nodes[last] / nodes;
  size_t i = 0;
  while (i + 1 < last && n.nodes[i + 1] <= nodes) i++;
  const double f = (std::log2(double(nodes)) - std::log2(n.nodes[i])) / (std::log2(n.nodes[i + 1]) - std::log2(n.nodes[i]));
  return bw[i] + std::max(0.0, f) * (bw[i + 1] - bw[i]);
}

// Seconds for `calls` collectives moving `wire_bytes` per rank in all (the α–β model: a latency per
// call plus bytes over bandwidth; Hockney 1994, as NCCL-tests' "time ≈ overhead + size / bw").
inline double collective_seconds(const Network& n, Collective op, double wire_bytes, double calls, int nodes) {
  if (wire_bytes <= 0) return 0;
  return calls * (nodes > 1 ? n.latency_inter_s : n.latency_intra_s) + wire_bytes / (bus_bandwidth(n, op, nodes) * 1e9);
}

// The nodes a group spans: rank 0's group along `a` (every group of an axis spans as many).
inline int group_nodes(const Plan& p, Axis a, int per_node) {
  std::set<int> nodes;
  for (int r : mesh_group(p.mesh, 0, a)) nodes.insert(r / per_node);
  return int(nodes.size());
}

// The roofline (Williams, Waterman & Patterson 2009): a matmul of m×k by k×n runs at
// min(achievable peak, arithmetic intensity × memory bandwidth). Returns the fraction of the peak.
inline double matmul_efficiency(const Gpu& g, double m, double k, double n, double elem_bytes) {
  const double intensity = 2 * m * k * n / (elem_bytes * (m * k + k * n + m * n));  // FLOPs per byte moved
  return std::min(g.achievable, intensity * g.hbm_gbs / (g.peak_tflops * 1e3));
}

// One rank's layer matmuls (q,k,v; o; gate,up; down) at `tokens` rows after tp's splits, weighted
// by their FLOPs: the efficiency the step's compute runs at. SP gathers a tp group's tokens before
// each matmul, so the rows are the micro-batch's tokens on this cp rank.
inline double layer_efficiency(const Gpu& g, const ModelConfig& m, double tokens, int tp, double elem_bytes) {
  const double h = m.dim, kv = double(m.kv_heads) * (m.dim / m.heads), f = m.ffn;
  const double shapes[][2] = {{h, (h + 2 * kv) / tp}, {h / tp, h}, {h, 2 * f / tp}, {f / tp, h}};
  double flops = 0, seconds = 0;
  for (const auto& s : shapes) {
    const double w = tokens * s[0] * s[1];
    flops += w;
    seconds += w / matmul_efficiency(g, tokens, s[0], s[1], elem_bytes);
  }
  return flops / seconds;
}

// Recomputation runs part of the forward again: all of it under full recompute (8N instead of 6N
// per token, Korthikanti et al. 2022), the attention core (its 4·s·h of the 12·s·h FLOPs per layer
// and token that run forward) under selective recompute.
inline double recompute_factor(const ModelConfig& m, Recompute r) {
  const double F = flops_per_token(m), attn_forward = 4.0 * m.layers * m.dim * double(m.seq);
  return r == Recompute::Full ? 1 + (F / 3) / F : r == Recompute::Selective ? 1 + attn_forward / F : 1.0;
}

// Plain DP (02, bucketed) and ZeRO-1 reduce the accumulated gradients once, during the last
// micro-batch's backward, bucket by bucket as they become ready (PyTorch DDP, Li et al. 2020; the
// playbook's "overlap with backward"). What the window cannot hide shows, and the last bucket, ready
// only when backward ends, always does.
inline double reduction_exposed(double t_reduce, double t_window, double last_bucket_share) {
  return std::max(t_reduce - t_window, t_reduce * std::min(1.0, last_bucket_share));
}

// ZeRO-3 gathers each unit before its forward and backward and prefetches the next one during the
// current one (FSDP; the playbook's ZeRO-3 overlap): the first unit's gather and what outlasts the
// compute show. Without prefetch every gather waits.
inline double zero3_exposed(double t_comm, double t_compute, int units, bool prefetch) {
  if (!prefetch) return t_comm;
  return std::max(0.0, t_comm - t_compute) + t_comm / std::max(1, units);
}

// ----- a candidate --------------------------------------------------------------------------------------

struct Candidate {
  Plan plan;
  int micro_batch = 1;
  Recompute recompute = Recompute::None;
  MemoryPrediction mem;
  double mem_total = 0, efficiency = 0, t_compute = 0, t_tp = 0, t_cp = 0, t_cp_exposed = 0, t_dp = 0,
         t_dp_exposed = 0, t_bubble = 0, t_pp = 0, t_ep = 0, bubble = 0, step = 0, tokens_per_s_gpu = 0, mfu = 0;
  std::string reject;  // why it cannot run ("" = it fits)
  double exposed() const { return t_tp + t_cp_exposed + t_dp_exposed + t_pp + t_ep; }
};

inline Collective collective_of(const std::string& op) {
  return op == "all_reduce" ? Collective::AllReduce
         : op == "all_gather" ? Collective::AllGather
         : op == "reduce_scatter" ? Collective::ReduceScatter
                                  : Collective::P2P;  // send, recv; all_to_all priced as one rank's sends
}

// The fp32 gradients this rank holds: what plain DP reduces, in buckets.
inline double grad_bytes(const RunConfig& rc, const Plan& p) { return 4.0 * double(local_table(rc, p, 0).total); }

// Calls per step of a group's collectives, for their latency: tp 2 collectives per layer forward and
// 2 backward (each an all-gather + reduce-scatter pair under SP), cp's ring cp−1 steps per layer
// forward and backward, the dense group one per bucket (naive: one per tensor, 9 per layer), per
// unit for ZeRO (per micro-batch where 03 reduces or gathers every micro-batch).
inline double calls_per_step(const RunConfig& rc, const Plan& p, const std::string& group, double mbs, int units) {
  const double layers = double(rc.model.layers) / p.mesh.pp;
  if (group == "tp") return mbs * layers * (p.sp ? 8 : 4);
  if (group == "cp") return mbs * layers * 2 * (p.mesh.cp - 1);
  if (group == "pp") return 2 * mbs * p.virtual_stages;
  if (group == "ep") return mbs * layers * 4;
  if (p.zero == 0)
    return p.dp_mode == "naive" ? 9.0 * layers : std::max(1.0, grad_bytes(rc, p) / (p.bucket_mb * 1048576));
  return units * (p.zero == 1 ? 2 : p.zero == 2 ? mbs + 1 : 3 * mbs);
}

// Memory from the same functions a run prints as "predicted"; time from the factors above.
inline Candidate evaluate(const RunConfig& base, const Cluster& cl, const Plan& p, int mb, Recompute r) {
  Candidate c;
  c.plan = p;
  c.micro_batch = mb;
  c.recompute = r;
  RunConfig rc = base;
  rc.micro_batch = mb;
  rc.recompute = r;
  // The fullest pipeline stage sets the memory: the first (embedding, most micro-batches in
  // flight) or the last (head and logits).
  auto total = [](const MemoryPrediction& m) { return m.params + m.grads + m.optimizer + m.activations; };
  c.mem = predict_memory(rc, p, 0);
  if (p.mesh.pp > 1) {
    const MemoryPrediction last = predict_memory(rc, p, p.mesh.pp - 1);
    if (total(last) > total(c.mem)) c.mem = last;
  }
  c.mem_total = total(c.mem);
  const Gpu& g = *cl.gpu;
  const ModelConfig& m = rc.model;
  const double tokens = double(rc.batch) * m.seq, gpus = double(cl.gpus), mbs = micro_batches_per_rank(rc, p);
  c.efficiency = layer_efficiency(g, m, double(mb) * m.seq / p.mesh.cp, p.mesh.tp, dtype_size(rc.dtype));
  c.t_compute = flops_per_token(m) * tokens * recompute_factor(m, r) / gpus / (g.peak_tflops * 1e12 * c.efficiency);
  // Each group's collectives at the bandwidth of the nodes it spans.
  const int units = local_table(rc, p, 0).num_units();
  const auto comm = predict_comm(rc, p);
  auto seconds = [&](const std::string& group, Axis a, const char* only = nullptr) {
    if (!comm.count(group)) return 0.0;
    const int nodes = group_nodes(p, a, cl.per_node);
    double t = 0, calls = calls_per_step(rc, p, group, mbs, units) / comm.at(group).size();
    for (auto& [op, bytes] : comm.at(group))
      if (!only || op == only) t += collective_seconds(g.net, collective_of(op), bytes, calls, nodes);
    return t;
  };
  c.t_tp = seconds("tp", Axis::TP);
  c.t_cp = seconds("cp", Axis::CP);
  // The ring overlaps its transfers with attention: 12·L·h·s of the 6N + 12·L·h·s FLOPs per token.
  const double attn_share = 12.0 * m.layers * m.dim * double(m.seq) / flops_per_token(m);
  c.t_cp_exposed = p.cp.mode == cp::Mode::Ring ? std::max(0.0, c.t_cp - attn_share * c.t_compute) : c.t_cp;
  // The dense group (dp × cp) and, with experts, ep_dp: what hides depends on the technique.
  const std::string dense = dense_group_name(p);
  const Axis dense_axis = p.mesh.cp > 1 ? Axis::DP_CP : Axis::DP;
  // A pipeline's gradients are complete only after its flush (05): nothing is left to hide behind.
  const double backward = p.mesh.pp > 1 ? 0 : kBackwardShare * c.t_compute, last_backward = backward / std::max(1.0, mbs);
  c.t_dp = seconds(dense, dense_axis) + seconds("ep_dp", Axis::EP_DP);
  if (p.zero == 0) {
    c.t_dp_exposed = p.dp_mode == "naive" ? c.t_dp  // per tensor after the backward
                                          : reduction_exposed(c.t_dp, last_backward, p.bucket_mb * 1048576 / grad_bytes(rc, p));
  } else if (p.zero < 3) {
    // ZeRO-1 reduce-scatters once (ZeRO-2 every micro-batch, behind each backward); the updated
    // weights are gathered after the optimizer step, with nothing left to hide behind.
    const double rs = seconds(dense, dense_axis, "reduce_scatter"), ag = seconds(dense, dense_axis, "all_gather");
    c.t_dp_exposed = reduction_exposed(rs, p.zero == 1 ? last_backward : backward, 1.0 / units) + ag;
  } else {
    c.t_dp_exposed = zero3_exposed(c.t_dp, c.t_compute, units, p.prefetch);
  }
  c.t_ep = seconds("ep", Axis::EP);
  // The pipeline: its simulated bubble idles the stage's compute and its TP collectives alike; the
  // busiest stage's sends (a middle one) wait on the critical path.
  if (p.mesh.pp > 1) {
    const pp::Plan pl = pipeline_plan(rc, p);
    c.bubble = pl.bubble();
    c.t_bubble = c.bubble * (c.t_compute + c.t_tp);
    double send = 0;
    for (int s = 0; s < p.mesh.pp; s++)
      send = std::max(send, pp::predict_send_bytes(m, mb, rc.dtype, pl.p, pl.m, pl.V, s, token_share(p)));
    c.t_pp = collective_seconds(g.net, Collective::P2P, send, calls_per_step(rc, p, "pp", mbs, units),
                                group_nodes(p, Axis::PP, cl.per_node));
  }
  c.step = c.t_compute + c.t_bubble + c.exposed();
  c.tokens_per_s_gpu = tokens / c.step / gpus;
  c.mfu = flops_per_token(m) * c.tokens_per_s_gpu / (g.peak_tflops * 1e12);
  if (c.mem_total > usable_bytes(cl))
    c.reject = "does not fit: " + human_bytes(c.mem_total) + " > " + human_bytes(usable_bytes(cl));
  return c;
}

// ----- the search -----------------------------------------------------------------------------------------

// Every valid mesh of the cluster: tp dividing the heads and kv heads, cp (ring, zigzag)
// dividing the sequence into 2·cp chunks, pp dividing the layers (1F1B, and interleaved with two
// chunks per rank where it divides), dp the rest; each ZeRO stage (only 0 and 1 with pp), the
// micro-batches that divide the batch, each recompute mode; sequence parallel with tp. With
// experts: each ep dividing dp and the experts (ZeRO only at ep 1), no cp and no sequence
// parallelism (validate says why).
inline std::vector<Candidate> enumerate(const RunConfig& rc, const Cluster& cl) {
  std::vector<Candidate> all;
  const ModelConfig& m = rc.model;
  for (int tp = 1; tp <= cl.gpus; tp *= 2)
    for (int cpn = 1; cpn * tp <= cl.gpus && cpn <= 16; cpn *= 2)
      for (int pp = 1; pp * cpn * tp <= cl.gpus && pp <= m.layers; pp *= 2) {
        if (cl.gpus % (tp * cpn * pp) || m.heads % tp || m.kv_heads % tp || m.ffn % tp || m.vocab % tp) continue;
        // cp for long sequences only: below ~1k tokens per rank a ring's K/V transfer outlasts the
        // attention it hides behind (notes/06).
        if (m.seq % (2 * cpn) || (cpn > 1 && m.seq / cpn < 1024)) continue;
        if (m.experts > 0 && cpn > 1) continue;
        if (m.layers % pp) continue;
        const int dp = cl.gpus / (tp * cpn * pp);
        if (rc.batch % dp) continue;
        for (int V : {1, 2}) {
          if (V > 1 && (pp == 1 || m.layers % (pp * V))) continue;
          for (int zero = 0; zero <= (pp > 1 ? 1 : 3); zero++)
            for (int mb = 1; mb <= rc.batch / dp; mb *= 2) {
              if ((rc.batch / dp) % mb) continue;
              const int micro = rc.batch / dp / mb;
              if (V > 1 && micro % pp) continue;  // interleaved needs m a multiple of pp
              for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
                for (int ep = 1; ep <= (m.experts > 0 ? dp * cpn : 1); ep *= 2) {
                  if ((dp * cpn) % ep || (m.experts > 0 && m.experts % ep) || (ep > 1 && zero > 0)) continue;
                  if (dp * cpn == 1 && zero > 0) continue;
                  Plan p;
                  p.mesh = {dp, pp, cpn, tp, ep};
                  p.zero = zero;
                  p.sp = tp > 1 && m.experts == 0;
                  p.virtual_stages = V;
                  p.schedule = V > 1 ? pp::Schedule::Interleaved : pp::Schedule::OneFOneB;
                  p.dp_mode = pp > 1 ? "naive" : "bucketed";
                  all.push_back(evaluate(rc, cl, p, mb, r));
                }
            }
        }
      }
  return all;
}

inline std::string describe(const Candidate& c) {
  const MeshConfig& m = c.plan.mesh;
  std::string s = "dp " + std::to_string(m.dp);
  if (m.pp > 1) s += " pp " + std::to_string(m.pp) + (c.plan.virtual_stages > 1 ? "×" + std::to_string(c.plan.virtual_stages) : "");
  if (m.cp > 1) s += " cp " + std::to_string(m.cp);
  s += " tp " + std::to_string(m.tp) + (c.plan.sp ? "+sp" : "");
  if (m.ep > 1) s += " ep " + std::to_string(m.ep);
  s += c.plan.zero ? " ZeRO-" + std::to_string(c.plan.zero) : " DP";
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
  j["virtual_stages"] = c.plan.virtual_stages;
  j["bubble"] = c.bubble;
  j["zero"] = c.plan.zero;
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

// The stated assumptions, printed with every plan.
inline void print_assumptions(RunLog& log, const Cluster& cl) {
  const Gpu& g = *cl.gpu;
  if (g.name == "local") {
    log.line("assumed (measured here by make bench): a training step's FLOPs at %.1f GFLOP/s per rank; bus bandwidth "
             "all-reduce %.2f, all-gather %.2f, reduce-scatter %.2f GB/s; %.0f µs per call", 1e3 * g.peak_tflops,
             g.net.all_reduce[0], g.net.all_gather[0], g.net.reduce_scatter[0], 1e6 * g.net.latency_intra_s);
    return;
  }
  log.line("assumed: matmuls at up to %.0f%% of %.0f TFLOP/s (roofline at %.0f GB/s); bus bandwidth by nodes spanned "
           "(all-reduce %.0f GB/s in a node, %.1f across %g nodes); %.0f/%.0f µs per call in/across nodes",
           100 * g.achievable, g.peak_tflops, g.hbm_gbs, g.net.all_reduce[0], g.net.all_reduce.back(), g.net.nodes.back(),
           1e6 * g.net.latency_intra_s, 1e6 * g.net.latency_inter_s);
}

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

// One candidate's parts.
inline void print_candidate(RunLog& log, const RunConfig& rc, const Cluster& cl, const Candidate& c) {
  log.line("plan: %s on %d × %s: %s", rc.preset.c_str(), cl.gpus, cl.gpu->name.c_str(), describe(c).c_str());
  log.line("  memory per GPU %s (params %s, grads %s, optimizer %s, activations %s)%s%s", human_bytes(c.mem_total).c_str(),
           human_bytes(c.mem.params).c_str(), human_bytes(c.mem.grads).c_str(), human_bytes(c.mem.optimizer).c_str(),
           human_bytes(c.mem.activations).c_str(), c.reject.empty() ? "" : " — ", c.reject.c_str());
  log.line("  step %.3f s: compute %.3f s (matmuls at %.1f%% of peak), tp %.3f s, cp %.3f s (%.3f exposed), dp %.3f s "
           "(%.3f exposed), bubble %.3f s, pp p2p %.3f s; %.0f tok/s/GPU, MFU %.1f%%", c.step, c.t_compute,
           100 * c.efficiency, c.t_tp, c.t_cp, c.t_cp_exposed, c.t_dp, c.t_dp_exposed, c.t_bubble, c.t_pp,
           c.tokens_per_s_gpu, 100 * c.mfu);
  if (c.plan.mesh.ep > 1) log.line("  ep all-to-all %.3f s (balanced routing, on the critical path)", c.t_ep);
}

// Ranks the candidates that fit by tokens/s/GPU and says, for the best of those that differ from the
// winner on one axis, on which axes they differ and where they lose.
inline const Candidate* print_ranking(RunLog& log, const RunConfig& rc, const Cluster& cl, std::vector<Candidate>& all) {
  sort_ranking(all);
  const Ranking rank(all);
  log.line("%-4s %-58s %10s %12s %7s %10s %7s", "rank", "mesh", "memory", "tok/s/GPU", "MFU", "exposed", "bubble");
  int shown = 0;
  for (const Candidate& c : all) {
    if (!c.reject.empty() || shown == 8) break;
    log.line("%-4d %-58s %10s %12.0f %6.1f%% %8.1f ms %6.1f%%", ++shown, describe(c).c_str(),
             human_bytes(c.mem_total).c_str(), c.tokens_per_s_gpu, 100 * c.mfu, 1e3 * c.exposed(), 100 * c.bubble);
  }
  if (all.empty()) {  // every factorisation broke a divisibility rule of 02–07
    log.line("no valid mesh on %d GPUs: dp must divide the %d sequences of a step, pp the %d layers, tp the %d heads "
             "and %d kv heads, cp the %d tokens of a sequence (in 2·cp chunks); change --gpus or --global-batch-tokens",
             cl.gpus, rc.batch, rc.model.layers, rc.model.heads, rc.model.kv_heads, rc.model.seq);
    return nullptr;
  }
  if (shown == 0) {
    double least = all.front().mem_total;
    for (const Candidate& c : all) least = std::min(least, c.mem_total);
    log.line("no mesh fits: the smallest needs %s per GPU", human_bytes(least).c_str());
    return nullptr;
  }
  const Candidate& best = all.front();
  // The first candidate in ranking order that `pick` selects, preferring one that differs from the
  // best on that axis alone, and why it ranks below.
  auto why = [&](const char* what, const std::function<bool(const Candidate&)>& pick) {
    const Candidate *w = nullptr, *alone = nullptr;
    for (const Candidate& c : all)
      if (&c != &best && pick(c)) {
        if (!w) w = &c;
        if (!alone && differences(c, best).find(',') == std::string::npos) alone = &c;
      }
    if (alone && alone->reject.empty()) w = alone;
    if (!w) return;
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
};
// The playbook's benchmark grid trains 1M tokens per step (sequences of 4096): the default batch.
constexpr double kDefaultBatchTokens = 1048576;

// --plan: runs nothing; ranks every valid mesh for the cluster, or prices the one given.
inline int plan_only(RunLog& log, const RunConfig& rc, const Cluster& cl, const Plan* given, const PlanJob& job) {
  log.line("plan: %s on %d × %s (%.1f GiB usable = %.0f%% of %.0f GiB, %d per node), seq %d, %d sequences per step "
           "(%.0f tokens%s)", rc.preset.c_str(), cl.gpus, cl.gpu->name.c_str(), usable_bytes(cl) / 1073741824.0,
           100 * kMemoryHeadroom, cl.mem_gib, cl.per_node, rc.model.seq, rc.batch, double(rc.batch) * rc.model.seq,
           job.default_batch ? "; the default: set --global-batch-tokens" : "");
  print_assumptions(log, cl);
  std::vector<Candidate> all;
  const Candidate* best = nullptr;
  if (given) {
    all.push_back(evaluate(rc, cl, *given, rc.micro_batch, rc.recompute));
    print_candidate(log, rc, cl, all[0]);
    best = &all[0];
  } else {
    all = enumerate(rc, cl);
    best = print_ranking(log, rc, cl, all);
  }
  print_warnings(log, rc, cl, best, !given);
  if (best && best->reject.empty()) {
    const double tokens = job.train_tokens > 0 ? job.train_tokens : 20.0 * double(param_count(rc.model));
    print_cost(log, cl, *best, tokens, job.train_tokens > 0, job.usd_per_gpu_hour);
  }
  Json cands = Json::array();
  for (const Candidate& c : all) cands.push_back(candidate_json(c));
  Json s = Json::object();
  s["candidates"] = std::move(cands);
  log.summary(s);
  return 0;
}

// ----- every run: its own step time, predicted ---------------------------------------------------------

// The time model above at a run's own mesh and batch, on this machine as make bench calibrated it:
// every run of 02–08 prints its measured step time next to this prediction, term by term (the terms
// of `evaluate`: step = compute + bubble + tp + cp exposed + dp exposed + pp p2p + ep), so that a
// miss names the factor that missed. Every run that prints it is a test of the planner.
inline Json step_time_report(RunLog& log, const RunConfig& rc, const Plan& p, const Calibration& cal, Device dev,
                             const StepTimes& t) {
  Json j = Json::object();
  const double tokens = double(rc.batch) * rc.model.seq;
  j["measured_s"] = t.median_s;
  j["warmup_s"] = t.warmup_s;
  j["measured_steps"] = double(t.measured);
  char measured[200];
  if (t.measured > 0)
    snprintf(measured, sizeof measured, "measured %.1f ms (median of the %zu steps after the warm-up step %ld, which took %.1f ms)",
             1e3 * t.median_s, t.measured, t.first_step, 1e3 * t.warmup_s);
  else
    snprintf(measured, sizeof measured, "measured %.1f ms (the warm-up step alone: run more --steps)", 1e3 * t.median_s);
  const std::string why = !cal.found ? "no calibration of this machine at " + cal.path +
                                           " (make bench writes it; or pass --calibration FILE)"
                          : dev != Device::CPU ? "make bench calibrates the CPU (01 --device cpu); this run is on " +
                                                     std::string(device_name(dev))
                                               : "";
  if (!why.empty()) {
    log.line("step time: %s; not predicted: %s", measured, why.c_str());
    return j;
  }
  const int world = p.mesh.dp * p.mesh.pp * p.mesh.cp * p.mesh.tp;
  const Cluster cl{&cal.gpu, cal.gpu.mem_gib, world, world};
  const Candidate c = evaluate(rc, cl, p, rc.micro_batch, rc.recompute);
  std::string terms;
  auto term = [&](const char* fmt, double a, double b = 0) {
    char s[96];
    snprintf(s, sizeof s, fmt, 1e3 * a, 1e3 * b);
    terms += (terms.empty() ? "" : " + ") + std::string(s);
  };
  term("compute %.1f", c.t_compute);
  if (c.t_tp > 0) term("tp %.1f", c.t_tp);
  if (c.t_cp > 0) term("cp %.1f exposed (of %.1f)", c.t_cp_exposed, c.t_cp);
  const std::string dense = dense_group_name(p) + (p.zero ? " ZeRO-" + std::to_string(p.zero) : "");
  if (c.t_dp > 0) term((dense + " %.1f exposed (of %.1f)").c_str(), c.t_dp_exposed, c.t_dp);
  if (p.mesh.pp > 1) term("bubble %.1f", c.t_bubble);
  if (c.t_pp > 0) term("pp p2p %.1f", c.t_pp);
  if (c.t_ep > 0) term("ep all-to-all %.1f", c.t_ep);
  log.line("step time: predicted %.1f ms = %s ms; %s; measured/predicted %.2f", 1e3 * c.step, terms.c_str(), measured,
           t.median_s / c.step);
  log.line("  %.0f tokens/s predicted, %.0f measured: the planner's time model (08_plan.h) with %s", tokens / c.step,
           tokens / t.median_s, cal.path.c_str());
  print_assumptions(log, cl);
  j["calibration"] = cal.path;
  const std::pair<const char*, double> terms_json[] = {
      {"predicted_s", c.step},        {"compute_s", c.t_compute},       {"tp_s", c.t_tp},
      {"cp_s", c.t_cp},               {"cp_exposed_s", c.t_cp_exposed}, {"dp_s", c.t_dp},
      {"dp_exposed_s", c.t_dp_exposed}, {"bubble_s", c.t_bubble},       {"pp_s", c.t_pp},
      {"ep_s", c.t_ep},               {"predicted_tokens_per_s", tokens / c.step},
      {"measured_tokens_per_s", tokens / t.median_s}};
  for (const auto& [key, v] : terms_json) j[key] = v;
  return j;
}

// Arms the loop's step-time line for a run on plan `p` (02–07 describe their run as the plan 08
// would run it).
inline void predict_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Plan& p, const Calibration& cal,
                              Device dev) {
  loop.step_time = [&log, rc, p, cal, dev](const StepTimes& t) { return step_time_report(log, rc, p, cal, dev, t); };
}

}  // namespace mesh5d
#endif  // TS_08_PLAN_H
