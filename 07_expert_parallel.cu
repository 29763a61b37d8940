// 07_expert_parallel.cu — expert parallelism: the experts of a mixture-of-experts model are
// spread over the --ep ranks of each expert-parallel group, and tokens travel to their experts.
//
// The playbook's expert-parallel chapter, runnable, on the Mixtral-style model of 01 --experts.
// Every rank trains on its dp slice of the global batch (world = dp) and holds E/ep experts of
// every layer; the dense weights (attention, norms, embeddings, routers) are replicated. In each
// MoE layer a rank routes its own tokens, then
//   dispatch  all-to-all of variable counts (the counts are exchanged first): each token row goes
//             to the rank that owns its expert;
//   experts   the owner runs each of its experts over every row it received, grouped per expert
//             in global token order (the order 01 uses);
//   combine   a second all-to-all returns the outputs to the tokens' ranks, which weight and sum.
// Where the rest of the chapter lives: this file moves rows; what decides them is 01's MoE block,
// unchanged (common/model/moe.cu, declared with its formulas in common/model/moe.h):
//   routing   moe_router_forward: fp32 softmax over the E router logits, top-k (ties to the lower
//             index), the k weights renormalised to sum to 1 (Mixtral's router);
//   grouping  make_routing_plan: each expert's rows in token order, and the counts sent first;
//   capacity  expert_capacity: at most floor(c·T·K/E) rows per expert and sequence (--capacity-
//             factor c; 0 = dropless), the earliest tokens kept, a dropped one keeps its residual;
//   aux loss  aux_per_sequence: E · Σ_e f_e · P_e per sequence and layer (Switch Transformer eq. 4),
//             added to the loss with weight --aux-loss-coef α;
//   combine   moe_combine: y[t] = Σ_k w[t,k] · expert_{i(t,k)}(h[t]).
// DeepSeekMoE as DeepSeek-V3 trains it (moe.h's header; notes/07_expert_parallel.md) changes none
// of this file: its shared experts (--shared-experts) are dense and run where the tokens are; its
// sigmoid router (--router sigmoid, moe_router_sigmoid_forward) picks by the biased scores, within
// the --group-limit best of --expert-groups groups (a group of E/G consecutive experts: at G = ep
// one rank, so a token's rows go to at most M ranks); and the selection-only bias moves after each
// step by the loads summed over every dp rank (moe_step_report, MoeBlock::update_bias), the same
// on every rank and every mesh.
// Backward mirrors it: the output gradients are dispatched, the input gradients combined. Dense
// gradients are averaged over all dp ranks; an expert's over the dp/ep ranks that hold it (the
// mesh's ep_dp group), both with 02's bucketed reducer.
//
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 2 --experts 4 --top-k 2
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 4 --experts 8 --top-k 2 --expert-ffn 32 --shared-experts 1 --router sigmoid --routed-scaling 2.5 --expert-groups 4 --group-limit 2
//   ./build/07_expert_parallel --dry-run --preset 8b --vocab 32000 --experts 8 --top-k 2 --dp 8 --ep 8 --batch 8 --dtype bf16
// (the last: Mixtral 8x7B's shape, Llama-3-8B's layers with 8 experts and a 32000-token vocabulary)
#ifndef TS_07_EXPERT_PARALLEL_CU
#define TS_07_EXPERT_PARALLEL_CU
#include <map>

#include "02_data_parallel.cu"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/run.h"
#include "training/step_time.h"
#include "training/train.h"

