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
// --dispatch picks how the rows travel: flat (this file) or a dispatch that a file read after this
// one registers (add_dispatch). The flat one replaces MoeBlock's experts_forward/experts_backward;
// one that weights and sums where the experts are replaces routed_forward/routed_backward (moe.h).
//
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 2 --experts 4 --top-k 2
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 4 --experts 8 --top-k 2 --expert-ffn 32 --shared-experts 1 --router sigmoid --routed-scaling 2.5 --expert-groups 4 --group-limit 2
//   ./build/07_expert_parallel --dry-run --preset 8b --vocab 32000 --experts 8 --top-k 2 --dp 8 --ep 8 --batch 8 --dtype bf16
// (the last: Mixtral 8x7B's shape, Llama-3-8B's layers with 8 experts and a 32000-token vocabulary)
#ifndef TS_07_EXPERT_PARALLEL_CU
#define TS_07_EXPERT_PARALLEL_CU
#include <functional>
#include <map>

#include "02_data_parallel.cu"
#include "model/mlp_block.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/report.h"
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
// combine's weighting are the base block's (common/model/moe.cu): only where the experts run
// changes. A token's rows: router (MoeBlock::forward) → dispatch → experts → combine (below) →
// the gate-weighted sum (MoeBlock::routed_forward's moe_combine).
class ExpertParallelMoe : public MoeBlock {
 public:
  // node_of_rank: the node of each rank of `group` (mesh.h's node_of_ranks), for the bytes that
  // would cross nodes.
  ExpertParallelMoe(const Model& m, Comm& group, std::vector<int> node_of_rank)
      : MoeBlock(m), ep_(group), node_(std::move(node_of_rank)) {
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
    EpActs& s = acts<EpActs>(a);
    s.recv_counts = recv_c;
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(recv_c.i32(), recv_c.i32() + E), P, per_);
    tally(xc, m, E);
    // x holds this rank's N·K routed rows; balanced routing brings in as many for its experts.
    busiest_rows = std::max(busiest_rows, double(xc.grouped.size()) / double(std::max<int64_t>(1, x.size(0))));
    Tensor recv = rows(m, xc.grouped.size(), Tag::Workspace);
    dispatch(recv, x, xc, "dispatch");
    Tensor xr = rows(m, xc.grouped.size(), Tag::Activations);
    moe_gather(xr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    s.in = xr;
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
    const EpActs& s = acts<EpActs>(a);
    const Tensor& rc = s.recv_counts;
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(rc.i32(), rc.i32() + E), ep_.size(), per_);
    tally(xc, m, 0);
    const int64_t R = int64_t(xc.grouped.size());
    Tensor recv = rows(m, R, Tag::Workspace), dr = rows(m, R, Tag::Workspace), dxr = rows(m, R, Tag::Workspace);
    dispatch(recv, dout, xc, "dispatch backward");
    moe_gather(dr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    run_experts_backward(m, l, ep_.rank() * per_, xc.local_counts, s.in, dr, dxr, a);
    moe_gather(recv, dxr, from_host_i32(xc.ungrouped, m.dev), Tensor());
    combine(dx, recv, xc, "combine backward");
  }

  // Wire bytes this rank's all-to-alls send, from the routing counts (the measured bytes exactly);
  // over predict_balanced_bytes it is the routing's imbalance factor.
  double routed_bytes = 0;
  // Of routed_bytes, those to and from ep ranks on another node (the topology's, from mesh.h's
  // node_of_ranks): what would cross the inter-node network (InfiniBand) on a cluster.
  double inter_node_bytes = 0;
  // The most rows this rank's experts received in one layer's forward, over balanced routing's N·K:
  // the expert activations it saves grow by this factor over the balanced prediction.
  double busiest_rows = 0;

 protected:
  // What the flat dispatch saves beyond the base block's: the rows each peer sent to each of this
  // rank's experts ([peer][expert], the counts all-to-all's), to rebuild the exchange backward.
  struct EpActs : MoeActs {
    Tensor recv_counts;  // CPU int32 [E] (Tag::Comm)
  };
  std::shared_ptr<MoeActs> new_acts() const override { return std::make_shared<EpActs>(); }

