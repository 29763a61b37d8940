// lab/02_data_parallel.h — 02's lab: what a data-parallel run predicts of itself, beside the
// chapter (02_data_parallel.cu holds the technique). The step-time pieces 06, 07 and 08's planner
// price their gradient all-reduces with are here too; lab/02_data_parallel.cu holds the plan and
// the reports 02's main calls.
#ifndef TS_LAB_02_DATA_PARALLEL_H
#define TS_LAB_02_DATA_PARALLEL_H
#include <algorithm>

#include "../02_data_parallel.cu"
#include "model/model.h"
#include "training/config.h"
#include "training/step_time.h"

namespace dp {
using namespace ts;

// The chapter's all-reduce bytes (allreduce_bytes) of this run's model: Ψ is the whole model.
inline double predict_allreduce_bytes(const RunConfig& rc, int dp) { return allreduce_bytes(param_count(rc.model), dp); }

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// All-reduce calls per step, for their latency: naive one per tensor (9 per layer), bucketed one
// per bucket of the `grad_bytes` of fp32 gradients.
inline double reduction_calls(bool bucketed, double layers, double grad_bytes, double bucket_mb) {
  return bucketed ? std::max(1.0, grad_bytes / (bucket_mb * 1048576)) : 9.0 * layers;
}

// What backward cannot hide of a reduction taking `t_reduce`: naive mode reduces tensor by tensor
// after the backward, all of it exposed; bucketed mode during the last micro-batch's backward, at
// least its last bucket.
inline double exposed_seconds(bool bucketed, double t_reduce, double last_backward, double grad_bytes, double bucket_mb) {
  return bucketed ? reduction_exposed(t_reduce, last_backward, bucket_mb * 1048576 / grad_bytes) : t_reduce;
}

// Seconds of the all-reduce of `psi` fp32 gradients over `n` ranks spanning `nodes` nodes.
inline double reduction_seconds(const Network& net, int64_t psi, int n, double calls, int nodes) {
  return n > 1 ? group_seconds(net, {{"all_reduce", allreduce_bytes(psi, n)}}, calls, nodes) : 0.0;
}

// This run's step: dp replicas compute 1/dp of the tokens each, then reduce their 4Ψ of gradients.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int dp, bool bucketed, double bucket_mb) {
  StepTerms s = compute_terms(g, rc, 1, 1, 1, dp);
  const int64_t psi = param_count(rc.model);
  const double grad_bytes = 4.0 * double(psi), mbs = double(rc.batch) / dp / rc.micro_batch;
  s.t_dp = reduction_seconds(g.net, psi, dp, reduction_calls(bucketed, rc.model.layers, grad_bytes, bucket_mb), 1);
  s.t_dp_exposed = exposed_seconds(bucketed, s.t_dp, s.last_backward(mbs), grad_bytes, bucket_mb);
  s.total();
  return s;
}

}  // namespace dp
#endif  // TS_LAB_02_DATA_PARALLEL_H
