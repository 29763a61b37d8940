// profile.cu — per-op totals of the outermost kernel calls (profile.h).
#include "kernels/profile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "tensor/core.h"

namespace ts {

static double wall_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ----- per-op profile -----------------------------------------------------------------------------

struct OpTotals {
  long calls = 0;
  double us = 0;
};
static std::map<std::string, OpTotals> g_ops;
static int g_depth = 0;

bool ProfileScope::enabled() {
  static const bool on = [] {
    const char* e = getenv("TS_PROFILE");
    return e && std::string(e) == "1";
  }();
  return on;
}

ProfileScope::ProfileScope(const char* op, int device) : op_(op), device_(device) {
  if (!enabled() || g_depth++ > 0) return;
  start_ = wall_us();
}

ProfileScope::~ProfileScope() {
  if (!enabled()) return;
  g_depth--;
  if (start_ < 0) return;
  device_sync(Device(device_));
  OpTotals& t = g_ops[op_];
  t.calls++;
  t.us += wall_us() - start_;
}

void ProfileScope::reset() { g_ops.clear(); }

void ProfileScope::print() {
  if (!enabled() || world_rank() != 0) return;
  std::vector<std::pair<std::string, OpTotals>> v(g_ops.begin(), g_ops.end());
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.second.us > b.second.us; });
  double total = 0;
  for (auto& e : v) total += e.second.us;
  printf("profile (the training steps, outermost kernel calls)\n%-32s %8s %12s %8s\n", "op", "calls", "ms", "share");
  for (auto& e : v)
    printf("%-32s %8ld %12.2f %7.1f%%\n", e.first.c_str(), e.second.calls, e.second.us / 1e3, 100 * e.second.us / total);
  printf("%-32s %8s %12.2f\n", "total in kernels", "", total / 1e3);
}

}  // namespace ts
