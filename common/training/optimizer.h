// optimizer.h — AdamW over ranges of the flat buffers, gradient clipping, and the loss and
// gradient norm summed across the mesh.
#pragma once
#include <mpi.h>

#include <vector>

#include "tensor/core.h"
#include "model/model.h"
#include "training/config.h"

namespace ts {


// AdamW over the parameter range [begin, end) of the flat buffers: all of it in 01/02, this
// rank's shard under ZeRO. With bf16 weights it keeps the fp32 master copy of its range
// (Tag::Optimizer, the playbook counts it with the optimizer states).
class AdamW {
 public:
  // The moments are allocated at the first step (or a resume), not here: the playbook's
  // first-step anomaly — optimizer memory appears only once the optimizer first runs.
  AdamW(const Model& m, int64_t begin, int64_t end, bool master_weights);
  void ensure_state();
  // Copies the current weights of [begin, end) into the master copy (after init or a load).
  void load_master(const Model& m, const Tensor& weights_range);
  // One update: grads_range and weights_range cover exactly [begin, end) of the flat buffers.
  void step(const Model& m, const Tensor& weights_range, const Tensor& grads_range, double lr, long t,
            float clip_coef, const RunConfig& rc);
  int64_t begin, end;
  Device dev;
  Tensor master, m1, m2;  // master is undefined for fp32 weights (the weights are the master)
};

// min(1, clip / (norm + 1e-6)); 1 when clipping is off.
float clip_coefficient(double grad_norm, double clip);

// ----- loss and gradient norm across the mesh ------------------------------------------------
// The step's mean token loss: each rank's summed token losses, summed over `token_groups` (the
// ranks that hold different tokens: dp × cp; tp ranks hold the same value and are not summed),
// divided by the global token count. A metric: its 8 bytes are not counted with the collectives.
double global_mean_loss(double local_sum, double global_tokens, const std::vector<MPI_Comm>& token_groups);
// The global L2 norm of the gradients: squares of this rank's gradient ranges (each a local flat
// range [begin, begin + numel) of `t`, in order) summed in double, skipping the copies of
// replicated tensors that do not count (so a tp-replicated norm weight counts once), then summed
// over `shard_groups` (every group whose ranks hold different parameters or gradient shards:
// tp, pp, and dp under ZeRO).
struct GradRange {
  int64_t begin;
  Tensor grads;
};
double global_grad_norm(const ParamTable& t, const std::vector<GradRange>& ranges,
                        const std::vector<MPI_Comm>& shard_groups);

}  // namespace ts
