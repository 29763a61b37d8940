// skip_shared_expert, in 07_expert_parallel: DeepSeekMoE's shared experts run but their output is
// dropped, so every token gets only its routed experts (tests/test_ep.cpp, "seeded bugs"). Wraps
// the swiglu_mlp_forward that the MoE block's shared experts call (the only SwiGLU MLP of a mixture
// of experts model) and zeroes what it wrote.
#include "bug.h"
#include "model/mlp_block.h"
#include "kernels/kernels.h"
#include "model/model.h"

void real_swiglu_mlp_forward(ts::Model& m, const ts::SwiGluWeights& w, const ts::Tensor& y, const ts::Tensor& h,
                             ts::Tensor& g, ts::Tensor& u, ts::Tensor& act)
    __asm__("__real__ZN2ts18swiglu_mlp_forwardERNS_5ModelERKNS_13SwiGluWeightsERKNS_6TensorES7_RS5_S8_S8_");
void skip_swiglu_mlp_forward(ts::Model& m, const ts::SwiGluWeights& w, const ts::Tensor& y, const ts::Tensor& h,
                             ts::Tensor& g, ts::Tensor& u, ts::Tensor& act)
    __asm__("__wrap__ZN2ts18swiglu_mlp_forwardERNS_5ModelERKNS_13SwiGluWeightsERKNS_6TensorES7_RS5_S8_S8_");

void skip_swiglu_mlp_forward(ts::Model& m, const ts::SwiGluWeights& w, const ts::Tensor& y, const ts::Tensor& h,
                             ts::Tensor& g, ts::Tensor& u, ts::Tensor& act) {
  real_swiglu_mlp_forward(m, w, y, h, g, u, act);
  bug::announce("skip_shared_expert");
  ts::fill(y, 0.f);
}
