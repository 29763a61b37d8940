// 03_zero.cu — ZeRO: data parallelism that shards what every DP rank would otherwise replicate.
//
// The playbook's ZeRO chapter, all three stages over --dp N ranks:
//   --zero 1  optimizer states (and the fp32 master weights under bf16) sharded: gradients are
//             reduce-scattered after backward, each rank updates its shard, and the updated
//             weights are all-gathered;
//   --zero 2  gradients sharded too: each unit's gradients are reduce-scattered during backward
//             as soon as they are complete (overlapped with the units below), so the full
//             gradient buffer is never held;
//   --zero 3  weights sharded too (FSDP-style): a unit's weights are all-gathered just before
//             its forward and again before its backward and dropped after use; --prefetch 1
//             gathers the next unit while the current one computes.
//
// Sharding is per unit (embedding, each layer, the head), FSDP-style: a unit's range of the flat
// buffers, padded to a multiple of N, splits into N equal chunks and rank r owns chunk r of every
// unit. Each unit is then one reduce-scatter and one all-gather with no re-layout.
//
//   mpirun -np 4 ./build/03_zero --dp 4 --zero 3 --batch 16 --steps 100
#ifndef TS_03_ZERO_CU
#define TS_03_ZERO_CU
#include <algorithm>
#include <cmath>
#include <map>

#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/run.h"
#include "training/step_time.h"
#include "training/train.h"

namespace zero {
using namespace ts;

// ----- the shard layout ----------------------------------------------------------------------------

// Rank r's chunk of unit u: [begin(u), begin(u) + size(u)) of the (padded) flat buffers.
struct Shards {
  const ParamTable& t;
  int n, r;
  int64_t size(int u) const { return (t.unit_begin[u + 1] - t.unit_begin[u]) / n; }
  int64_t begin(int u) const { return t.unit_begin[u] + r * size(u); }
  int64_t unit_size(int u) const { return t.unit_begin[u + 1] - t.unit_begin[u]; }
  // Where unit u's chunk sits in this rank's shard buffers (chunks of all units, in order).
  int64_t local(int u) const {
    int64_t o = 0;
    for (int v = 0; v < u; v++) o += size(v);
    return o;
  }
  int64_t total() const { return t.total / n; }
};

// ----- ZeRO -----------------------------------------------------------------------------------------

class Zero {
 public:
  Zero(Model& m, Comm& dp, int stage, bool prefetch, const RunConfig& rc)
      : m_(m), dp_(dp), stage_(stage), prefetch_(prefetch), sh_{m.table, dp.size(), dp.rank()} {
    const int U = m.table.num_units();
    for (int u = 0; u < U; u++) opt_.emplace_back(m, sh_.begin(u), sh_.begin(u) + sh_.size(u), rc.master_weights);
    if (stage_ >= 2) grad_shard_ = Tensor::zeros({sh_.total()}, DType::F32, m.dev, Tag::Grads);
    if (stage_ == 3) {
      param_shard_ = Tensor::zeros({sh_.total()}, m.dtype, m.dev, Tag::Params);
      gathered_.resize(U);
      m.before_unit.add([this](int u) { gather_for_use(u); });
      m.after_unit.add([this](int u) { release(u); });
    }
    if (stage_ >= 2) {
      m.before_backward.add([this](int u) { new_unit_grads(u); });
      m.unit_grads_ready.add([this](int u) { reduce_scatter_unit(u); });
    } else {
      m.unit_grads_ready.add([this](int u) { reduce_scatter_final(u); });
    }
  }

  // This rank's chunk of unit u of the weights (compute dtype) and of the gradients (fp32).
  Tensor weights(int u) const {
    return stage_ == 3 ? param_shard_.view(sh_.local(u), {sh_.size(u)}) : m_.params.view(sh_.begin(u), {sh_.size(u)});
  }
  Tensor grads(int u) const {
    return stage_ >= 2 ? grad_shard_.view(sh_.local(u), {sh_.size(u)}) : m_.grads.view(sh_.begin(u), {sh_.size(u)});
  }
  AdamW& opt(int u) { return opt_[size_t(u)]; }
  int units() const { return m_.table.num_units(); }
  int stage() const { return stage_; }