namespace ep {
using namespace ts;

// ----- dispatch and combine ------------------------------------------------------------------------

// Who sends what: rank p of the ep group owns experts [p·per, (p+1)·per). The routing plan groups
// this rank's rows by global expert, so the rows for peer p are one contiguous block.
struct Exchange {
  std::vector<int64_t> send_rows, recv_rows;  // [P] rows to / from each peer
  std::vector<int64_t> local_counts;          // [per] rows each local expert received
  std::vector<int32_t> grouped;               // received row of each grouped row ([expert][peer] order)
  std::vector<int32_t> ungrouped;             // grouped row of each received row
};

// recv_counts[p·per + i]: rows peer p sends to local expert i ([peer][expert] order as received).
inline Exchange plan_exchange(const std::vector<int64_t>& counts, const std::vector<int32_t>& recv_counts, int P,
                              int per) {
  Exchange x;
  x.send_rows.assign(size_t(P), 0);
  x.recv_rows.assign(size_t(P), 0);
  x.local_counts.assign(size_t(per), 0);
  std::vector<int64_t> at(size_t(P) * per);  // where (peer, expert) starts in the received rows
  int64_t off = 0;
  for (int p = 0; p < P; p++)
    for (int i = 0; i < per; i++) {
      x.send_rows[size_t(p)] += counts[size_t(p) * per + i];
      const int64_t n = recv_counts[size_t(p) * per + i];
      x.recv_rows[size_t(p)] += n;
      x.local_counts[size_t(i)] += n;
      at[size_t(p) * per + i] = off;
      off += n;
    }
  x.ungrouped.assign(size_t(off), 0);
  for (int i = 0; i < per; i++)
    for (int p = 0; p < P; p++)
      for (int64_t r = 0; r < recv_counts[size_t(p) * per + i]; r++) {
        x.ungrouped[size_t(at[size_t(p) * per + i] + r)] = int32_t(x.grouped.size());
        x.grouped.push_back(int32_t(at[size_t(p) * per + i] + r));
      }
  return x;
}

// The MoE block with its experts behind two all-to-alls. Routing, capacity, the aux loss and the
// combine's weighting are the base block's: only where the experts run changes.
class ExpertParallelMoe : public MoeBlock {
 public:
  ExpertParallelMoe(const Model& m, Comm& group) : MoeBlock(m), ep_(group) {
    keeps_input_ = false;  // the owner keeps the rows it received instead
    per_ = m.cfg.experts / group.size();
  }

  Tensor experts_forward(Model& m, int l, const Tensor& x, const std::vector<int64_t>& counts, LayerActs& a) override {
    const int P = ep_.size(), E = m.cfg.experts;
    Tensor send_c = Tensor::empty({E}, DType::I32, Device::CPU, Tag::Comm);
    Tensor recv_c = Tensor::empty({E}, DType::I32, Device::CPU, Tag::Comm);
    for (int e = 0; e < E; e++) send_c.i32()[e] = int32_t(counts[size_t(e)]);
    {
      TraceScope t("ep all_to_all (counts)", Lane::Comm);
      ep_.all_to_all(recv_c, send_c);  // counts first: each owner learns how many rows will arrive
    }
    a.mlp_state.resize(kNumSlots + 1);
    a.mlp_state[kNumSlots] = recv_c;
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(recv_c.i32(), recv_c.i32() + E), P, per_);
    tally(xc, m, E);
    // x holds this rank's N·K routed rows; balanced routing brings in as many for its experts.
    busiest_rows = std::max(busiest_rows, double(xc.grouped.size()) / double(std::max<int64_t>(1, x.size(0))));
    Tensor recv = rows(m, xc.grouped.size(), Tag::Workspace);
    dispatch(recv, x, xc, "dispatch");
    Tensor xr = rows(m, xc.grouped.size(), Tag::Activations);
    moe_gather(xr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    a.mlp_state[kIn] = xr;
    Tensor outr = rows(m, xr.size(0), Tag::Workspace);
    run_experts(m, l, ep_.rank() * per_, xc.local_counts, xr, outr, a);
    Tensor back = rows(m, xr.size(0), Tag::Workspace);
    moe_gather(back, outr, from_host_i32(xc.ungrouped, m.dev), Tensor());
    Tensor out = rows(m, x.size(0), Tag::Activations);
    combine(out, back, xc, "combine");
    return out;
  }