  // One all-to-all_v of rows of D elements over `c`: in_rows[p] rows of `in` to peer p, out_rows[p]
  // from it into `out` (07b_overlap_a2a.cu's hands over to the other micro-batch while it travels).
  virtual void exchange(Comm& c, const Tensor& out, const std::vector<int64_t>& out_rows, const Tensor& in,
                const std::vector<int64_t>& in_rows, const char* what) {
    TraceScope t(c.name() + " all_to_all_v (" + what + ")", Lane::Comm);
    const int64_t D = in.size(1);
    c.all_to_all_v(out, elems(out_rows, D), in, elems(in_rows, D));
  }
  Tensor rows(const Model& m, size_t n, Tag tag) const {
    return Tensor::empty({int64_t(n), m.cfg.dim}, m.dtype, m.dev, tag);
  }
  std::vector<int64_t> elems(const std::vector<int64_t>& r, int64_t D) const {
    std::vector<int64_t> v;
    for (int64_t n : r) v.push_back(n * D);
    return v;
  }
  Comm& ep_;
  int per_ = 1;

 private:
  void dispatch(const Tensor& recv, const Tensor& send, const Exchange& xc, const char* what) {
    exchange(ep_, recv, xc.recv_rows, send, xc.send_rows, what);
  }
  void combine(const Tensor& out, const Tensor& back, const Exchange& xc, const char* what) {
    exchange(ep_, out, xc.send_rows, back, xc.recv_rows, what);
  }
  // One dispatch and one combine: the rows sent to and received from the other ranks, each a row
  // of D elements; plus the counts exchange (E/ep int32 to each other rank) when count_ints = E.
  void tally(const Exchange& xc, const Model& m, int count_ints) {
    for (int p = 0; p < ep_.size(); p++) {
      if (p == ep_.rank()) continue;
      const double rows_out = double(xc.send_rows[size_t(p)] + xc.recv_rows[size_t(p)]);
      const double b = rows_out * m.cfg.dim * dtype_size(m.dtype) + double(count_ints) / ep_.size() * 4;
      routed_bytes += b;
      if (node_[size_t(p)] != node_[size_t(ep_.rank())]) inter_node_bytes += b;
    }
  }
  const std::vector<int> node_;  // [P] the node of each ep rank
};