  // Stages 1 and 2 keep full weights: fill the other ranks' chunks after init or resume.
  void all_gather_weights() {
    if (stage_ == 3) return;
    TraceScope t("all_gather weights", Lane::Comm);
    for (int u = 0; u < units(); u++) dp_.all_gather(unit_view(m_.params, u), weights(u));
  }

  void begin_step() {
    if (stage_ >= 2) ts::zero(grad_shard_);
    else ts::zero(m_.grads);
  }
  // `last`: the step's last micro-batch, whose backward makes each unit's accumulated gradients
  // final: stage 1 then reduce-scatters each unit as soon as it is.
  void begin_microbatch(bool last = false) {
    use_pos_ = 0;
    set_last(last);
  }
  // Whether the backward that runs next is the last micro-batch's (begin_microbatch sets it too).
  void set_last(bool last) { last_ = last; }

  // After the micro-batch's backward: stage 1, after the last, waits for its units' reduce-
  // scatters (and sends those no backward launched: the accumulated buffer is final now);
  // stages 2/3 finish the last unit.
  void end_microbatch(bool last) {
    if (stage_ >= 2) {
      finish_pending();
    } else if (last) {
      TraceScope t("reduce_scatter gradients (what is still in flight)", Lane::Comm);
      last_ = true;
      for (int u = 0; u < units(); u++) reduce_scatter_final(u);
      for (auto& [u, w] : final_) {
        w.first.wait();
        Trace::get().add("reduce_scatter unit " + std::to_string(u), Lane::Comm2, w.second, Trace::get().now_us() - w.second);
      }
      final_.clear();
      last_ = false;
    }
  }

  // Clipping over sharded gradients is exact: each rank sums the squares of its chunks, and one
  // all-reduce of that scalar (8 bytes, a metric outside the counted collectives) gives the norm.
  // `also`: any other groups whose ranks hold different parameters from this rank's.
  double grad_norm(const std::vector<MPI_Comm>& also = {}) {
    std::vector<GradRange> mine;
    for (int u = 0; u < units(); u++) mine.push_back({sh_.begin(u), grads(u)});
    std::vector<MPI_Comm> groups = {dp_.mpi()};
    groups.insert(groups.end(), also.begin(), also.end());
    return global_grad_norm(m_.table, mine, groups);
  }

  // What this rank writes to a checkpoint: its chunk of every unit (the file does not depend on
  // dp or the stage).
  std::vector<CheckpointSlice> checkpoint_slices() const {
    std::vector<CheckpointSlice> mine;
    for (int u = 0; u < units(); u++) {
      const AdamW& o = opt_[size_t(u)];
      mine.push_back({o.begin, o.end, weights_f32(weights(u), o), &o});
    }
    return mine;
  }

  // A forward-only pass `f` (the held-out loss): ZeRO-3 gathers each unit as in training, in
  // forward order only (0..L+1, then the next micro-batch's 0), and drops whatever is still
  // gathered afterwards. Its collectives are not counted with the training steps'.
  double evaluate(const std::function<double()>& f) {
    const auto counted = dp_.stats();
    forward_only_ = true;
    use_pos_ = 0;
    const double loss = f();
    for (Gathered& g : gathered_) {
      if (g.in_flight) g.work.wait();
      g = Gathered();
    }
    forward_only_ = false;
    dp_.set_stats(counted);
    return loss;
  }

  // Each rank updates its chunks; stages 1/2 then all-gather the updated weights.
  void optimizer_step(const RunConfig& rc, long step, double norm) {
    const float clip = clip_coefficient(norm, rc.clip);
    for (int u = 0; u < units(); u++) {
      opt_[size_t(u)].step(m_, weights(u), grads(u), lr_at(rc, step), step + 1, clip, rc);
    }
    all_gather_weights();
  }

 private:
  Tensor unit_view(const Tensor& flat, int u) const { return flat.view(m_.table.unit_begin[u], {sh_.unit_size(u)}); }