  void experts_backward(Model& m, int l, const Tensor& dx, const Tensor& dout, const std::vector<int64_t>& counts,
                        LayerActs& a) override {
    const int E = m.cfg.experts;
    const Tensor& rc = a.mlp_state[kNumSlots];
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(rc.i32(), rc.i32() + E), ep_.size(), per_);
    tally(xc, m, 0);
    const int64_t R = int64_t(xc.grouped.size());
    Tensor recv = rows(m, R, Tag::Workspace), dr = rows(m, R, Tag::Workspace), dxr = rows(m, R, Tag::Workspace);
    dispatch(recv, dout, xc, "dispatch backward");
    moe_gather(dr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    run_experts_backward(m, l, ep_.rank() * per_, xc.local_counts, a.mlp_state[kIn], dr, dxr, a);
    moe_gather(recv, dxr, from_host_i32(xc.ungrouped, m.dev), Tensor());
    combine(dx, recv, xc, "combine backward");
  }

  // Wire bytes this rank's all-to-alls send, from the routing counts (the measured bytes exactly);
  // over predict_balanced_bytes it is the routing's imbalance factor.
  double routed_bytes = 0;
  // The most rows this rank's experts received in one layer's forward, over balanced routing's N·K:
  // the expert activations it saves grow by this factor over the balanced prediction.
  double busiest_rows = 0;

