// trace.cu — event buffer per rank, merged by rank 0 with MPI_Gatherv.
#include "comm/trace.h"

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "tensor/core.h"
#include "comm/comm.h"
#include "comm/watchdog.h"

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

}  // namespace ts
