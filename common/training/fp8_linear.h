// fp8_linear.h — FP8 training (--dtype fp8): the dense linears' three GEMMs on 8-bit operands.
//
// The playbook's mixed-precision section ends here: on H100s an FP8 GEMM runs at twice bf16's
// rate, and whether the loss survives depends on how each tensor is scaled into the format's
// narrow range (e4m3: ±448 with 3 mantissa bits; e5m2: ±57344 with 2). Every dense linear —
// q/k/v/o and the SwiGLU MLP's gate/up/down — runs
//   forward  y  = Q(x) · Q(W)^T      x, W in e4m3
//   dgrad    dx = Q(dy) · Q(W)       dy in e5m2 (tensorwise, delayed) or e4m3 (blockwise)
//   wgrad    dW += Q(dy)^T · Q(x)
// with fp32 accumulation (or the emulated narrower accumulator of --fp8-accum-bits). The
// embedding, the LM head and its loss, the norms, attention, the MoE router and experts stay in
// bf16/fp32; master weights, gradients and AdamW stay fp32. Backward re-quantizes the bf16 x it
// saved, so FP8 adds no activation memory (the quantized copies are transient workspace).
//
// The recipes (--fp8-recipe):
//   tensorwise  current scaling: scale = max_fp8 / amax(this tensor, now), one per tensor.
//   delayed     Transformer Engine's delayed scaling: the scale comes from the max over the last
//               --fp8-history steps' amaxes, so it lags a sudden jump (values past max_fp8 then
//               saturate). The first step, with no history yet, scales currently.
//   blockwise   DeepSeek-V3's fine-grained scaling (§3.3): one scale per 1 × 128 tile of x and dy
//               along the GEMM's K (128 × 1 along the tokens for wgrad) and per 128 × 128 block
//               of W; --fp8-promote-every N_C promotes partial sums to fp32 (§3.3.2).
//
// Scales are mesh-independent, so an FP8 run at any mesh quantizes exactly as 01 does: a
// per-tensor amax of a split tensor is reduced (max) over the ranks that split it — tp for a
// weight shard, for a row-parallel input and for a column-parallel output gradient; cp for every
// activation and gradient (tokens) — before the scale is taken. ZeRO-3 gathers a weight before
// it is used, so its amax is the whole weight's already. Blockwise tiles never straddle a shard
// (checked: shard widths must be multiples of the tile). Delayed scaling's step amax is the max
// over the step's micro-batches and over every rank, so the history is the same on any mesh.
#pragma once
#include <mpi.h>

#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "model/linear_gemms.h"
#include "model/model.h"
#include "training/config.h"

namespace ts {
struct Mesh;
class RunLog;
}  // namespace ts

namespace ts::fp8 {

// The LinearGemms of a recipe. tp_group / cp_group: where per-tensor amaxes are reduced
// (MPI_COMM_NULL or size 1: nowhere); step_group: where delayed scaling's step amaxes are.
class Fp8Gemms : public LinearGemms {
 public:
  // log (may be null): where delayed scaling reports the tensors that saturated.
  Fp8Gemms(const Model& m, const Fp8Config& cfg, MPI_Comm tp_group, MPI_Comm cp_group, MPI_Comm step_group,
           RunLog* log = nullptr);
  void forward(int entry, const Tensor& y, const Tensor& x, const Tensor& W) override;
  void input_grad(int entry, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate) override;
  void weight_grad(int entry, const Tensor& dW, const Tensor& dy, const Tensor& x) override;
  // Delayed scaling: folds this step's amaxes (max over micro-batches and ranks) into the
  // histories. Collective over step_group; a second call for the same step does nothing.
  void end_step(long step) override;

  enum Role { kX, kW, kDY };
  // The amax delayed scaling scales (entry, role) by now: the history's max, 0 before any step.
  float delayed_amax(int entry, Role r) const;
  size_t history_bytes() const;  // the amax histories' host memory

 private:
  struct Linear {
    bool fp8 = false;
    bool split_w = false, split_x = false, split_dy = false;  // sharded over tp
    std::vector<float> history[3];                            // delayed: newest last
    float pending[3] = {0, 0, 0};                             // delayed: this step's max so far
    float first[3] = {0, 0, 0};  // the largest amax a per-tensor scale was taken from in step 1
    std::string name;
  };
  void write_first_step_amax() const;
  void report_saturation(long step, const std::vector<float>& amax);
  Quantized operand(int entry, Role r, const Tensor& t, int tr, int tc, DType format);
  float reduced_amax(int entry, Role r, const Tensor& t);
  DType grad_format() const;
  Fp8Config cfg_;
  std::vector<Linear> lin_;
  MPI_Comm tp_, cp_, step_;
  long last_step_ = -1;
  Accum acc_;
  RunLog* log_;
  long saturated_steps_ = 0;  // steps in which some tensor saturated
};

// Installs rc.fp8's recipe on m (nothing when --dtype is not fp8), with the groups of `mesh`,
// after checking that blockwise tiles fit this rank's shards; prints the recipe.
void install(Model& m, const RunConfig& rc, Mesh& mesh, RunLog& log);

}  // namespace ts::fp8