 private:
  Tensor rows(const Model& m, size_t n, Tag tag) const {
    return Tensor::empty({int64_t(n), m.cfg.dim}, m.dtype, m.dev, tag);
  }
  std::vector<int64_t> elems(const std::vector<int64_t>& r, int64_t D) const {
    std::vector<int64_t> v;
    for (int64_t n : r) v.push_back(n * D);
    return v;
  }
  void dispatch(const Tensor& recv, const Tensor& send, const Exchange& xc, const char* what) {
    TraceScope t(std::string("ep all_to_all_v (") + what + ")", Lane::Comm);
    const int64_t D = send.size(1);
    ep_.all_to_all_v(recv, elems(xc.recv_rows, D), send, elems(xc.send_rows, D));
  }
  void combine(const Tensor& out, const Tensor& back, const Exchange& xc, const char* what) {
    TraceScope t(std::string("ep all_to_all_v (") + what + ")", Lane::Comm);
    const int64_t D = back.size(1);
    ep_.all_to_all_v(out, elems(xc.send_rows, D), back, elems(xc.recv_rows, D));
  }
  // One dispatch and one combine: the rows sent to and received from the other ranks, each a row
  // of D elements; plus the counts exchange (E/ep int32 to each other rank) when count_ints = E.
  void tally(const Exchange& xc, const Model& m, int count_ints) {
    double rows_out = 0;
    for (int p = 0; p < ep_.size(); p++)
      if (p != ep_.rank()) rows_out += double(xc.send_rows[size_t(p)] + xc.recv_rows[size_t(p)]);
    routed_bytes += rows_out * m.cfg.dim * dtype_size(m.dtype);
    routed_bytes += double(count_ints) / ep_.size() * (ep_.size() - 1) * 4;
  }
  Comm& ep_;
  int per_ = 1;
};

// Installs the expert-parallel MoE block into a model built with the ep shard spec.
inline ExpertParallelMoe& install(Model& m, Comm& group) {
  auto* b = new ExpertParallelMoe(m, group);
  m.mlp.reset(b);
  return *b;
}

// The flat ranges of dense and of expert gradients: each layer's held experts are one run.
inline void split_ranges(const ParamTable& t, std::vector<std::pair<int64_t, int64_t>>& dense,
                         std::vector<std::pair<int64_t, int64_t>>& experts) {
  for (const ParamEntry& e : t.entries) {
    if (e.numel == 0) continue;
    auto& v = is_expert_param(e) ? experts : dense;
    if (!v.empty() && v.back().second == e.offset) v.back().second = e.offset + e.numel;
    else v.push_back({e.offset, e.offset + e.numel});
  }
}

inline ShardSpec shard_spec(int ep, int ep_rank) {
  ShardSpec s;
  s.ep = ep;
  s.ep_rank = ep_rank;
  return s;
}

inline void validate(const RunConfig& rc, const MeshConfig& mc) {
  const ModelConfig& m = rc.model;
  if (m.experts < 1) config_error("07_expert_parallel needs a mixture of experts: pass --experts E (and --top-k K)");
  if (mc.ep < 1) config_error("--ep must be >= 1 (got %d)", mc.ep);
  if (m.experts % mc.ep) config_error("--experts %d is not divisible by --ep %d", m.experts, mc.ep);
  if (mc.dp % mc.ep) config_error("--ep %d does not divide --dp %d (expert-parallel groups are cut from the dp ranks)", mc.ep, mc.dp);
}

// ----- predict: memory and bytes per rank ----------------------------------------------------------

struct ParamSplit {
  int64_t dense, experts;  // parameters this rank holds
};
// Of any rank's table.
inline ParamSplit param_split(const ParamTable& t) {
  ParamSplit s{0, 0};
  for (const ParamEntry& e : t.entries) (is_expert_param(e) ? s.experts : s.dense) += e.numel;
  return s;
}
inline ParamSplit param_split(const RunConfig& rc, int ep) { return param_split(Model::make_table(rc.model, 1, shard_spec(ep, 0))); }

// What the memory table's comm row holds (Tag::Comm): the counts, not the rows (those are activations).
inline std::string comm_holds(int ep) { return ep > 1 ? "the per-expert row counts exchanged before each all-to-all" : ""; }

inline MemoryPrediction predict_memory(const RunConfig& rc, int ep) {
  const ParamSplit s = param_split(rc, ep);
  MemoryPrediction p = predict_states(s.dense + s.experts, s.dense + s.experts, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);  // balanced routing
  p.comm_also_holds(comm_holds(ep));
  return p;
}

// Balanced routing: of a micro-batch's N·K routed rows, (ep−1)/ep go to other ranks in the
// dispatch and as many come back in the combine; backward repeats both, and full recompute reruns
// the forward's pair. Plus E/ep int32 counts to each other rank per layer forward.
inline double predict_balanced_bytes(const RunConfig& rc, int dp, int ep) {
  const ModelConfig& m = rc.model;
  const double f = (ep - 1.0) / ep, mbs = double(rc.batch / dp) / rc.micro_batch, full = rc.recompute == Recompute::Full;
  const double rows = 2 * f * double(rc.micro_batch) * m.seq * m.top_k * (2 + full);
  const double counts = (1 + full) * (ep - 1.0) * (m.experts / ep) * 4;
  return mbs * m.layers * (rows * m.dim * dtype_size(rc.dtype) + counts);
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// All-to-all calls per step: per layer a dispatch and a combine forward, and both again backward.
inline double all_to_all_calls(double micro_batches, double layers) { return micro_batches * layers * 4; }

// 07's dispatch as the MoE term's levels: one flat all-to-all over the ep group, `bytes` per rank
// and step (predict_balanced_bytes' for the layers priced), 4 calls per layer and micro-batch.
inline std::vector<DispatchLevel> flat_dispatch(double bytes, double micro_batches, double layers, int nodes) {
  return {{bytes, all_to_all_calls(micro_batches, layers), nodes}};
}

// The MoE term's shape (common/training/step_time.h) for a rank of dp that runs `layers` of the
// model's MoE layers: its tokens, the routing imbalance its experts are priced at, its dispatch.
inline MoeShape moe_shape(const RunConfig& rc, int dp, int ep, double layers, double imbalance,
                          std::vector<DispatchLevel> dispatch) {
  MoeShape x;
  x.tokens = double(rc.batch) / dp * rc.model.seq;
  x.layers = layers;
  x.ep = ep;
  x.imbalance = imbalance;
  x.dispatch = std::move(dispatch);
  return x;
}

// The routing imbalance as the step feels it, from the loads every step's report sums over the dp
// ranks (moe_tokens_per_expert, [layer][expert]): each layer's all-to-all waits for the ep rank
// whose experts received the most rows, so per step Σ_l max_p rows(l, p) / Σ_l mean_p rows(l, p),
// averaged over the steps after this process's first (the warm-up the measured median leaves
// out). With dp > ep the dp/ep groups' loads are summed first: their sum stands for each group.
struct RoutedLoads {
  RoutedLoads(const ModelConfig& m, int ep) : m(m), ep(ep) {}
  const ModelConfig& m;
  const int ep;
  double sum = 0;
  long steps = 0, seen = 0;
  // A training step that also tallies its loads.
  std::function<StepResult(long)> tally(std::function<StepResult(long)> step) {
    return [this, step](long s) {
      StepResult r = step(s);
      add(r);
      return r;
    };
  }
  void add(const StepResult& r) {
    if (seen++ == 0 || !r.extra.contains("moe_tokens_per_expert")) return;
    const auto& v = r.extra.at("moe_tokens_per_expert").as_array();
    const int E = m.experts, per = E / ep;
    double busiest = 0, balanced = 0;
    for (int l = 0; l < m.layers; l++) {
      double most = 0, all = 0;
      for (int p = 0; p < ep; p++) {
        double rows = 0;
        for (int i = 0; i < per; i++) rows += v[size_t(l * E + p * per + i)].as_double();
        most = std::max(most, rows);
        all += rows;
      }
      busiest += most;
      balanced += all / ep;
    }
    if (balanced > 0) sum += busiest / balanced, steps++;
  }
  double imbalance() const { return steps > 0 ? sum / double(steps) : kAssumedImbalance; }
};

// This run's step: the dp ranks compute 1/dp of the tokens each, the MoE blocks as the MoE term
// prices them (the busiest rank's experts at `imbalance`; the all-to-alls on the critical path);
// the dense gradients are all-reduced over dp and each expert's over the ep_dp ranks that hold
// it, bucketed as 02 does, behind the last micro-batch's backward.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int dp, int ep, double bucket_mb,
                                   double imbalance = kAssumedImbalance) {
  StepTerms s = compute_terms(g, rc, 1, 1, 1, dp);
  const int L = rc.model.layers;
  const double mbs = double(rc.batch) / dp / rc.micro_batch;
  add_moe_term(s, g, rc, moe_shape(rc, dp, ep, L, imbalance, flat_dispatch(predict_balanced_bytes(rc, dp, ep), mbs, L, 1)));
  const ParamTable t = Model::make_table(rc.model, 1, shard_spec(ep, 0));
  const ParamSplit split = param_split(t);
  const double grad_bytes = 4.0 * double(t.total);
  const double calls = dp::reduction_calls(true, L, grad_bytes, bucket_mb);
  s.t_dp = dp::reduction_seconds(g.net, split.dense, dp, calls, 1) + dp::reduction_seconds(g.net, split.experts, dp / ep, calls, 1);
  s.t_dp_exposed = dp::exposed_seconds(true, s.t_dp, s.last_backward(mbs), grad_bytes, bucket_mb);
  s.total();
  return s;
}

// The run's prediction, priced at the imbalance its routing has shown by the time it is asked.
inline std::function<StepTerms(const Gpu&)> predictor(const RunConfig& rc, int dp, int ep, double bucket_mb,
                                                       const RoutedLoads& loads) {
  return [&rc, dp, ep, bucket_mb, &loads](const Gpu& g) {
    return predict_step_time(g, rc, dp, ep, bucket_mb, loads.imbalance());
  };
}

inline void print_plan(RunLog& log, const RunConfig& rc, int dp, int ep) {
  const ParamSplit s = param_split(rc, ep);
  const MemoryPrediction p = predict_memory(rc, ep);
  const ModelConfig& m = rc.model;
  print_model(log, m);
  const double e = dtype_size(rc.dtype);
  log.line("dp %d, ep %d: per rank %d of %d experts per layer; expert params %s, dense params %s (replicated)", dp, ep,
           m.experts / ep, m.experts, human_bytes(e * s.experts).c_str(), human_bytes(e * s.dense).c_str());
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (balanced routing)",
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str());
  const double rows = double(rc.micro_batch) * m.seq * m.top_k;
  log.line("per layer and micro-batch: N·K = %.0f routed rows of %s; balanced, (ep-1)/ep of them cross ranks: "
           "dispatch %s + combine %s forward, the same backward",
           rows, human_bytes(m.dim * e).c_str(), human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str(),
           human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str());
  log.line("per-rank all_to_all per step (balanced): %s", human_bytes(predict_balanced_bytes(rc, dp, ep)).c_str());
}

