// log.h — the run's log: the step lines a learner reads and the --log-json records (rank 0 only).
// What goes into a step's record and the summary's tables is report.h's.
#pragma once
#include <chrono>
#include <cstdio>
#include <vector>

#include "formats/json.h"
#include "training/config.h"

namespace ts {

struct StepRecord;  // report.h

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
  // The steps since the last line: a line shows the rates of their median step.
  struct Rate {
    double tokens_per_s, mfu, flops_per_s, step_ms;
  };
  std::vector<Rate> since_line_;
};

}  // namespace ts
