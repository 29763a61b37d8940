// linear_gemms.h — the dense linears' three GEMMs, the extension point FP8 training swaps (model.h).
#pragma once
#include "model/model.h"

namespace ts {

// The dense linears' three GEMMs — q/k/v/o and the SwiGLU MLP's gate/up/down, addressed by
// their table entry — are swappable: FP8 training quantizes their operands (fp8_linear.h). The
// defaults are the compute dtype's matmuls. The LM head, the embedding and MoE experts do not
// come through here.
struct LinearGemms {
  virtual ~LinearGemms() = default;
  // y [N, out] := x [N, in] · W^T (the forward GEMM)
  virtual void forward(int entry, const Tensor& y, const Tensor& x, const Tensor& W);
  // dx [N, in] := dy · W, or += when accumulate (the input-gradient GEMM, "dgrad")
  virtual void input_grad(int entry, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate);
  // dW [out, in] fp32 += dy^T · x (the weight-gradient GEMM, "wgrad")
  virtual void weight_grad(int entry, const Tensor& dW, const Tensor& dy, const Tensor& x);
  // Once per optimizer step, before the update (AdamW::step calls it on every rank; a repeated
  // call for the same step does nothing): where a recipe keeps per-step state.
  virtual void end_step(long step) { (void)step; }
};

}  // namespace ts