// The predictions above assume balanced routing; a real router is not. Its imbalance, from this
// run's routing counts (rank 0's): the all-to-all bytes over the balanced prediction, and the most
// rows rank 0's experts received in a layer over the balanced N·K (its MoE activations grow so).
inline void print_imbalance(RunLog& log, double balanced, double routed, double busiest_rows) {
  log.line("ep routing imbalance (this run's counts, rank 0): all_to_all %s per step = %.4f × the balanced %s;",
           human_bytes(routed).c_str(), balanced > 0 ? routed / balanced : 0.0, human_bytes(balanced).c_str());
  log.line("  its experts received up to %.2f × the balanced N·K rows in one layer, so its MoE activations can exceed "
           "the balanced prediction by up to that factor", busiest_rows);
}

}  // namespace ep

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 7
using namespace ts;

static const char* kDoc =
    "07_expert_parallel: expert parallelism for the mixture-of-experts model: experts sharded over --ep ranks,\n"
    "tokens dispatched and combined with all-to-all, dense weights data-parallel.\n"
    "usage: mpirun -np N 07_expert_parallel --dp N --ep E --experts X [--top-k K] [flags]";

// Like 02: this rank's contiguous slice of the global batch in micro-batches, only the last one
// reducing. The gradient norm counts the dense tensors once (ep rank 0) and each expert on its
// owner, summed over the ep group (every ep group holds the same reduced values).
// Two gradient reductions: the dense tensors' over every dp rank, each expert's over the ranks
// that hold a copy of it (ep_dp), one bucketed reducer each over its ranges of the flat buffer.
struct Reducers {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  Reducers(Model& m, Mesh& mesh, double bucket_mb)
      : ranges(split(m.table)),
        dense(m, mesh.dp(), true, bucket_mb, ranges.first),
        experts(m, mesh.ep_dp(), true, bucket_mb, ranges.second) {}
  void set_sync(bool sync) {
    dense.set_sync(sync);
    experts.set_sync(sync);
  }
  void finish() {
    dense.finish();
    experts.finish();
  }
  static std::pair<Ranges, Ranges> split(const ParamTable& t) {
    std::pair<Ranges, Ranges> r;
    ep::split_ranges(t, r.first, r.second);
    return r;
  }
  const std::pair<Ranges, Ranges> ranges;  // dense, experts (before the reducers that use them)
  dp::GradReducer dense, experts;
};

