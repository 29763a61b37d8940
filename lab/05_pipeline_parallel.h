// lab/05_pipeline_parallel.h — 05's lab: what a pipeline run predicts and prints beside the
// chapter (05_pipeline_parallel.cu holds the schedules, the executor and the bubble formulas):
// each stage's activations and p2p bytes, the step time, the schedule chart and the bubble
// line. 08's planner and the tests include it; lab/05_pipeline_parallel.cu holds the plan and the
// reports 05's main calls; lab/05_simulator.h the simulated clock the chart and the bubble come from.
#ifndef TS_LAB_05_PIPELINE_PARALLEL_H
#define TS_LAB_05_PIPELINE_PARALLEL_H
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "../05_pipeline_parallel.cu"
#include "05_simulator.h"
#include "model/model.h"
#include "training/config.h"
#include "training/memory_model.h"
#include "training/report.h"
#include "training/step_time.h"

namespace pp {
using namespace ts;

// The schedule's bubble formula (the chapter's, or a variant's), at (p, m, V).
inline double bubble_formula(Schedule s, int p, int m, int V) { return s->bubble(p, m, V); }

// "3,2": the split as --stage-layers takes it.
inline std::string split_text(const std::vector<int>& split) {
  std::string t;
  for (int n : split) t += (t.empty() ? "" : ",") + std::to_string(n);
  return t;
}

// ----- predict: memory and p2p bytes per stage (notes/05 derives each line) ------------------------

// What one layer still holds between its B and its W (ZB-H1, DualPipeV), per token of the
// micro-batch: the snapshots its B adds — the output gradients its deferred matmuls multiply, its
// MLP block's, then attention's (q D/t, k and v KV/t each, o's whole D) — and the saved inputs
// they multiply that stay (y D/t, the block's own; h1 and h2, D each, as saved or, under sequence
// parallelism, as the gathered copy the B snapshots: Model::defer_weight_grad). Between the block's
// backward and attention's, the B frees the block's saved tensors that no deferred matmul
// multiplies. tp, sp: the layer is tensor-parallel (04), with or without sequence parallelism (the
// norm region's saved tensors at r = 1/t of the tokens).
struct DeferredSet {
  double mlp_snapshots = 0, attention_snapshots = 0, inputs = 0, freed_after_mlp = 0;
  double total() const { return mlp_snapshots + attention_snapshots + inputs; }
};
inline DeferredSet deferred_set_per_token(const ModelConfig& c, DType dt, int tp = 1, bool sp = false) {
  const double e = dtype_size(dt), D = c.dim, KV = c.kv_dim(), F = c.ffn, f32 = sizeof(float), i32 = sizeof(int32_t);
  const double t = tp, r = sp ? 1.0 / tp : 1.0;
  const double gathered = sp ? D * e : 0, h_saved = sp ? 0 : D * e;  // h1's or h2's copy, or the saved tensor kept
  DeferredSet s;
  s.attention_snapshots = (D / t + 2 * KV / t + D) * e + gathered;
  if (c.experts == 0) {  // SwiGLU: gate and up F/t each, down's whole D; inputs y, silu(g)·u
    s.mlp_snapshots = (2 * F / t + D) * e + gathered;
    s.inputs = (D / t + F / t) * e + 2 * h_saved;
    s.freed_after_mlp = (2 * F / t + r * D) * e + r * f32 + (sp ? r * D * e : 0);  // g, u, x_mid, 1/rms₂ (h2)
    return s;
  }
  // MoE (moe.cu; whole on every tp rank, no sequence parallelism), per token: the router's gate (E);
  // per routed row (K) an expert's down (D), gate and up (F_e); the S shared experts' SwiGLU of
  // width S·F_e. Inputs: y, h1, h2 (router, shared), each row's input (D) and product (F_e), the
  // shared product. Freed: x_mid, the rows' g, u and outputs, the shared g and u, 1/rms₂ and the
  // routing (fp32 probabilities and weights, int32 choices, slots and row tokens).
  const double E = c.experts, K = c.top_k, Fe = c.expert_width(), Fs = double(c.shared_experts) * Fe;
  s.mlp_snapshots = (E + K * (D + 2 * Fe) + (Fs > 0 ? D + 2 * Fs : 0)) * e;
  s.inputs = (D / t + K * (D + Fe) + Fs) * e + 2 * h_saved;
  s.freed_after_mlp = (D + K * (2 * Fe + D) + 2 * Fs) * e + f32 * (1 + E + K) + i32 * 3 * K;
  return s;
}
// The extra a layer's deferred B holds on top of its complete set: the MLP block's snapshots before
// its saved tensors go, or, later, all of them less what went by then.
inline double deferred_b_peak_per_token(const DeferredSet& s) {
  return std::max(s.mlp_snapshots, s.mlp_snapshots + s.attention_snapshots - s.freed_after_mlp);
}

// Peak saved activations of a rank, by replaying its compute list: a micro-batch chunk holds its
// n layers' saved sets from its F to its B (and n deferred sets from its B to its W). The peak is
// at one of: the F of a chunk's last layer ((n − 1) saved + a complete set + the output), the
// head (n saved + the head's tensors), or, when B defers, inside a layer's B.
// tp, sp: the stage's layers are tensor-parallel (04), with or without sequence parallelism.
inline double predict_stage_activations(const Plan& pl, int rank, const ModelConfig& c, int64_t b, DType dt,
                                        Recompute rc, int tp = 1, bool sp = false) {
  const double tokens = double(b) * c.seq, e = dtype_size(dt) * (sp ? 1.0 / tp : 1.0);
  // Bytes per token: a layer's saved set under the recompute mode, its complete set, its output
  // (the next layer's input, [b·s, h]), its deferred set between B and W, the extra inside its B.
  const double saved = layer_activation_bytes(c, dt, rc, tp, sp);
  const double complete = layer_activation_bytes(c, dt, Recompute::None, tp, sp), output = c.dim * e;
  const DeferredSet ds = deferred_set_per_token(c, dt, tp, sp);
  const double deferred = ds.total(), in_b = deferred_b_peak_per_token(ds);
  double peak = 0, held = 0;  // bytes per token held by chunks in flight
  for (const Action& a : pl.actions[size_t(rank)]) {
    if (!is_compute(a.op)) continue;
    const bool last = pl.stage(rank, a.chunk) == pl.K() - 1;
    const int k = pl.stage(rank, a.chunk);
    const double n = pl.layers[size_t(k)];
    if (a.op == Op::F) {
      // An output the stage before left on this rank (a turn of the placement) is now the first layer's input.
      if (k > 0 && stage_rank(pl, k - 1) == rank) held -= output;
      peak = std::max(peak, held + (n - 1) * saved + complete + output);
      if (last) peak = std::max(peak, held + n * saved + head_activation_bytes(c, dt, tp, sp));
      held += n * saved;
      // Not sent: the output waits here for the next stage's F, whatever runs in between.
      if (!last && stage_rank(pl, k + 1) == rank) held += output;
    } else if (a.op == Op::B && splits_backward(pl.schedule)) {
      held -= n * saved;
      // Inside the B of the chunk's i-th layer from the top: n − 1 − i layers still saved, i deferred.
      for (int i = 0; i < int(n); i++)
        peak = std::max(peak, held + (n - 1 - i) * saved + i * deferred + complete + in_b);
      held += n * deferred;
    } else {
      held -= a.op == Op::B ? n * saved : n * deferred;
    }
  }
  return tokens * peak;
}

// p2p wire bytes a rank sends per step: one [b·s, h] activation per micro-batch and chunk to
// the next stage, one gradient of the same size to the previous one (the playbook's s·b·h per
// micro-batch each way), except past the ends of the pipeline.
// token_share: the part of a micro-batch's tokens a rank's residual stream holds (1/tp under
// 04's sequence parallelism).
inline double p2p_tensor_bytes(const ModelConfig& c, int64_t b, DType dt, double token_share) {
  return double(b) * c.seq * token_share * c.dim * dtype_size(dt);  // [b·s, h]
}
inline double predict_send_bytes(const ModelConfig& c, int64_t b, DType dt, int p, int m, int V, int rank,
                                 double token_share = 1.0) {
  if (p == 1) return 0;
  const double tensor_bytes = p2p_tensor_bytes(c, b, dt, token_share);
  // m·V of each, less the last virtual stage's activations and the first's gradients (rank p − 1's
  // and rank 0's last and first chunks: they have no next or previous stage).
  const double acts = double(m) * V - (rank == p - 1 ? m : 0), grads = double(m) * V - (rank == 0 ? m : 0);
  return (acts + grads) * tensor_bytes;
}
// The same counted off the plan's lists, which any placement has: under DualPipeV the ranks at the
// ends send 2m tensors (rank 0's last stage and rank p − 1's turn send nothing on), the others 4m.
inline double predict_send_bytes(const ModelConfig& c, int64_t b, DType dt, const Plan& pl, int rank,
                                 double token_share = 1.0) {
  int sends = 0;
  for (const Action& a : pl.actions[size_t(rank)]) sends += is_send(a.op);
  return sends * p2p_tensor_bytes(c, b, dt, token_share);
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------

// p2p calls per step: an activation and a gradient per micro-batch and chunk.
inline double p2p_calls(double micro_batches, int V) { return 2 * micro_batches * V; }

// The pipeline's terms: the busiest rank's layers set the pace (t_compute, set before for L/p
// layers, scaled by its share: 1 when even; t_tp, set before, is already that rank's); the
// simulated bubble idles its compute and its tp collectives alike; the busiest stage's sends (a
// middle one) wait on the critical path. token_share as predict_send_bytes takes it.
inline void price_pipeline(StepTerms& s, const Network& net, const RunConfig& rc, const SimulatedPlan& pl,
                           double token_share, double micro_batches, int nodes) {
  s.t_compute *= pl.busiest_share();
  s.bubble = pl.bubble();
  s.t_bubble = s.bubble * (s.t_compute + s.t_tp);
  double send = 0;
  for (int r = 0; r < pl.p; r++)
    send = std::max(send, predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, r, token_share));
  s.t_pp = collective_seconds(net, Collective::P2P, send, p2p_calls(micro_batches, pl.V), nodes);
}

// This run's step: each stage computes its 1/p of the layers; then the bubble and the sends. The
// gradients are complete only after the flush, so no reduction could hide behind backward.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, const Plan& pl) {
  StepTerms s = compute_terms(g, rc, 1, 1, pl.p, pl.p);
  if (pl.p > 1) price_pipeline(s, g.net, rc, simulate(pl), 1.0, double(rc.batch) / rc.micro_batch, 1);
  s.total();
  return s;
}

