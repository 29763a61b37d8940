// step_time.h — the step-time model every run prints its measured step time against.
//
// A step of any mesh is a sum of named terms (notes/08 derives each one):
//
//   step = compute + bubble + tp + cp exposed + dp exposed + pp p2p + ep
//
//   compute      FLOPs / (peak × the efficiency a roofline allows the rank's matmul shapes)
//   collectives  wire bytes / the bus bandwidth NCCL reaches for that collective over that many
//                nodes (the playbook's measurements, NCCL-tests' busbw convention) + a latency per call
//   exposed      what each technique cannot hide: its own rule, in its own chapter (02's buckets
//                behind backward, 03's per-unit gathers, 06's ring behind attention, 05's bubble)
//
// This file holds the hardware (the GPU table, this machine's calibration) and the pieces every
// chapter prices its collectives and compute with; each chapter 02–07 composes its own prediction
// from them (its `predict_step_time`), and 08's planner composes the same chapter functions for
// every mesh of a cluster.
#ifndef TS_STEP_TIME_H
#define TS_STEP_TIME_H
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "training/train.h"

namespace ts {

// The measured step times of a run, for the predicted-step-time line: the first step this process
// runs is warm-up (allocations, the optimizer states' first touch, caches), so "measured" is the
// median of the others (the first alone when it is the only one).
struct StepTimes {
  long first_step = 0;     // the warm-up step's number
  double warmup_s = 0;     // its seconds
  double median_s = 0;     // the median of the steps after it
  size_t measured = 0;     // how many steps that median is over (0: only the warm-up step ran)
};
StepTimes step_times(long first_step, const std::vector<double>& seconds);

// ----- the hardware ----------------------------------------------------------------------------------

enum class Collective { AllReduce, AllGather, ReduceScatter, P2P };

// What a collective of NCCL reaches, by the number of nodes its group spans. Bus bandwidth is
// NCCL-tests' convention (doc/PERFORMANCE.md): busbw = algbw · 2(n−1)/n for all-reduce and
// algbw · (n−1)/n for all-gather and reduce-scatter, so that the time of a collective is exactly
// the wire bytes per rank (what each chapter's predict_comm counts) over busbw, whatever n is.
struct Network {
  std::vector<double> nodes, all_reduce, all_gather, reduce_scatter;  // GB/s at each node count
  double p2p_inter_gbs;    // one GPU's share of the network: a send between nodes
  double latency_intra_s;  // per call, inside a node
  double latency_inter_s;  // per call, across nodes
  std::string source = "the playbook's measurement";  // where the numbers come from, for the plan's assumptions
  // A planner's own pricing of all-reduce, all-gather and reduce-scatter for one group (08's NCCL
  // tuner, lab/08_nccl_tuner.h): collective_seconds calls it where set; empty: the α–β above.
  std::function<double(Collective op, double wire_bytes, double calls, int nodes)> price;
};

// The Ultra-Scale Playbook's measurement (pipeline-parallelism chapter, "communication bandwidth
// by number of nodes", 256 MB messages, medians) on its cluster of 8-H100 nodes.
const Network& h100_network();

// A GPU: memory, dense peak, memory bandwidth (the roofline's slope), the fraction of peak its
// matmuls reach at large shapes, and the network of the cluster it sits in.
struct Gpu {
  std::string name;
  double mem_gib, peak_tflops, hbm_gbs, achievable;
  Network net;
  std::string measured_on;  // local: the model 01 ran when make bench measured the rate ("" where unsaid)
  double fp8_gemm_speedup = 1;  // an FP8 GEMM's rate over a bf16 one's (1: none known; local: not measured)
  int sms = 0;  // streaming multiprocessors, the slots of a GEMM's waves (0: a CPU, no waves to quantize)
};

// The fraction of the bf16 peak that large matmuls reach end to end, calibrated on the playbook's
// three single-node runs (notes/08): MFU × (1 + bubble) of 44.3%, 46.7% and 45.2%.
constexpr double kH100Achievable = 0.48;

// `n` with its in-node bandwidths scaled by `intra` and its cross-node ones by `inter`.
Network scaled(const Network& n, double intra, double inter);
// h100, h200, h800, a100; nullptr for another name.
const Gpu* find_gpu(const std::string& name);
// This machine, as `make bench` measured it (scripts/bench.sh writes the file).
Gpu local_gpu(const std::string& path);
// A cluster's own bus bandwidths (--network FILE), in the calibration's keys: all_reduce_gbs,
// all_gather_gbs, reduce_scatter_gbs and latency_s, each a number (one node) or, with "nodes":
// [1, 2, 4, …], an array of one value per node count; optional latency_inter_s and p2p_inter_gbs.
Network read_network(const std::string& path);
// The line a plan prints when a group spans more nodes than the table measured: the value assumed
// there and why ("" when every group is inside the table).
std::string beyond_table(const Network& n, int nodes);

// The calibration a run prices itself with: --calibration FILE, else calibration.json in the
// folder of the running binary, where make bench writes it (BUILD/calibration.json). A file named
// by the flag must exist; the default may be absent (found = false: nothing to predict with).
struct Calibration {
  std::string path;
  Gpu gpu;
  bool found = false;
  ModelConfig model;  // the model gpu.measured_on names (read when it names one)
};
std::string default_calibration_path();
// Declares --calibration and reads the file, before any collective: a bad file is a config_error
// on every rank.
Calibration read_calibration(Args& a);

// ----- the pieces -------------------------------------------------------------------------------------

// Backward's share of a step's compute (4 of the 6 FLOPs per parameter and token): what a
// gradient reduction can hide behind.
constexpr double kBackwardShare = 2.0 / 3;

// Bus bandwidth of `op` over a group spanning `nodes` nodes (GB/s).
double bus_bandwidth(const Network& n, Collective op, int nodes);
// Seconds for `calls` collectives moving `wire_bytes` per rank in all (the α–β model).
double collective_seconds(const Network& n, Collective op, double wire_bytes, double calls, int nodes);
// "all_reduce" → AllReduce, …; send, recv and all_to_all are priced as one rank's sends.
Collective collective_of(const std::string& op);
// One group's collectives of a step: each op of `ops` (name → wire bytes per rank, a chapter's
// predict_comm) at `calls` calls per step shared evenly between its ops; `only` prices one op.
double group_seconds(const Network& n, const std::map<std::string, double>& ops, double calls, int nodes,
                     const char* only = nullptr);

// flops_per_token(m), the last model's remembered: it builds the model's parameter table to count
// Ψ, and a planner prices thousands of meshes of one model (every term below asks for it).
double flops_per_token_of(const ModelConfig& m);
// The fraction of the achievable rate an m×k by k×n matmul keeps after tile and wave quantization,
// at the best of cuBLAS's large tiles and split-K; 1 where the GPU has no SM count.
double wave_efficiency(const Gpu& g, double m, double k, double n, double elem_bytes);
// The fraction of the peak for one m×k by k×n matmul: the roofline, and below it the achievable
// fraction times the waves' fill.
double matmul_efficiency(const Gpu& g, double m, double k, double n, double elem_bytes);
// The FLOP-weighted efficiency of one rank's layer matmuls at `tokens` rows after tp's splits.
double layer_efficiency(const Gpu& g, const ModelConfig& m, double tokens, int tp, double elem_bytes);
// The forward work recomputation adds: 4/3 under full, the attention core under selective.
double recompute_factor(const ModelConfig& m, Recompute r);
// How much faster --dtype fp8's GEMMs run than bf16's on `g` (Gpu::fp8_gemm_speedup), 1 where the
// run is not fp8.
double fp8_speedup(const Gpu& g, const RunConfig& rc);
// The FLOPs per token --dtype fp8 runs in FP8: the linear layers' GEMMs, forward and backward (6 per
// parameter), without the output head and the MoE router (DeepSeek-V3 §3.3.1 keeps those, the
// embedding, the norms and the attention core in bf16).
double fp8_flops_per_token(const ModelConfig& m);
// Of a reduction overlapped with a backward window: what the window cannot hide, and at least the
// last bucket (ready only when backward ends).
double reduction_exposed(double t_reduce, double t_window, double last_bucket_share);
// Attention's share of a token's FLOPs: 12·L·h·s of 6N + 12·L·h·s (what cp's ring hides behind).
double attention_share(const ModelConfig& m);

// The MoE blocks of one rank's step (add_moe_term; all 0 for a dense model): the compute pieces,
// the dispatch, and the routing imbalance the experts were priced at.
struct MoeTerms {
  double router_s = 0, experts_s = 0, shared_s = 0, copies_s = 0, dispatch_s = 0, imbalance = 0;
  std::vector<double> level_s;  // dispatch_s level by level (MoeShape::dispatch's order)
  double compute() const { return router_s + experts_s + shared_s + copies_s; }
};

// The terms of one step (seconds), as the chapters and the planner compose them.
struct StepTerms {
  double efficiency = 0, t_compute = 0, t_tp = 0, t_cp = 0, t_cp_exposed = 0, t_dp = 0, t_dp_exposed = 0,
         bubble = 0, t_bubble = 0, t_pp = 0, t_ep = 0, step = 0;
  double t_moe = 0;  // of t_compute: the MoE blocks' compute (add_moe_term; 0 for a dense model)
  // The FLOPs per token t_compute priced, each at its own rate in bf16-FLOP equivalents (FP8's
  // counted at 1/fp8_speedup; recomputation in): what add_moe_term takes the MoE share of.
  double priced_flops = 0;
  // What the frontier's overlaps took off tp, dp exposed and ep (lab/08_frontier.h; 0 without them).
  double hidden_tp = 0, hidden_dp = 0, hidden_ep = 0;
  MoeTerms moe;
  bool pipeline = false;  // pp > 1: the bubble is a term (printed even where it is 0)
  double exposed() const { return t_tp + t_cp_exposed + t_dp_exposed + t_pp + t_ep; }
  // step = compute + bubble + what the collectives leave exposed.
  void total() { step = t_compute + t_bubble + exposed(); }
  // The window a gradient reduction can hide behind: backward; the last micro-batch's share of
  // it. Under a pipeline the same: each stage's reductions leave as its last micro-batch's
  // backward completes their units, and stage 0's last backward ends the step (the stages after
  // it finish theirs earlier, with the cooldown to spare).
  double backward() const { return kBackwardShare * t_compute; }
  double last_backward(double micro_batches) const { return backward() / std::max(1.0, micro_batches); }
};
// The compute term of a step of `rc` on `gpus` ranks whose matmuls are split tp ways, whose
// sequences cp ways and whose layers over pp stages: efficiency, t_compute and pipeline set.
StepTerms compute_terms(const Gpu& g, const RunConfig& rc, int tp, int cp, int pp, int gpus);

// ----- the MoE term ---------------------------------------------------------------------------------------
//
// compute_terms prices a mixture of experts as if its active parameters were one dense layer's
// matmuls (6N over the active N). What a MoE block does differently (notes/07, "The MoE term"):
//   router      a D×E matmul per token, 6·D·E FLOPs with backward;
//   experts     K routed SwiGLU experts per token, 18·D·F_e FLOPs each with backward, at the height
//               an expert gets (rows = micro-batch tokens · K · ep / E) and paced by the busiest
//               rank: each layer's all-to-all waits for the rank whose experts received the most rows;
//   shared      S shared experts, one dense SwiGLU of width S·F_e over every token (DeepSeekMoE);
//   row copies  gathering rows into expert order and back, the weighted combine: memory traffic;
//   dispatch    the all-to-alls, one level (flat) or several (across nodes, then inside one).

// One level of a dispatch: the wire bytes each rank sends per step at that level (dispatch and
// combine, forward and backward), its calls, and the nodes its group spans. A flat all-to-all is
// one level over the ep group; a two-level dispatch lists one entry per level.
struct DispatchLevel {
  double bytes = 0, calls = 0;
  int nodes = 1;
};

// The busiest ep rank's routed rows over balanced routing's, summed over the layers, where a run
// has no routing loads of its own: balanced. DeepSeek-V3 reports its auxiliary-loss-free bias
// keeps every batch balanced (technical report §2.1.2, figure 9); a learned softmax router without
// the loss is not (notes/07), and a run passes its measured factor instead.
constexpr double kAssumedImbalance = 1.0;

struct MoeShape {
  double tokens = 0;     // tokens this rank routes per step (every MoE layer it runs)
  double layers = 0;     // the MoE layers it runs (its pipeline stage's)
  int ep = 1;            // the expert-parallel degree
  double imbalance = 1;  // busiest rank's routed rows over balanced (measured, or kAssumedImbalance)
  std::vector<DispatchLevel> dispatch;
};
// The part of flops_per_token the MoE blocks are: L·6·D·(E + 3·F_e·(K + S)).
double moe_flops_per_token(const ModelConfig& m);
// The MoE blocks of one rank's step, term by term.
MoeTerms moe_terms(const Gpu& g, const RunConfig& rc, const MoeShape& x);
// Replaces the MoE blocks' share of s.t_compute (priced at the dense layer's efficiency) by the
// MoE term's compute (s.t_moe records it) and prices the dispatch as s.t_ep. A dense model: no change.
void add_moe_term(StepTerms& s, const Gpu& g, const RunConfig& rc, const MoeShape& x);

// ----- every run: its own step time, predicted ---------------------------------------------------------

// The assumptions a prediction rests on, in one line.
void print_assumptions(RunLog& log, const Gpu& g);
// The step-time line: the prediction term by term next to the measurement (or why nothing is
// predicted: no calibration, or a device make bench does not calibrate). `dense` names the dense
// group's term ("dp", "dp_cp ZeRO-1").
Json step_time_report(RunLog& log, const RunConfig& rc, const Calibration& cal, Device dev, const std::string& dense,
                      const std::function<StepTerms(const Gpu&)>& predict, const StepTimes& t);
// Arms the loop's step-time line with a chapter's prediction.
void predict_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Calibration& cal, Device dev,
                       const std::string& dense, std::function<StepTerms(const Gpu&)> predict);

}  // namespace ts
#endif  // TS_STEP_TIME_H