  // ---- stage 1: each unit's accumulated gradients, reduce-scattered once final ---------------
  void reduce_scatter_final(int u) {
    if (!last_ || final_.count(u)) return;
    final_.emplace(u, std::make_pair(dp_.reduce_scatter_async(grads(u), unit_view(m_.grads, u)), Trace::get().now_us()));
  }

  // ---- stages 2 and 3: per-unit gradient buffers, reduce-scattered as soon as complete -------
  struct PendingGrad {
    int u = -1;
    Tensor full, chunk;
    Work work;
  };
  void new_unit_grads(int u) {
    unit_grads_ = Tensor::zeros({sh_.unit_size(u)}, DType::F32, m_.dev, Tag::Grads);
    m_.bind_unit_grads(u, unit_grads_);
  }
  void reduce_scatter_unit(int u) {
    finish_pending();  // the unit above: at most two unit buffers live at once
    pending_.u = u;
    pending_.full = unit_grads_;
    unit_grads_ = Tensor();
    m_.bind_unit_grads(u, Tensor());
    pending_.chunk = Tensor::empty({sh_.size(u)}, DType::F32, m_.dev, Tag::Comm);
    pending_.work = dp_.reduce_scatter_async(pending_.chunk, pending_.full);
    pending_start_ = Trace::get().now_us();
  }
  void finish_pending() {
    if (pending_.u < 0) return;
    pending_.work.wait();
    // Its own lane: under ZeRO-3 it runs alongside the prefetching all-gathers.
    Trace::get().add("reduce_scatter unit " + std::to_string(pending_.u), Lane::Comm2, pending_start_,
                     Trace::get().now_us() - pending_start_);
    add_inplace(grads(pending_.u), pending_.chunk);  // accumulate over micro-batches
    pending_ = PendingGrad();
  }

  // ---- stage 3: gather a unit's weights before use, prefetch the next, drop after use ------
  struct Gathered {
    Tensor full;
    Work work;
    bool in_flight = false;
    double start = 0;
  };
  // The order in which a micro-batch reads unit weights: forward 0..L+1 (the head runs its
  // backward at once), then the layers' backward L..1 (the embedding's backward reads none).
  int use_sequence(int pos) const {
    const int L = m_.cfg.layers;
    if (forward_only_) return pos % (L + 2);
    if (pos <= L + 1) return pos;
    int u = 2 * (L + 1) - pos;
    return u >= 1 ? u : -1;
  }
  void start_gather(int u) {
    Gathered& g = gathered_[size_t(u)];
    if (g.full.defined()) return;
    g.full = Tensor::empty({sh_.unit_size(u)}, m_.dtype, m_.dev, Tag::Params);
    g.work = dp_.all_gather_async(g.full, weights(u));
    g.in_flight = true;
    g.start = Trace::get().now_us();
  }
  void gather_for_use(int u) {
    TS_CHECK(use_sequence(use_pos_) == u, "ZeRO-3: unit %d used out of the expected order", u);
    start_gather(u);
    Gathered& g = gathered_[size_t(u)];
    if (g.in_flight) {
      g.work.wait();
      g.in_flight = false;
      Trace::get().add("all_gather unit " + std::to_string(u), Lane::Comm, g.start, Trace::get().now_us() - g.start);
    }
    m_.bind_unit(u, g.full);
    const int next = use_sequence(++use_pos_);
    if (prefetch_ && next >= 0) start_gather(next);
  }
  void release(int u) {
    m_.bind_unit(u, Tensor());
    gathered_[size_t(u)] = Gathered();
  }