// What the memory table's comm row holds: copies of sends not yet known to be received, which
// only lists that cannot post each send with its receive keep (the executor's flush()).
inline std::string comm_holds(const Plan& pl) {
  if (completes_under_rendezvous(pl)) return "";
  return "copies of the sends still in flight (" + std::string(schedule_name(pl.schedule)) + ")";
}

// What the lab prints for a schedule beyond the others' (05b_dualpipev.cu adds DualPipeV's): lines
// beside the bubble line, and a second plan charted under the first, with its heading.
struct PrintsAlso {
  void (*beside_bubble)(RunLog& log, const SimulatedPlan& pl) = nullptr;
  SimulatedPlan (*chart_also)(const SimulatedPlan& pl) = nullptr;
  const char* chart_also_heading = "";
};
// By schedule; a function-local static, as the chapter's registry (schedules()) is.
inline std::map<Schedule, PrintsAlso>& prints_also() {
  static std::map<Schedule, PrintsAlso> all;
  return all;
}

// The simulated bubble against its formula, and what the schedule's own file adds beside it.
inline void log_bubble(RunLog& log, const SimulatedPlan& pl) {
  log.line("bubble (idle / compute): simulated %.4f, formula %.4f", pl.bubble(),
           bubble_formula(pl.schedule, pl.p, pl.m, pl.V));
  if (const PrintsAlso& also = prints_also()[pl.schedule]; also.beside_bubble) also.beside_bubble(log, pl);
}

}  // namespace pp
#endif  // TS_LAB_05_PIPELINE_PARALLEL_H
