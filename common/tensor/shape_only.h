// shape_only.h — the shape-only device (--device shape): tensors with shapes, dtypes and sizes but
// no values. The tagging allocator (allocator.h) counts them exactly as it counts CPU tensors (the
// same blocks, bins, peaks and categories), but a block's bytes come from one reserved, never-committed
// address range, so a rank of a 405B model costs no host memory; the ops of kernels.h check their
// arguments and return without computing, and copies move nothing. What a run prints from values
// (losses, gradient norms) is meaningless and left out; everything sizes decide (the plan, memory
// per category, bytes per collective) is what the real run would print. The fake world
// (comm/fake_world.h) uses it to run one rank of a job of any size in one process.
#pragma once
#include <cstddef>

namespace ts {

// True once --device shape has chosen the device (parse_device): every tensor of the process is
// shape-only from then on.
bool shape_only();
void enable_shape_only();
// A block of `bytes` from the reserved range: the address a CPU block would have, never touched.
void* shape_block(size_t bytes);
// Whether p lies in that range (a shape-only tensor's bytes, which nothing may read or write).
bool shape_only_block(const void* p);

}  // namespace ts

// The first statement of every op of kernels.h after its argument checks: a shape-only tensor
// is never computed on.
#define TS_SHAPE_ONLY_SKIP(...) \
  do {                          \
    if (::ts::shape_only()) return __VA_ARGS__; \
  } while (0)
