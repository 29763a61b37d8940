// swap_fg, in 04_tensor_parallel: Megatron's f and g exchanged in layer 0's MLP backward. The
// gradient entering the row-parallel down_proj gets f's backward (the all-reduce) instead of g's
// (the identity), and the one leaving the column-parallel gate/up gets g's instead of f's. Wraps
// Model::forward_backward, which 04's train_step calls, to put a TpOps around 04's own on the
// first call.
#include <memory>

#include "bug.h"
#include "model/tp_ops.h"
#include "model/mlp_block.h"
#include "model/model.h"

using ts::Tensor;

void real_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                           const Tensor& pos) __asm__("__real__ZN2ts5Model16forward_backwardERKNS_6TensorES3_ifS3_");
void swapping_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                               const Tensor& pos) __asm__("__wrap__ZN2ts5Model16forward_backwardERKNS_6TensorES3_ifS3_");

namespace {

// The tensor-parallel operators of the run, but in unit 1's backward the first g backward (the
// MLP's, on its output gradient) runs f's, and the f backward after it (the MLP's, on its input
// gradient, before the norm) runs g's; the attention's f and g after them are untouched.
class SwappedFg : public ts::TpOps {
 public:
  explicit SwappedFg(std::unique_ptr<ts::TpOps> inner) : inner_(std::move(inner)) {}
  void begin_backward(int unit) { next_ = unit == 1 ? Next::MlpG : Next::None; }
  Tensor f_forward(const Tensor& x) override { return inner_->f_forward(x); }
  Tensor g_forward(const Tensor& y, ts::Tag tag) override { return inner_->g_forward(y, tag); }
  Tensor g_backward(const Tensor& dy) override {
    if (next_ != Next::MlpG) return inner_->g_backward(dy);
    bug::announce("swap_fg");
    next_ = Next::MlpF;
    return inner_->f_backward(dy);
  }
  Tensor f_backward(const Tensor& dx) override {
    if (next_ != Next::MlpF) return inner_->f_backward(dx);
    next_ = Next::None;
    return inner_->g_backward(dx);
  }

 private:
  enum class Next { None, MlpG, MlpF };
  std::unique_ptr<ts::TpOps> inner_;
  Next next_ = Next::None;
};

}  // namespace

// A block replicated over tp (MoE) has no f and g around it: there is nothing to exchange.
void swapping_forward_backward(ts::Model& m, const Tensor& inputs, const Tensor& targets, int B, float grad_scale,
                               const Tensor& pos) {
  static const ts::Model* wrapped = nullptr;
  if (wrapped != &m && m.mlp->split_over_tp()) {
    auto swapped = std::make_unique<SwappedFg>(std::move(m.tp));
    SwappedFg* fg = swapped.get();
    m.before_backward.add([fg](int u) { fg->begin_backward(u); });
    m.tp = std::move(swapped);
    wrapped = &m;
  }
  real_forward_backward(m, inputs, targets, B, grad_scale, pos);
}