static StepResult train_step(Model& model, AdamW& opt, Reducers& reducers, const TokenData& data, const RunConfig& rc,
                             Mesh& mesh, long step) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp;
  ts::zero(model.grads);
  for (int s0 = 0; s0 < local; s0 += mb) {
    reducers.set_sync(s0 + mb == local);
    MicroBatch b = make_microbatch(data, step, rc.batch, T, mesh.dp_rank * local + s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
  }
  reducers.finish();
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {mesh.ep().mpi()});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  StepResult r{global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.dp().mpi()}), norm};
  moe_step_report(model, r, {mesh.dp().mpi()}, opt.master);  // the bias from every rank's loads
  return r;
}

// The loop's predicted memory (balanced routing), checkpoint and reports: the first ep group
// writes (each expert by its owner, the dense tensors by ep rank 0, the copies that count, all at
// their global offsets); the all-to-all bytes against the balanced prediction and this run's
// routing; both reductions' bytes.
static void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, Model& model, AdamW& opt,
                        ep::ExpertParallelMoe& moe) {
  loop.predicted = ep::predict_memory(rc, mesh.cfg.ep);
  loop.save = [&](long step) {
    std::vector<CheckpointSlice> mine;
    if (mesh.dp_rank < mesh.cfg.ep) mine.push_back({0, model.table.total, weights_f32(model.params, opt), &opt});
    Json m = Json::object();
    m["dp"] = mesh.cfg.dp;
    m["ep"] = mesh.cfg.ep;
    save_checkpoint(rc.save_dir, rc, model.table, mine, step, m);
  };
  loop.comm = [&](long steps_run) {
    const double n = double(std::max(1L, steps_run));
    const ep::ParamSplit split = ep::param_split(rc, mesh.cfg.ep);
    const double balanced = ep::predict_balanced_bytes(rc, mesh.cfg.dp, mesh.cfg.ep), routed = moe.routed_bytes / n;
    Json c = comm_report(log, mesh.ep(), steps_run, {{"all_to_all", balanced}});
    if (c.at("ep").contains("all_to_all")) c["ep"]["all_to_all"]["from_routing"] = routed;
    ep::print_imbalance(log, balanced, routed, moe.busiest_rows);
    Json d = comm_report(log, mesh.dp(), steps_run, {{"all_reduce", dp::allreduce_bytes(split.dense, mesh.cfg.dp)}});
    Json x = comm_report(log, mesh.ep_dp(), steps_run,
                         {{"all_reduce", dp::allreduce_bytes(split.experts, mesh.ep_dp().size())}});
    for (const Json* j : {&d, &x})
      for (const auto& [k, v] : j->items()) c[k] = v;
    return c;
  };
}

