// attention_core.h — the model's attention core, the extension point context parallelism swaps (model.h).
#pragma once
#include "model/model.h"

namespace ts {

// The attention core (scaled-dot-product over already projected, rotated q/k/v) is swappable:
// context parallelism replaces it with ring attention or Ulysses. The model reads q, k, v and lse
// only to hand them back to backward, so a core may keep them in its own layout (Ulysses keeps
// the head-sharded ones, of the same sizes).
struct AttentionCore {
  virtual ~AttentionCore() = default;
  virtual void forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& pos) = 0;
  virtual void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& pos) = 0;
};

}  // namespace ts
