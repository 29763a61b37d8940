// trace.cu — event buffer per rank, merged by rank 0 with MPI_Gatherv.
#include "trace.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "comm.h"
#include "core.h"

namespace ts {

static double wall_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Trace::Trace() : t0_(wall_us()) {}

Trace& Trace::get() {
  static Trace t;
  return t;
}

double Trace::now_us() const { return wall_us() - t0_; }

void Trace::add(const std::string& name, Lane lane, double start_us, double dur_us) {
  if (!enabled_) return;
  char buf[512];
  snprintf(buf, sizeof buf, "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f}",
           name.c_str(), world_rank(), int(lane), start_us, dur_us);
  events_.push_back(buf);
}

void Trace::write(const std::string& path) {
  int rank = world_rank(), world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  // Lane names, so Perfetto shows "compute" and "comm" instead of thread ids.
  const char* lanes[] = {"compute", "comm", "comm 2"};
  std::string mine;
  for (int l = 0; l < 3; l++) {
    char buf[160];
    snprintf(buf, sizeof buf, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},",
             rank, l, lanes[l]);
    mine += buf;
  }
  for (const std::string& e : events_) mine += e + ",";
  int n = int(mine.size());
  std::vector<int> sizes(world), offs(world);
  watched_gather(&n, 1, MPI_INT, sizes.data(), 0, MPI_COMM_WORLD, "gather (the trace's sizes)");
  std::string all;
  if (rank == 0) {
    int total = 0;
    for (int r = 0; r < world; r++) offs[r] = total, total += sizes[r];
    all.resize(size_t(total));
  }
  watched_gatherv(mine.data(), n, MPI_CHAR, rank == 0 ? &all[0] : nullptr, sizes.data(), offs.data(), 0,
                  MPI_COMM_WORLD, "gather (the trace's events)");
  if (rank != 0) return;
  if (!all.empty()) all.pop_back();  // the trailing comma
  FILE* f = fopen(path.c_str(), "w");
  if (!f) fatal("--trace %s: cannot open for writing", path.c_str());
  fprintf(f, "{\"traceEvents\":[%s]}\n", all.c_str());
  fclose(f);
}

TraceScope::TraceScope(std::string name, Lane lane) : name_(std::move(name)), lane_(lane) {
  start_ = Trace::get().enabled() ? Trace::get().now_us() : 0;
}

TraceScope::~TraceScope() {
  Trace& t = Trace::get();
  if (t.enabled()) t.add(name_, lane_, start_, t.now_us() - start_);
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