// Installs a block into a model built with the ep shard spec; the flat one over `group`.
inline ExpertParallelMoe& install(Model& m, ExpertParallelMoe* b) {
  m.mlp.reset(b);
  return *b;
}
inline ExpertParallelMoe& install(Model& m, Comm& group, const std::vector<int>& node_of_rank) {
  return install(m, new ExpertParallelMoe(m, group, node_of_rank));
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

// ----- the dispatches (--dispatch) -----------------------------------------------------------------

// One way for the rows to reach their experts' ranks: `place`, before the model is built and
// collective over the world, checks the ep group's nodes (node_of_ranks) for it and returns this
// rank's expert slot (it holds experts [slot·E/ep, (slot+1)·E/ep)); `install` puts its block into
// the model built so. This file's is "flat"; a file read after it may add its own (add_dispatch,
// from a C++17 inline variable: once per program however many files include it).
struct Dispatch {
  std::string name, help;  // help: "NAME: what it does", for --dispatch's help
  std::function<int(RunLog& log, Mesh& mesh, const ModelConfig& m, const std::vector<int>& nodes)> place;
  std::function<ExpertParallelMoe&(Model& m, Comm& group, const std::vector<int>& nodes)> install;
};
inline std::vector<Dispatch>& dispatches() {
  static std::vector<Dispatch> all{{"flat", "flat: one all-to-all over the ep group",
                                    [](RunLog&, Mesh& mesh, const ModelConfig&, const std::vector<int>&) {
                                      return mesh.ep_rank;  // ep rank p holds experts [p·E/ep, (p+1)·E/ep)
                                    },
                                    [](Model& m, Comm& group, const std::vector<int>& nodes) -> ExpertParallelMoe& {
                                      return install(m, group, nodes);
                                    }}};
  return all;
}
inline bool add_dispatch(Dispatch d) {
  dispatches().push_back(std::move(d));
  return true;
}

// What each registered dispatch does, for --dispatch's help.
inline std::string dispatch_help() {
  std::string h;
  for (const Dispatch& d : dispatches()) h += (h.empty() ? "" : "; ") + d.help;
  return h;
}

// --dispatch NAME, one of the registered dispatches (refused otherwise). `help` says what the flag
// does in the program that reads it.
inline const Dispatch& read_dispatch(Args& a, const std::string& help) {
  const std::string d = a.get_str("--dispatch", "flat", help);
  std::string names;
  const std::vector<Dispatch>& all = dispatches();
  for (size_t i = 0; i < all.size(); i++) {
    if (all[i].name == d) return all[i];
    names += (i == 0 ? "" : i + 1 == all.size() ? " or " : ", ") + all[i].name;
  }
  config_error("--dispatch must be %s (got '%s')", names.c_str(), d.c_str());
}

// The nodes the ep group spans, as MPI reports them (mesh.h's node_of_ranks; collective over the
// world): an all-to-all between ranks of two nodes crosses the inter-node network, one inside a
// node stays on its NVLink.

inline std::vector<int> report_nodes(RunLog& log, Comm& group) {
  const std::vector<int> nodes = node_of_ranks(group);
  std::string each;
  for (int n : nodes) each += " " + std::to_string(n);
  log.line("ep group: %d ranks on %d node(s) (MPI_COMM_TYPE_SHARED); node of each ep rank:%s", group.size(),
           *std::max_element(nodes.begin(), nodes.end()) + 1, each.c_str());
  return nodes;
}

// ----- how a step's micro-batches run (--overlap-a2a) ----------------------------------------------
// One after another here. A file read after this one may register a schedule that interleaves
// them (07b_overlap_a2a.cu): its flag, its checks, its MoE block, and `run`, which runs micro-batch
// i by one(i) and calls resume(i) each time micro-batch i goes on (the reducers' sync is its own).
struct Schedule {
  std::string flag, help;
  std::function<void(const RunConfig&, const MeshConfig&, const Dispatch&)> validate;
  std::function<ExpertParallelMoe&(Model& m, Comm& group, const std::vector<int>& nodes)> install;
  std::function<void(int n, const std::function<void(int)>& resume, const std::function<void(int)>& one)> run;
  std::function<void(StepTerms&)> step_time;  // what it hides of the predicted step (lab)
  int live_microbatches = 1;                  // whose activations are alive at once (the memory predicted)
};
inline std::vector<Schedule>& schedules() {
  static std::vector<Schedule> s;
  return s;
}
inline bool add_schedule(Schedule s) {
  schedules().push_back(std::move(s));
  return true;
}
inline const Schedule* read_schedule(Args& a) {
  const Schedule* on = nullptr;
  for (const Schedule& s : schedules())
    if (a.get_bool(s.flag, s.help)) on = &s;
  return on;
}

// ----- the lab (lab/07_expert_parallel.cu, read after this file) ----------------------------------
// The plan and the memory predicted before the run; after it, the all-to-all bytes against the
// balanced prediction and this run's routing, both reductions' bytes; the step time predicted at
// the imbalance the run's routing shows (it tallies the loads of `loop.step`, set before).
void print_plan(RunLog& log, const RunConfig& rc, int dp, int ep, const Schedule* schedule = nullptr);
MemoryPrediction predict_memory(const RunConfig& rc, int ep, const Schedule* schedule = nullptr);
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, ExpertParallelMoe& moe,
                 const Schedule* schedule = nullptr);
std::function<StepTerms(const Gpu&)> predictor(Loop& loop, const RunConfig& rc, int dp, int ep, double bucket_mb,
                                                const ExpertParallelMoe& moe, const Schedule* schedule = nullptr);
}  // namespace ep

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 7
using namespace ts;

static const char* kDoc =
    "07_expert_parallel: expert parallelism for the mixture-of-experts model: experts sharded over --ep ranks,\n"
    "tokens dispatched and combined with all-to-all, dense weights data-parallel.\n"
    "usage: mpirun -np N 07_expert_parallel --dp N --ep E --experts X [--top-k K] [flags]";

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