// The chapter's flags: the dp degree, the ep degree within it, the bucket size; returns the last.
static double read_ep_flags(Args& args, MeshConfig& mc) {
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  mc.ep = args.get_int("--ep", 1, "expert-parallel degree: experts sharded over groups of this many dp ranks",
                       degree_range());
  return args.get_double("--bucket-mb", 25, "gradient bucket size in MiB", dp::bucket_mb_range());
}

int main(int argc, char** argv) {
  double bucket_mb = 0;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { bucket_mb = read_ep_flags(a, mc); });
  RunConfig& rc = run.rc;
  const MeshConfig& mc = run.mc;
  ep::validate(rc, mc);
  if (!run.start([&] { ep::print_plan(run.log(), rc, mc.dp, mc.ep); }, [&] { return ep::predict_memory(rc, mc.ep); }))
    return 0;
  Model& model = run.build_model({ep::shard_spec(mc.ep, run.mesh.ep_rank)});  // its experts, every dense weight
  ep::ExpertParallelMoe& moe = ep::install(model, run.mesh.ep());
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);  // each rank initialises (or loads) its experts and the dense weights
  Reducers reducers(model, run.mesh, bucket_mb);
  Loop loop;
  ep::RoutedLoads loads(rc.model, mc.ep);  // the step-time prediction's imbalance, from this run's routing
  loop.step = loads.tally([&](long step) { return train_step(model, opt, reducers, run.data, rc, run.mesh, step); });
  add_reports(loop, run.log(), rc, run.mesh, model, opt, moe);
  return run.train(loop, ep::predictor(rc, mc.dp, mc.ep, bucket_mb, loads), "dp");
}
#endif  // TS_PROGRAM == 7
#endif  // TS_07_EXPERT_PARALLEL_CU
