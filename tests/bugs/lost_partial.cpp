// lost_partial, in 07_expert_parallel --dispatch two-level: a token's rank forgets the partial sum
// of the last node its experts are on (tests/test_ep.cpp, "seeded bug: a lost partial"). The
// combine sums one partial row per (token, node) at the token's rank with moe_combine and no gate
// weights (they were applied on the experts' node); this wraps 07's unweighted moe_combine calls and
// drops each output row's last source where it has two or more. It also hits the backward's
// entry, which sums its experts' input gradients the same way; at --group-limit 2 the forward
// alone changes step 0's loss.
#include <vector>

#include "bug.h"

void real_moe_combine(const ts::Tensor& y, const ts::Tensor& x, const ts::Tensor& src, const ts::Tensor& w)
    __asm__("__real__ZN2ts11moe_combineERKNS_6TensorES2_S2_S2_");
void lost_moe_combine(const ts::Tensor& y, const ts::Tensor& x, const ts::Tensor& src, const ts::Tensor& w)
    __asm__("__wrap__ZN2ts11moe_combineERKNS_6TensorES2_S2_S2_");

void lost_moe_combine(const ts::Tensor& y, const ts::Tensor& x, const ts::Tensor& src, const ts::Tensor& w) {
  if (w.defined() || src.numel() == 0) return real_moe_combine(y, x, src, w);
  ts::Tensor h = ts::Tensor::empty(src.shape, ts::DType::I32, ts::Device::CPU, ts::Tag::Workspace);
  ts::copy(h, src);
  std::vector<int32_t> s(h.i32(), h.i32() + h.numel());
  const int64_t K = src.size(1);
  bool lost = false;
  for (size_t t = 0; t < s.size(); t += size_t(K)) {
    int64_t last = K - 1;
    while (last > 0 && s[t + size_t(last)] < 0) last--;
    if (last > 0) s[t + size_t(last)] = -1, lost = true;
  }
  if (lost) bug::announce("lost_partial");
  real_moe_combine(y, x, ts::from_host_i32(s, src.device()).reshape(src.shape), w);
}
