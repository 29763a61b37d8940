// 03_zero.cu — ZeRO: data parallelism that shards what every DP rank would otherwise replicate.
//
// The playbook's ZeRO chapter, all three stages over --dp N ranks:
//   --zero 1  optimizer states (and the fp32 master weights under bf16) sharded: gradients are
//             reduce-scattered after backward, each rank updates its shard, the weights all-gathered;
//   --zero 2  gradients sharded too: each unit's gradients are reduce-scattered during backward as
//             soon as complete (overlapped with the units below): the full buffer is never held;
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
#include <map>

#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "kernels/elementwise.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/start.h"
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
  int64_t local(int u) const { return u == 0 ? 0 : local(u - 1) + size(u - 1); }
  int64_t total() const { return t.total / n; }
};

// ----- ZeRO -----------------------------------------------------------------------------------------

class Zero {
 public:
  // `replicas`: the ranks of other dp groups holding this rank's shards too (null: none).
  Zero(Model& m, Comm& dp, int stage, bool prefetch, const RunConfig& rc, Comm* replicas = nullptr)
      : m_(m), dp_(dp), replicas_(replicas), stage_(stage), prefetch_(prefetch), sh_{m.table, dp.size(), dp.rank()} {
    const int U = m.table.num_units();
    for (int u = 0; u < U; u++) opt_.emplace_back(m, sh_.begin(u), sh_.begin(u) + sh_.size(u), rc.master_weights);
    if (stage_ >= 2) grad_shard_ = Tensor::zeros({sh_.total()}, DType::F32, m.dev, Tag::Grads);
    if (stage_ == 3) {
      param_shard_ = Tensor::zeros({sh_.total()}, m.dtype, m.dev, Tag::Params);
      gathered_.resize(U);
      m.before_unit.add([this](int u) { gather_for_use(u); });
      m.after_unit.add([this](int u) { release(u); });
    }
    if (stage_ >= 2) m.before_backward.add([this](int u) { new_unit_grads(u); });
    m.unit_grads_ready.add([this](int u) { stage_ >= 2 ? reduce_scatter_unit(u) : reduce_scatter_final(u); });
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
  Comm& group() const { return dp_; }
  Comm* replicas() const { return replicas_; }

  // Each rank initialises (or loads) its shard of every unit, then gathers the full weights of
  // ZeRO-1/2 (ZeRO-3 gathers each unit when it runs). Returns the first step to run.
  long init_or_resume(const RunConfig& rc) {
    long first = 0;
    for (int u = 0; u < units(); u++) {
      AdamW& o = opt_[size_t(u)];
      first = ts::init_or_resume(m_, o, rc, o.begin, o.end, weights(u));
    }
    all_gather_weights();
    dp_.reset_stats();  // count the training steps only
    return first;
  }

  // Stages 1 and 2 keep full weights: fill the other ranks' chunks after init or resume.
  void all_gather_weights() {
    if (stage_ == 3) return;
    TraceScope t("all_gather weights", Lane::Comm);
    for (int u = 0; u < units(); u++) dp_.all_gather(unit_view(m_.params, u), weights(u));
  }

  void begin_step() { ts::zero(stage_ >= 2 ? grad_shard_ : m_.grads); }
  // `last`: the step's last micro-batch, whose backward makes each unit's accumulated gradients
  // final: stage 1 then reduce-scatters each unit as soon as it is (set_last says it alone).
  void begin_microbatch(bool last = false) { use_pos_ = 0; set_last(last); }
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
        reduce_replicas(grads(u));
      }
      final_.clear();
      last_ = false;
    }
  }
  // Clipping over sharded gradients is exact: each rank sums its chunks' squares, one all-reduce of
  // that scalar gives the norm. `also`: other groups whose ranks hold other parameters than this one.
  double grad_norm(const std::vector<MPI_Comm>& also = {}) {
    std::vector<GradRange> mine;
    for (int u = 0; u < units(); u++) mine.push_back({sh_.begin(u), grads(u)});
    std::vector<MPI_Comm> groups = {dp_.mpi()};
    groups.insert(groups.end(), also.begin(), also.end());
    return global_grad_norm(m_.table, mine, groups);
  }
  // What this rank writes to a checkpoint: its chunk of every unit (the file does not depend on
  // dp or the stage); of replicated shards, the first replica's.
  std::vector<CheckpointSlice> checkpoint_slices() const {
    std::vector<CheckpointSlice> mine;
    if (replicas_ && replicas_->rank() > 0) return mine;
    for (int u = 0; u < units(); u++) {
      const AdamW& o = opt_[size_t(u)];
      mine.push_back({o.begin, o.end, weights_f32(weights(u), o), &o});
    }
    return mine;
  }
  friend double evaluate(Zero& z, const std::function<double()>& f);  // the held-out loss: lab/03_zero.cu
  // Each rank updates its chunks; stages 1/2 then all-gather the updated weights.
  void optimizer_step(const RunConfig& rc, long step, double norm) {
    const float clip = clip_coefficient(norm, rc.clip);
    for (int u = 0; u < units(); u++) opt_[size_t(u)].step(m_, weights(u), grads(u), lr_at(rc, step), step + 1, clip, rc);
    all_gather_weights();
  }

 private:
  Tensor unit_view(const Tensor& flat, int u) const { return flat.view(m_.table.unit_begin[u], {sh_.unit_size(u)}); }
  // A reduced chunk sums this group's tokens; all-reduced across its replicas (if any), all of dp's.
  void reduce_replicas(const Tensor& chunk) { if (replicas_) replicas_->all_reduce(chunk); }

  // ---- stage 1: each unit's accumulated gradients, reduce-scattered once final ---------------
  void reduce_scatter_final(int u) {
    if (!last_ || final_.count(u)) return;
    final_.emplace(u, std::make_pair(dp_.reduce_scatter_async(grads(u), unit_view(m_.grads, u)), Trace::get().now_us()));
  }

  // ---- stages 2 and 3: per-unit gradient buffers, reduce-scattered as soon as complete -------
  struct PendingGrad { int u = -1; Tensor full, chunk; Work work; };
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
    reduce_replicas(pending_.chunk);
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
  Comm* replicas_;
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