  Model& m_;
  Comm& dp_;
  int stage_;
  bool prefetch_;
  Shards sh_;
  std::vector<AdamW> opt_;
  Tensor grad_shard_, param_shard_;
  Tensor unit_grads_;  // the unit whose backward is running
  PendingGrad pending_;
  double pending_start_ = 0;
  std::vector<Gathered> gathered_;
  int use_pos_ = 0;
  bool forward_only_ = false;  // evaluate() is running
  bool last_ = false;          // stage 1: the step's last micro-batch is running
  std::map<int, std::pair<Work, double>> final_;  // stage 1: unit -> its reduce-scatter, launch time
};

// ----- predict: memory and communication per rank (notes/03 derives each line) ---------------------

struct ZeroPlan {
  int stage, n, micro_batches;
  bool prefetch;
  ParamTable table;  // padded per unit to a multiple of n
};

// Unit u's elements in table t, the largest unit, and the largest sum of two consecutive units.
inline double unit_size(const ParamTable& t, int u) { return double(t.unit_begin[u + 1] - t.unit_begin[u]); }
inline double largest_unit(const ParamTable& t) {
  double largest = 0;
  for (int u = 0; u < t.num_units(); u++) largest = std::max(largest, unit_size(t, u));
  return largest;
}
inline double largest_consecutive_pair(const ParamTable& t) {
  double pair = 0;
  for (int u = 0; u + 1 < t.num_units(); u++) pair = std::max(pair, unit_size(t, u) + unit_size(t, u + 1));
  return pair;
}

// `pair`: the elements of the two unit buffers live at once (ZeRO-2/3's gradients, ZeRO-3's
// gathered weights under prefetch).
inline MemoryPrediction predict_memory(const RunConfig& rc, const ZeroPlan& p, double pair) {
  const double e = double(dtype_size(rc.dtype)), P = double(p.table.total), S = P / p.n;
  const double master = rc.dtype != DType::F32 && rc.master_weights ? 4.0 : 0.0;
  const double largest = largest_unit(p.table);
  MemoryPrediction m;
  m.optimizer = (8.0 + master) * S;                               // Adam m, v (+ master): 12Ψ/N_d in bf16
  m.staging = 12.0 * S;  // --async-save stages the shard it writes: fp32 weights, m and v
  m.grads = p.stage == 1 ? 4.0 * P : 4.0 * (S + pair);           // stage 2/3: shard + two unit buffers in flight
  m.params = p.stage < 3 ? e * P : e * (S + (p.prefetch ? pair : largest));  // stage 3: shard + gathered units
  m.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  if (p.stage >= 2) m.comm_also_holds("the reduce-scatter output of the unit in flight (ZeRO-2/3)");
  return m;
}
// One backward holds two consecutive units at once: the unit whose gradients are being written
// and the one above, whose reduce-scatter is in flight (or, under prefetch, the one in use and the
// one being gathered).
inline MemoryPrediction predict_memory(const RunConfig& rc, const ZeroPlan& p) {
  return predict_memory(rc, p, largest_consecutive_pair(p.table));
}

// Wire bytes per rank per step, ring algorithm: reduce-scatter and all-gather each (N-1)/N·K.
inline std::map<std::string, double> predict_comm(const RunConfig& rc, const ZeroPlan& p) {
  const double f = double(p.n - 1) / p.n, e = double(dtype_size(rc.dtype)), P = double(p.table.total);
  const int L = rc.model.layers;
  const double layers = double(p.table.unit_begin[L + 1] - p.table.unit_begin[1]);
  std::map<std::string, double> c;
  // Stage 1 reduces the accumulated gradients once; stages 2/3 hold no full buffer to
  // accumulate in, so every micro-batch is reduce-scattered.
  c["reduce_scatter"] = f * 4.0 * P * (p.stage == 1 ? 1 : p.micro_batches);
  // Stages 1/2 gather the updated weights once; stage 3 gathers every unit for the forward and
  // the layers again for the backward, per micro-batch: ≈ 2Ψ + Ψ (reduce-scatter) = the playbook's 3Ψ.
  c["all_gather"] = p.stage < 3 ? f * e * P : f * e * (P + layers) * p.micro_batches;
  return c;
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// Collective calls per step, for their latency, per unit: ZeRO-1 one reduce-scatter and one
// all-gather; ZeRO-2 a reduce-scatter per micro-batch and one all-gather; ZeRO-3 per micro-batch a
// reduce-scatter and two gathers (forward and backward).
inline double collective_calls(int stage, int units, double micro_batches) {
  return units * (stage == 1 ? 2 : stage == 2 ? micro_batches + 1 : 3 * micro_batches);
}

// ZeRO-3 gathers each unit before its forward and backward and prefetches the next one during the
// current one (FSDP; the playbook's ZeRO-3 overlap): the first unit's gather and what outlasts the
// compute show. Without prefetch every gather waits.
inline double zero3_exposed(double t_comm, double t_compute, int units, bool prefetch) {
  if (!prefetch) return t_comm;
  return std::max(0.0, t_comm - t_compute) + t_comm / std::max(1, units);
}

// ZeRO's terms of a step, from its predicted bytes `ops`: ZeRO-1 reduce-scatters once,
// behind the last micro-batch's backward (ZeRO-2 every micro-batch, behind each backward); the
// updated weights are gathered after the optimizer step, with nothing left to hide behind.
inline void price_collectives(StepTerms& s, const Network& net, const std::map<std::string, double>& ops, int stage,
                              int units, double micro_batches, bool prefetch, int nodes) {
  const double calls = collective_calls(stage, units, micro_batches);
  s.t_dp = group_seconds(net, ops, calls, nodes);
  if (stage == 3) {
    s.t_dp_exposed = zero3_exposed(s.t_dp, s.t_compute, units, prefetch);
    return;
  }
  const double rs = group_seconds(net, ops, calls, nodes, "reduce_scatter"), ag = group_seconds(net, ops, calls, nodes, "all_gather");
  s.t_dp_exposed = reduction_exposed(rs, stage == 1 ? s.last_backward(micro_batches) : s.backward(), 1.0 / units) + ag;
}

// This run's step: each of the n ranks computes 1/n of the tokens, then the stage's collectives.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, const ZeroPlan& p) {
  StepTerms s = compute_terms(g, rc, 1, 1, 1, p.n);
  const double mbs = double(rc.batch) / p.n / rc.micro_batch;
  price_collectives(s, g.net, p.n > 1 ? predict_comm(rc, p) : std::map<std::string, double>{}, p.stage,
                    p.table.num_units(), mbs, p.prefetch, 1);
  s.total();
  return s;
}

inline void print_plan(RunLog& log, const RunConfig& rc, const ZeroPlan& p) {
  const MemoryPrediction m = predict_memory(rc, p);
  print_model(log, rc.model);
  const int64_t psi = param_count(rc.model);
  log.line("ZeRO-%d over %d ranks: Ψ = %lld parameters, padded per unit to %lld (%lld padding)", p.stage, p.n,
           (long long)psi, (long long)p.table.total, (long long)(p.table.total - psi));
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (micro-batch %d)",
           human_bytes(m.params).c_str(), human_bytes(m.grads).c_str(), human_bytes(m.optimizer).c_str(),
           human_bytes(m.activations).c_str(), rc.micro_batch);
  for (auto& [op, b] : predict_comm(rc, p)) log.line("per-rank %s per step: %s", op.c_str(), human_bytes(b).c_str());
}

}  // namespace zero

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 3
using namespace ts;
using namespace zero;

