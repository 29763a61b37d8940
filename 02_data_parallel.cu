// 02_data_parallel.cu — data parallelism: every rank holds the whole model and trains on its
// slice of the global batch; gradients are averaged with all-reduce before the optimizer step.
//
// The playbook's DP chapter, from the naive version to the one real trainers use:
//   --dp-mode naive     after backward, one blocking all-reduce per gradient tensor;
//   --dp-mode bucketed  gradients grouped into buckets of --bucket-mb in reverse layer order;
//                       each bucket's all-reduce starts asynchronously the moment its last
//                       gradient is written, while backward goes on with the layers below
//                       (overlap), and all are waited for before clipping and the optimizer.
// With gradient accumulation only the last micro-batch communicates (the `no_sync` idea).
//
//   mpirun -np 4 ./build/02_data_parallel --dp 4 --batch 16 --steps 100
#ifndef TS_02_DATA_PARALLEL_CU
#define TS_02_DATA_PARALLEL_CU
#include <algorithm>
#include <cmath>

#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/train.h"

namespace dp {
using namespace ts;

// ----- the gradient reducer ---------------------------------------------------------------------------

// --bucket-mb, in every program that reduces with a GradReducer: at most 1 TiB (a bucket that
// size already holds every gradient of a 250B-parameter model; beyond it the element count
// overflowed into one-element buckets).
inline Range bucket_mb_range() { return positive(1 << 20); }

// Averaging is exact and costs no extra pass: every rank scales its token losses by
// 1/(global batch · seq) before backward, so a plain SUM all-reduce yields the mean gradient of
// the global batch — the same number 01 computes, summed in a different order.
class GradReducer {
 public:
  // `ranges`: the ranges [begin, end) of the flat gradient buffer this reducer averages over `dp`
  // (empty: the whole buffer); no bucket crosses a range's end.
  GradReducer(Model& m, Comm& dp, bool bucketed, double bucket_mb, std::vector<std::pair<int64_t, int64_t>> ranges = {})
      : m_(m), dp_(dp), bucketed_(bucketed), ranges_(std::move(ranges)) {
    if (ranges_.empty()) ranges_ = {{0, m.table.total}};
    // Buckets are ranges of the flat gradient buffer cut from its end, because backward
    // finishes the head first and the embedding last: bucket 0 is ready first.
    const int64_t size = std::max<int64_t>(1, int64_t(bucket_mb * 1024 * 1024 / 4));
    for (auto r = ranges_.rbegin(); r != ranges_.rend(); ++r)
      for (int64_t end = r->second; end > r->first; end -= size)
        buckets_.push_back({std::max<int64_t>(r->first, end - size), end});
    if (bucketed_) m.unit_grads_ready.add([this](int u) { on_unit_ready(u); });
  }

  // Gradient accumulation: only the last micro-batch of a step communicates.
  void set_sync(bool sync) { sync_ = sync; }

  // Called by the model as each unit's gradients complete: launch every bucket that now lies
  // entirely in finished units, and poll the in-flight ones (MPI progresses when called). Units
  // are counted one by one, not as "everything above u": a unit's gradients may complete out of
  // order.
  void on_unit_ready(int u) {
    if (!sync_) return;
    ready_.resize(size_t(m_.table.num_units()), false);
    ready_[size_t(u)] = true;
    for (Bucket& b : buckets_) {
      if (!b.launched && complete(b)) {
        if (first_launch_ < 0) first_launch_ = Trace::get().now_us();
        b.start = Trace::get().now_us();
        b.work = dp_.all_reduce_async(m_.grads.view(b.begin, {b.end - b.begin}));
        b.launched = true;
      }
    }
    poll();
  }

  // After backward: wait for what is still in flight (bucketed) or reduce everything now (naive).
  void finish() {
    const double t0 = Trace::get().now_us();
    if (bucketed_) {
      for (Bucket& b : buckets_) {
        TS_CHECK(b.launched, "bucket [%lld, %lld) was never launched", (long long)b.begin, (long long)b.end);
        b.work.wait();
        mark_done(b);
      }
      const double t1 = Trace::get().now_us();
      exposed_us_ += t1 - t0;
      span_us_ += t1 - first_launch_;
    } else {
      TraceScope t("all_reduce per tensor", Lane::Comm);
      for (size_t i = 0; i < m_.table.entries.size(); i++)
        if (covers(m_.table.entries[i])) dp_.all_reduce(m_.grad(int(i)));
      const double t1 = Trace::get().now_us();
      exposed_us_ += t1 - t0;  // naive: every microsecond of communication is exposed
      span_us_ += t1 - t0;
    }
    for (Bucket& b : buckets_) b.launched = b.done = false;
    ready_.assign(ready_.size(), false);
    first_launch_ = -1;
  }