// ----- the playbook's formula: memory per rank (notes/03 derives each line) ----------------------

struct ZeroPlan {
  int stage, n, micro_batches;  // n: the ranks a shard group spans (all of dp, unless regrouped)
  bool prefetch;
  ParamTable table;  // padded per unit to a multiple of n
  int replicas = 1;  // shard groups holding the same shards: dp = n · replicas
};

// A follow-on file may regroup dp into `replicas` shard groups of n ranks: it reads its flags into the
// plan, then makes this rank's {shard group, replica group}.
using Groups = std::pair<std::shared_ptr<Comm>, std::shared_ptr<Comm>>;
struct Regrouping {
  std::function<void(Args&, ZeroPlan&)> read_flags;
  std::function<Groups(Mesh&, const ZeroPlan&)> groups;
};
inline Regrouping& regrouping() { static Regrouping r; return r; }

// Mixed precision keeps 2Ψ of weights, 2Ψ of gradients and 12Ψ of optimizer states (Adam's m, v and
// the fp32 master copy); ZeRO-1 shards the optimizer states over N_d ranks, ZeRO-2 the gradients too,
// ZeRO-3 the weights too: 2Ψ + 2Ψ + 12Ψ/N_d, 2Ψ + (2Ψ + 12Ψ)/N_d, (2Ψ + 2Ψ + 12Ψ)/N_d. Gradients are fp32
// here (4Ψ), plus from ZeRO-2 on the unit buffers in flight (`grad_units`, `weight_units`: lab/03_zero.h).
inline MemoryPrediction zero_states(const RunConfig& rc, const ZeroPlan& p, double grad_units, double weight_units) {
  const double e = double(dtype_size(rc.dtype)), P = double(p.table.total), S = P / p.n;
  const double master = rc.dtype != DType::F32 && rc.master_weights ? 4.0 : 0.0;
  MemoryPrediction m;
  m.optimizer = (8.0 + master) * S;                            // Adam m, v (+ master): 12Ψ/N_d in bf16
  m.grads = p.stage == 1 ? 4.0 * P : 4.0 * (S + grad_units);  // stage 2/3: shard + unit buffers in flight
  m.params = p.stage < 3 ? e * P : e * (S + weight_units);    // stage 3: shard + gathered units
  return m;
}