static const char* kDoc =
    "03_zero: ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP-style, with prefetch) over data-parallel ranks.\n"
    "usage: mpirun -np N 03_zero --dp N --zero 1|2|3 [flags]";

// ----- one optimizer step ----------------------------------------------------------------------------

static StepResult train_step(Model& model, Zero& zero, const TokenData& data, const RunConfig& rc, Mesh& mesh,
                             long step, RunLog& log) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp;
  const int first_seq = mesh.dp_rank * local;
  const bool show = show_step_memory(model, log, rc, step);
  zero.begin_step();
  for (int s0 = 0; s0 < local; s0 += mb) {
    zero.begin_microbatch(s0 + mb == local);
    MicroBatch b = make_microbatch(data, step, rc.batch, T, first_seq + s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
    zero.end_microbatch(s0 + mb == local);
  }
  if (show) print_memory(log, model.dev, step, "after backward");
  const double norm = zero.grad_norm();
  zero.optimizer_step(rc, step, norm);
  if (show) print_memory(log, model.dev, step, "after optimizer");
  return {global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.dp().mpi()}), norm};
}

// ----- main ---------------------------------------------------------------------------------------------

// Each rank initialises (or loads) its shard of every unit, then gathers the full weights of
// ZeRO-1/2 (ZeRO-3 gathers each unit when it runs). Returns the first step to run.
static long init_shards(Model& model, Zero& zero, const RunConfig& rc, Mesh& mesh) {
  long first = 0;
  for (int u = 0; u < zero.units(); u++) {
    const AdamW& o = zero.opt(u);
    first = init_or_resume(model, zero.opt(u), rc, o.begin, o.end, zero.weights(u));
  }
  zero.all_gather_weights();
  mesh.dp().reset_stats();  // count the training steps only
  return first;
}

