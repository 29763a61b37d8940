// report.h — the step log, the run summary, the memory table and the per-group comm report.
#pragma once
#include <chrono>
#include <cmath>
#include <map>
#include <string>

#include "tensor/core.h"
#include "formats/json.h"
#include "training/config.h"
#include "training/memory_model.h"

namespace ts {

// The per-step record, printed as a line and written as a JSON line.
struct StepRecord {
  long step;
  double loss, lr, grad_norm, tokens_per_s, mfu, step_ms;
  size_t peak_mem_bytes;
  Json extra;        // merged into the JSON record
  std::string note;  // appended to the printed line
  double flops_per_s = 0;  // the job's model FLOP/s (6N + 12·L·h·s per token): the line without a peak
  double eval_loss = NAN;  // the held-out loss after this step's update, on the --eval-every steps
};
double peak_tflops_for(Device dev, DType dt, double override_tflops);
std::string device_description(Device dev);

class RunLog {
 public:
  RunLog(const RunConfig& rc, Device dev);  // rank 0 opens --log-json
  // Every step goes to the JSON log; a line "step 120/4000 | … | ETA 1m05s" is printed on the
  // --log-every cadence, or under --quiet once every --progress-seconds.
  void step(const StepRecord& r);
  // memory: category -> {measured, predicted}; comm: group -> op -> {calls, bytes, predicted}.
  void summary(Json s);
  // A JSON line {"event": ..., "step": ...} between the step records (a spike, a non-finite
  // step: numerics.h); rank 0 only, like every line of the log.
  void event(const Json& e);
  void line(const char* fmt, ...) __attribute__((format(printf, 2, 3)));  // rank 0 only
  ~RunLog();
 private:
  bool line_due(long step, std::chrono::steady_clock::time_point now) const;
  const RunConfig& rc_;
  FILE* json_ = nullptr;
  bool rank0_;
  long every_ = 1, first_ = -1;  // first_: the first step this run logged
  std::chrono::steady_clock::time_point start_, last_line_;
};


// The summary's "comm" object for one group: per op, calls, wire bytes and payload bytes per step
// (the group's counters divided by the steps run) next to the predicted wire bytes per step.
Json comm_report(RunLog& log, const class Comm& group, long steps, const std::map<std::string, double>& predicted);

// "1.23 MiB"
std::string human_bytes(double b);
// The memory table: each category measured (this rank's allocator, per-category peak of bytes in
// use) next to the prediction, then the total peak and the allocator's reserved peak (cached
// free blocks included); returned as the summary's "memory" object.
// `staged`: the bytes an asynchronous save held staged (0: no row), next to pred.staging.
Json memory_report(RunLog& log, Device dev, const MemoryPrediction& pred, size_t staged = 0);

}  // namespace ts
