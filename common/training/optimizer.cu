// optimizer.cu — AdamW over flat ranges, clipping, and the loss and gradient norm across the mesh.
#include "training/memory_timeline.h"
#include "training/optimizer.h"
#include "model/linear_gemms.h"

#include "kernels/kernels.h"
#include "comm/comm.h"
#include "comm/trace.h"
#include "training/numerics.h"
#include "comm/watchdog.h"

#include <mpi.h>

#include <cmath>

namespace ts {

AdamW::AdamW(const Model& m, int64_t b, int64_t e, bool master_weights) : begin(b), end(e), dev(m.dev) {
  if (m.dtype != DType::F32 && master_weights) master = Tensor::empty({e - b}, DType::F32, m.dev, Tag::Optimizer);
}

void AdamW::ensure_state() {
  if (m1.defined()) return;
  m1 = Tensor::zeros({end - begin}, DType::F32, dev, Tag::Optimizer);
  m2 = Tensor::zeros({end - begin}, DType::F32, dev, Tag::Optimizer);
}

void AdamW::load_master(const Model&, const Tensor& weights_range) {
  if (master.defined()) convert(master, weights_range);
}

float clip_coefficient(double norm, double clip) {
  if (clip <= 0) return 1.f;
  return float(std::min(1.0, clip / (norm + 1e-6)));
}

double global_mean_loss(double local_sum, double global_tokens, const std::vector<MPI_Comm>& token_groups) {
  double v = local_sum;
  for (MPI_Comm c : token_groups) {
    double all = 0;
    watched_allreduce(&v, &all, 1, MPI_DOUBLE, MPI_SUM, c, "all_reduce (the step's loss)");
    v = all;
  }
  return v / global_tokens;
}

// --numerics-every: the squares of each unit's gradients, counted as the norm counts them (each
// replicated copy once) and summed over the same groups, so they do not depend on the mesh. A
// separate pass, so that the norm itself keeps its summation order (and its bits).
static std::vector<double> unit_grad_squares(const ParamTable& t, const std::vector<GradRange>& ranges,
                                             const std::vector<MPI_Comm>& shard_groups) {
  std::vector<Tensor> pieces;
  std::vector<int> unit;
  for (const GradRange& r : ranges)
    t.for_each_overlap(r.begin, r.begin + r.grads.numel(), [&](const ParamEntry& p, int64_t lo, int64_t hi) {
      if (!p.counts) return;
      pieces.push_back(r.grads.view(lo - r.begin, {hi - lo}));
      unit.push_back(p.unit);
    });
  std::vector<double> sq(size_t(t.num_units()), 0.0), all(sq.size());
  const std::vector<double> each = sum_squares_each(pieces);
  for (size_t i = 0; i < each.size(); i++) sq[size_t(unit[i])] += each[i];
  for (MPI_Comm c : shard_groups) {
    watched_allreduce(sq.data(), all.data(), int(sq.size()), MPI_DOUBLE, MPI_SUM, c, "all_reduce (grad norm per unit)");
    sq = all;
  }
  return sq;
}

// Copies that do not count are cut out of each range; what remains is summed in pieces as long
// as possible (one piece per range when nothing is replicated: the order 01 uses).
double global_grad_norm(const ParamTable& t, const std::vector<GradRange>& ranges,
                        const std::vector<MPI_Comm>& shard_groups) {
  std::vector<Tensor> pieces;
  for (const GradRange& r : ranges) {
    const int64_t end = r.begin + r.grads.numel();
    int64_t from = r.begin;
    auto piece = [&](int64_t upto) {
      if (upto > from) pieces.push_back(r.grads.view(from - r.begin, {upto - from}));
    };
    t.for_each_overlap(r.begin, end, [&](const ParamEntry& p, int64_t lo, int64_t hi) {
      if (p.counts) return;
      piece(lo);
      from = hi;
    });
    piece(end);
  }
  double sq = 0;
  for (double s : sum_squares_each(pieces)) sq += s;  // in range order: one host sync on CUDA
  for (MPI_Comm c : shard_groups) {
    double all = 0;
    watched_allreduce(&sq, &all, 1, MPI_DOUBLE, MPI_SUM, c, "all_reduce (the gradient norm)");
    sq = all;
  }
  if (numerics().unit_stats_due()) numerics().note_unit_grad_squares(unit_grad_squares(t, ranges, shard_groups));
  numerics().note_grad_norm(std::sqrt(sq));
  return std::sqrt(sq);
}

// The range may cut through tensors (ZeRO shards): each parameter's intersection with it is
// updated with that parameter's weight-decay rule.
void AdamW::step(const Model& m, const Tensor& w, const Tensor& g, double lr, long t, float clip_coef,
                 const RunConfig& rc) {
  memory_phase("optimizer");  // --memory-timeline's phase (training/memory_timeline.h)
  // A skipped step (non-finite norm, or --on-spike skip) touches nothing: moments, master copy
  // and weights keep their bits (numerics.h; collective on the step's first call).
  if (!numerics().allow_update(m, g, begin, end)) return;
  ensure_state();
  m.gemms->end_step(t);  // FP8 delayed scaling rolls its amax histories (collective)
  TraceScope trace("optimizer");
  AdamWParams p{float(lr), float(rc.beta1), float(rc.beta2), float(rc.eps), float(rc.weight_decay), t};
  m.table.for_each_overlap(begin, end, [&](const ParamEntry& e, int64_t lo, int64_t hi) {
    const int64_t o = lo - begin, n = hi - lo;
    if (master.defined()) {
      adamw_step(master.view(o, {n}), g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef,
                 w.view(o, {n}));
    } else if (w.dtype == DType::F32) {
      adamw_step(w.view(o, {n}), g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef, Tensor());
    } else {
      // --no-master-weights: the update is applied to a widened copy and rounded straight back
      // to bf16, so updates below half a bf16 ulp of the weight are lost (the playbook's failure).
      Tensor tmp = Tensor::empty({n}, DType::F32, m.dev, Tag::Workspace);
      convert(tmp, w.view(o, {n}));
      adamw_step(tmp, g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef, w.view(o, {n}));
    }
  });
}

}  // namespace ts
