// profile.h — per-op time (TS_PROFILE=1): each public kernel of kernels.h opens a ProfileScope,
// and bench.sh's "where the time goes" prints the totals.
#pragma once

namespace ts {

// Per-op time when TS_PROFILE=1 (bench.sh's "where the time goes"). Each public kernel opens a
// ProfileScope; only the outermost scope counts, so linear_forward is not counted again as the
// matmul it calls. On CUDA the scope synchronises the device so GPU time lands on the right op.
class ProfileScope {
 public:
  ProfileScope(const char* op, int device);  // device: int(Device)
  ~ProfileScope();
  static bool enabled();
  static void print();  // rank 0: op, calls, ms, share of the profiled total
  static void reset();  // forget what was timed so far (initialisation)

 private:
  const char* op_;
  int device_;
  double start_ = -1;
};
#define TS_PROFILE_OP(name, tensor) ::ts::ProfileScope ts_profile_scope_(name, int((tensor).device()))

}  // namespace ts
