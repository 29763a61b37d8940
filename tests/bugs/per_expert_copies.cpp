// per_expert_copies, in 07_expert_parallel --dispatch two-level: a token crosses to a node once per
// expert it has there instead of once per node (tests/test_ep.cpp, "seeded bugs"). The plan tells
// a token's rows apart by the token of each row (the routing plan's perm, the one-dimensional int32
// tensor 07 downloads with to_host_i32); this wraps that download and numbers every row as a token
// of its own. Each copy still carries its token's row to its one expert, and its partial sum back
// (one expert's weighted output, added at the token's rank with the token's others), so the run
// computes what it did; only the bytes that cross nodes, on every hop one row per (token, expert)
// instead of per (token, node), give the bug away.
#include <vector>

#include "bug.h"

std::vector<int32_t> real_to_host_i32(const ts::Tensor& t) __asm__("__real__ZN2ts11to_host_i32ERKNS_6TensorE");
std::vector<int32_t> per_expert_to_host_i32(const ts::Tensor& t) __asm__("__wrap__ZN2ts11to_host_i32ERKNS_6TensorE");

std::vector<int32_t> per_expert_to_host_i32(const ts::Tensor& t) {
  std::vector<int32_t> v = real_to_host_i32(t);
  if (t.dim() != 1) return v;  // the router's choices and the slots' rows are [N, K]
  bug::announce("per_expert_copies");
  for (size_t i = 0; i < v.size(); i++) v[i] = int32_t(i);
  return v;
}