  // Fraction of communication time that ran behind backward compute.
  double hidden_fraction() const { return span_us_ > 0 ? 1.0 - exposed_us_ / span_us_ : 0.0; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    int64_t begin, end;
    Work work;
    bool launched = false, done = false;
    double start = 0;
  };
  // Every unit with gradients in [b.begin, b.end) has finished its last micro-batch's backward.
  bool complete(const Bucket& b) const {
    for (int v = 0; v < m_.table.num_units(); v++) {
      const int64_t ub = m_.table.unit_begin[v], ue = m_.table.unit_begin[v + 1];
      if (ue > ub && ub < b.end && ue > b.begin && !ready_[size_t(v)]) return false;
    }
    return true;
  }
  bool covers(const ParamEntry& e) const {
    for (auto [b, end] : ranges_)
      if (e.numel > 0 && e.offset >= b && e.offset + e.numel <= end) return true;
    return false;
  }
  void poll() {
    for (Bucket& b : buckets_)
      if (b.launched && !b.done && b.work.done()) mark_done(b);
  }
  void mark_done(Bucket& b) {
    if (b.done) return;
    b.done = true;
    Trace::get().add("all_reduce bucket [" + std::to_string(b.begin) + "," + std::to_string(b.end) + ")", Lane::Comm,
                     b.start, Trace::get().now_us() - b.start);
  }
  Model& m_;
  Comm& dp_;
  bool bucketed_, sync_ = true;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;  // per unit: its gradients are final this step
  double first_launch_ = -1, exposed_us_ = 0, span_us_ = 0;
};

// ----- the playbook's formulas: memory and communication per rank -----------------------------------

// A full replica per rank: the same memory as 01.
inline MemoryPrediction predict_memory(const RunConfig& rc) { return predict_replica(rc, param_count(rc.model)); }

// Ring all-reduce of the fp32 gradients once per step: 2(N-1)/N · 4Ψ bytes sent per rank
// (the same in naive and bucketed mode: bucketing changes when, not how much). Ψ: the
// parameters the rank holds and reduces, here the whole model.
inline double allreduce_bytes(int64_t psi, int dp) { return 2.0 * (dp - 1) / dp * 4.0 * double(psi); }

// ----- the lab (lab/02_data_parallel.cu: the plan, the reports, the step time this run predicts) -----
void print_plan(RunLog& log, const RunConfig& rc, int dp);
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, GradReducer& reducer, Program& prog);
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int dp, bool bucketed, double bucket_mb);

}  // namespace dp

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 2
using namespace ts;
using dp::GradReducer;

static const char* kDoc =
    "02_data_parallel: data parallelism with bucketed all-reduce overlapped with backward.\n"
    "usage: mpirun -np N 02_data_parallel --dp N [flags]";

// ----- one optimizer step ----------------------------------------------------------------------------

// This rank's sequences of the global batch: a contiguous slice, in micro-batches.
static StepResult train_step(Model& model, AdamW& opt, GradReducer& dp, const TokenData& data, const RunConfig& rc,
                             Mesh& mesh, long step, RunLog& log) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp;
  const int first_seq = mesh.dp_rank * local;
  const bool show = show_step_memory(model, log, rc, step);
  ts::zero(model.grads);
  for (int s0 = 0; s0 < local; s0 += mb) {
    dp.set_sync(s0 + mb == local);
    MicroBatch b = make_microbatch(data, step, rc.batch, T, first_seq + s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
  }
  dp.finish();
  if (show) print_memory(log, model.dev, step, "after backward");
  // Gradients are identical on every rank now: the norm needs no communication.
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  if (show) print_memory(log, model.dev, step, "after optimizer");
  return {global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.dp().mpi()}), norm};
}

// The loop's evaluation and checkpoint (the reports are the lab's: dp::add_reports).
static void add_eval_and_save(Loop& loop, const RunConfig& rc, Mesh& mesh, Model& model, AdamW& opt, Program& prog) {
  // Each rank evaluates its slice of every evaluation batch, as it trains on its slice of a step's.
  loop.eval = [&] {
    const int local = rc.batch / mesh.cfg.dp;
    return held_out_loss(model, prog.held_out, rc, mesh.dp_rank * local, local, {mesh.dp().mpi()});
  };
  loop.save = [&](long step) {
    // Replicas are identical: rank 0 writes the whole model, the others nothing.
    std::vector<CheckpointSlice> mine;
    if (mesh.rank == 0) mine.push_back({0, model.table.total, weights_f32(model.params, opt), &opt});
    Json m = Json::object();
    m["dp"] = mesh.cfg.dp;
    save_checkpoint(rc.save_dir, rc, model.table, mine, step, m);
  };
}

// The chapter's flags: the degree, naive or bucketed, and the bucket size.
struct DpFlags {
  std::string mode;
  double bucket_mb = 0;
  bool bucketed() const { return mode == "bucketed"; }
};
static DpFlags read_dp_flags(Args& args, MeshConfig& mc) {
  DpFlags f;
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  f.mode = args.get_str("--dp-mode", "bucketed", "naive | bucketed");
  f.bucket_mb = args.get_double("--bucket-mb", 25, "gradient bucket size in MiB (bucketed mode)", dp::bucket_mb_range());
  if (f.mode != "naive" && f.mode != "bucketed") config_error("--dp-mode must be naive or bucketed (got '%s')", f.mode.c_str());
  return f;
}

int main(int argc, char** argv) {
  DpFlags f;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { f = read_dp_flags(a, mc); });
  RunConfig& rc = run.rc;
  const int dp = run.mc.dp;
  if (!run.start([&] { dp::print_plan(run.log(), rc, dp); }, [&] { return dp::predict_memory(rc); })) return 0;
  run.log().line("dp %d, %s, %d sequences per rank per step", dp, f.mode.c_str(), rc.batch / dp);
  Model& model = run.build_model();
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);  // every rank initialises (or loads) the same full weights: no broadcast
  GradReducer reducer(model, run.mesh.dp(), f.bucketed(), f.bucket_mb);
  if (f.bucketed()) run.log().line("%zu gradient buckets of up to %.3g MiB", reducer.num_buckets(), f.bucket_mb);
  Loop loop;
  loop.step = [&](long step) { return train_step(model, opt, reducer, run.data, rc, run.mesh, step, run.log()); };
  add_eval_and_save(loop, rc, run.mesh, model, opt, run);
  dp::add_reports(loop, run.log(), rc, run.mesh, reducer, run);
  return run.train(loop, dp::step_time_model(rc, dp, f.bucketed(), f.bucket_mb), "dp");
}
#endif  // TS_PROGRAM == 2
#endif  // TS_02_DATA_PARALLEL_CU
