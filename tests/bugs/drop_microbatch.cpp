// drop_microbatch, in 02_data_parallel: the gradient buffer zeroed before every micro-batch of a
// step but the first, so each step keeps only its last micro-batch's gradients (the accumulation
// of notes/00's data order lost). Wraps Model::forward_backward, which 02's train_step calls once
// per micro-batch.
#include "bug.h"
#include "tensor/hooks.h"
#include "model/model.h"

using ts::Tensor;

void real_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                           const Tensor& pos) __asm__("__real__ZN2ts5Model16forward_backwardERKNS_6TensorES3_ifS3_");
void dropping_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                               const Tensor& pos) __asm__("__wrap__ZN2ts5Model16forward_backwardERKNS_6TensorES3_ifS3_");

// The step loop numbers the steps (ts::current_step): a second call in the same step is a later
// micro-batch.
void dropping_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                               const Tensor& pos) {
  static long last_step = -2;
  if (ts::current_step() == last_step) {
    bug::announce("drop_microbatch");
    ts::zero(m.grads);
  }
  last_step = ts::current_step();
  real_forward_backward(m, inputs, targets, B, grad_scale, pos);
}