// The loop's evaluation, checkpoint and bytes: each rank writes its shards of the weights and
// the moments at their global offsets, and the bytes sent are checked against predict_comm.
static void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, Model& model, Zero& zero,
                        const ZeroPlan& plan, Program& prog) {
  // Each rank evaluates its slice of every evaluation batch, as it trains on its slice of a step's.
  loop.eval = [&] {
    const int local = rc.batch / mesh.cfg.dp;
    return zero.evaluate([&] { return held_out_loss(model, prog.held_out, rc, mesh.dp_rank * local, local, {mesh.dp().mpi()}); });
  };
  loop.save = [&](long step) {
    Json m = Json::object();
    m["dp"] = mesh.cfg.dp;
    m["zero"] = plan.stage;
    save_checkpoint(rc.save_dir, rc, model.table, zero.checkpoint_slices(), step, m);
  };
  loop.comm = [&](long steps_run) { return comm_report(log, mesh.dp(), steps_run, predict_comm(rc, plan)); };
}

// The chapter's flags: the degree, the stage and ZeRO-3's prefetch; the plan they make.
static ZeroPlan read_zero_flags(Args& args, MeshConfig& mc) {
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  const int stage = args.get_int("--zero", 1, "ZeRO stage: 1 (optimizer states), 2 (+ gradients), 3 (+ weights)");
  const bool prefetch = args.get_int("--prefetch", 1, "ZeRO-3: gather the next unit during the current one (1/0)", between(0, 1));
  if (stage < 1 || stage > 3) config_error("--zero must be 1, 2 or 3 (got %d)", stage);
  return ZeroPlan{stage, mc.dp, 0, prefetch, {}};
}

// What each rank holds under the stage: the weights unless ZeRO-3, the gradients unless ZeRO-2
// or 3, in a table whose shards split evenly over the dp ranks.
static ModelLayout zero_layout(const ZeroPlan& plan) {
  ModelLayout layout;
  layout.align = plan.n;
  layout.hold_params = plan.stage < 3;
  layout.hold_grads = plan.stage < 2;
  return layout;
}

int main(int argc, char** argv) {
  ZeroPlan plan;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { plan = read_zero_flags(a, mc); });
  RunConfig& rc = run.rc;
  plan.micro_batches = rc.batch / plan.n / rc.micro_batch;  // the batch is split once every flag is read
  plan.table = Model::make_table(rc.model, plan.n);
  if (!run.start([&] { print_plan(run.log(), rc, plan); }, [&] { return predict_memory(rc, plan); })) return 0;
  Model& model = run.build_model(zero_layout(plan));
  Zero zero(model, run.mesh.dp(), plan.stage, plan.prefetch, rc);
  run.resumed(init_shards(model, zero, rc, run.mesh));
  Loop loop;
  loop.predicted = predict_memory(rc, plan);
  loop.step = [&](long step) { return train_step(model, zero, run.data, rc, run.mesh, step, run.log()); };
  add_reports(loop, run.log(), rc, run.mesh, model, zero, plan, run);
  return run.train(loop, [&](const Gpu& g) { return zero::predict_step_time(g, rc, plan); },
                   "dp ZeRO-" + std::to_string(plan.stage));
}
#endif  // TS_PROGRAM == 3
#endif  // TS_03_ZERO_CU