// ----- the lab (lab/03_zero.cu: the plan, the memory, the reports, the step time predicted) -----------
void print_plan(RunLog& log, const RunConfig& rc, const ZeroPlan& p);
MemoryPrediction predict_memory(const RunConfig& rc, const ZeroPlan& p);  // zero_states, the units and activations
void add_reports(Loop& loop, TrainingRun& run, Model& model, Zero& zero, const ZeroPlan& p);
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, const ZeroPlan& p);

}  // namespace zero

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 3
using namespace ts;
using namespace zero;

static const char* kDoc = "03_zero: ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP-style, with prefetch) over data-parallel ranks.\n"
    "usage: mpirun -np N 03_zero --dp N --zero 1|2|3 [flags]";

static StepResult train_step(Model& model, Zero& zero, const TokenData& data, const RunConfig& rc, Mesh& mesh,
                             long step, RunLog& log) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp, first_seq = mesh.dp_rank * local;
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

// The chapter's flags: the degree, the stage and ZeRO-3's prefetch; the plan they make.
static ZeroPlan read_zero_flags(Args& args, MeshConfig& mc) {
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  const int stage = args.get_int("--zero", 1, "ZeRO stage: 1 (optimizer states), 2 (+ gradients), 3 (+ weights)");
  const bool prefetch = args.get_int("--prefetch", 1, "ZeRO-3: gather the next unit during the current one (1/0)", between(0, 1));
  if (stage < 1 || stage > 3) config_error("--zero must be 1, 2 or 3 (got %d)", stage);
  ZeroPlan p{stage, mc.dp, 0, prefetch, {}};
  if (regrouping().read_flags) regrouping().read_flags(args, p);
  return p;
}

// What each rank holds: the weights unless ZeRO-3, the gradients unless ZeRO-2 or 3; shards split evenly.
static ModelLayout zero_layout(const ZeroPlan& p) { return {ShardSpec{}, /*align=*/p.n, /*hold_params=*/p.stage < 3, /*hold_grads=*/p.stage < 2}; }

int main(int argc, char** argv) {
  ZeroPlan plan;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { plan = read_zero_flags(a, mc); });
  RunConfig& rc = run.rc;
  plan.micro_batches = rc.batch / (plan.n * plan.replicas) / rc.micro_batch;  // the batch is split once every flag is read
  plan.table = Model::make_table(rc.model, plan.n);
  if (!run.start([&] { zero::print_plan(run.log(), rc, plan); }, [&] { return predict_memory(rc, plan); })) return 0;
  Model& model = run.build_model(zero_layout(plan));
  const Groups g = plan.replicas > 1 ? regrouping().groups(run.mesh, plan) : Groups{};
  Zero zero(model, g.first ? *g.first : run.mesh.dp(), plan.stage, plan.prefetch, rc, g.second.get());
  run.resumed(zero.init_or_resume(rc));
  Loop loop;
  loop.step = [&](long step) { return train_step(model, zero, run.data, rc, run.mesh, step, run.log()); };
  zero::add_reports(loop, run, model, zero, plan);
  return run.train(loop, zero::step_time_model(rc, plan), "dp ZeRO-" + std::to_string(plan.stage));
}
#endif  // TS_PROGRAM == 3
#endif  // TS_03_ZERO_CU
