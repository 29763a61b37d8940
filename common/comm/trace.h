// trace.h — Chrome trace events (chrome://tracing, Perfetto): one process per rank, one lane for
// compute and one per communication stream, merged from all ranks into one file by rank 0.
#pragma once
#include <string>
#include <vector>

namespace ts {

enum class Lane { Compute = 0, Comm = 1, Comm2 = 2 };

class Trace {
 public:
  static Trace& get();
  bool enabled() const { return enabled_; }
  void enable() { enabled_ = true; }
  double now_us() const;  // microseconds since the process started tracing
  // A complete event [start, start + dur) on a lane.
  void add(const std::string& name, Lane lane, double start_us, double dur_us);
  // Gathers every rank's events to rank 0 and writes {"traceEvents": [...]}. Collective.
  void write(const std::string& path);

 private:
  Trace();
  bool enabled_ = false;
  double t0_;
  std::vector<std::string> events_;  // JSON objects
};

// Records the enclosing scope as one event on a lane (no-op when tracing is off).
class TraceScope {
 public:
  TraceScope(std::string name, Lane lane = Lane::Compute);
  ~TraceScope();

 private:
  std::string name_;
  Lane lane_;
  double start_;
};

}  // namespace ts