// Like 02: this rank's contiguous slice of the global batch in micro-batches, only the last one
// reducing. The gradient norm counts the dense tensors once (ep rank 0) and each expert on its
// owner, summed over the ep group (every ep group holds the same reduced values).
static StepResult train_step(Model& model, AdamW& opt, Reducers& reducers, const TokenData& data, const RunConfig& rc,
                             Mesh& mesh, long step, const ep::Schedule* schedule) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp, n = local / mb;
  ts::zero(model.grads);
  const auto resume = [&](int i) { reducers.set_sync(i + 1 == n); };
  const auto one = [&](int i) {
    MicroBatch b = make_microbatch(data, step, rc.batch, T, mesh.dp_rank * local + i * mb, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
  };
  if (schedule) schedule->run(n, resume, one);
  else
    for (int i = 0; i < n; i++) resume(i), one(i);
  reducers.finish();
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {mesh.ep().mpi()});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  StepResult r{global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.dp().mpi()}), norm};
  moe_step_report(model, r, {mesh.dp().mpi()}, opt.master);  // the bias from every rank's loads
  return r;
}

// The first ep group writes the checkpoint: each expert by its owner, the dense tensors by ep rank
// 0, the copies that count, all at their global offsets.
static void save(const RunConfig& rc, Mesh& mesh, Model& model, AdamW& opt, long step) {
  std::vector<CheckpointSlice> mine;
  if (mesh.dp_rank < mesh.cfg.ep) mine.push_back({0, model.table.total, weights_f32(model.params, opt), &opt});
  Json m = Json::object();
  m["dp"] = mesh.cfg.dp;
  m["ep"] = mesh.cfg.ep;
  save_checkpoint(rc.save_dir, rc, model.table, mine, step, m);
}

// The chapter's flags: the dp degree, the ep degree within it, the bucket size, the dispatch.
struct EpFlags {
  double bucket_mb = 25;
  const ep::Dispatch* dispatch = nullptr;
  const ep::Schedule* schedule = nullptr;  // --overlap-a2a (07b_overlap_a2a.cu), or null: one after another
};
static EpFlags read_ep_flags(Args& args, MeshConfig& mc) {
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  mc.ep = args.get_int("--ep", 1, "expert-parallel degree: experts sharded over groups of this many dp ranks",
                       degree_range());
  EpFlags f;
  f.bucket_mb = args.get_double("--bucket-mb", 25, "gradient bucket size in MiB", dp::bucket_mb_range());
  f.dispatch = &ep::read_dispatch(args, ep::dispatch_help());
  f.schedule = ep::read_schedule(args);
  return f;
}

// 07's checks, then a registered schedule's (--overlap-a2a's), before any collective; the plan and
// the memory predicted. False after --dry-run.
static bool start(TrainingRun& run, const EpFlags& f) {
  ep::validate(run.rc, run.mc);
  if (f.schedule) f.schedule->validate(run.rc, run.mc, *f.dispatch);
  const ep::Schedule* s = f.schedule;
  return run.start([&run, s] { ep::print_plan(run.log(), run.rc, run.mc.dp, run.mc.ep, s); },
                   [&run, s] { return ep::predict_memory(run.rc, run.mc.ep, s); });
}

int main(int argc, char** argv) {
  EpFlags f;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { f = read_ep_flags(a, mc); });
  RunConfig& rc = run.rc;
  const MeshConfig& mc = run.mc;
  if (!start(run, f)) return 0;
  const std::vector<int> nodes = ep::report_nodes(run.log(), run.mesh.ep());  // its experts placed by them:
  Model& model = run.build_model({ep::shard_spec(mc.ep, f.dispatch->place(run.log(), run.mesh, rc.model, nodes))});
  ep::ExpertParallelMoe& moe = (f.schedule ? f.schedule->install : f.dispatch->install)(model, run.mesh.ep(), nodes);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);  // each rank initialises (or loads) its experts and the dense weights
  Reducers reducers(model, run.mesh, f.bucket_mb);
  Loop loop;
  loop.step = [&](long step) { return train_step(model, opt, reducers, run.data, rc, run.mesh, step, f.schedule); };
  loop.save = [&](long step) { save(rc, run.mesh, model, opt, step); };
  ep::add_reports(loop, run.log(), rc, run.mesh, moe, f.schedule);
  return run.train(loop, ep::predictor(loop, rc, mc.dp, mc.ep, f.bucket_mb, moe, f.schedule), "dp");
}
#endif  // TS_PROGRAM == 7
#endif  // TS_07_EXPERT_PARALLEL_CU
