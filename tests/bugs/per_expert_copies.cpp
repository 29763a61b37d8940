// per_expert_copies, in 07_expert_parallel --dispatch two-level: a token crosses to a node once per
// expert it has there instead of once per node (tests/test_ep.cpp, "seeded bugs"). The plan tells
// a token's rows apart by the token of each row (the routing plan's perm, which 07 downloads into a
// one-dimensional int32 host tensor of Tag::Comm); this wraps that download and numbers every row
// as a token of its own. Each copy still carries its token's row to its one expert, and its partial
// sum back (one expert's weighted output, added at the token's rank with the token's others), so
// the run computes what it did; only the bytes that cross nodes, on every hop one row per
// (token, expert) instead of per (token, node), give the bug away.
#include "bug.h"

void real_copy(const ts::Tensor& dst, const ts::Tensor& src) __asm__("__real__ZN2ts4copyERKNS_6TensorES2_");
void per_expert_copy(const ts::Tensor& dst, const ts::Tensor& src) __asm__("__wrap__ZN2ts4copyERKNS_6TensorES2_");

void per_expert_copy(const ts::Tensor& dst, const ts::Tensor& src) {
  real_copy(dst, src);
  if (dst.device() != ts::Device::CPU || dst.dtype != ts::DType::I32 || dst.dim() != 1 || dst.buf->tag != ts::Tag::Comm)
    return;
  bug::announce("per_expert_copies");
  for (int64_t i = 0; i < dst.numel(); i++) dst.i32()[i] = int32_t(i);
}
