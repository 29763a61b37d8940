// report.h — the step log, the run summary, the memory table and the per-group comm report.
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "formats/json.h"
#include "training/config.h"
#include "training/log.h"
#include "training/memory_model.h"
#include "training/train.h"

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

// The summary's "comm" object for one group: per op, calls, wire bytes and payload bytes per step
// (the group's counters divided by the steps run) next to the predicted wire bytes per step.
Json comm_report(RunLog& log, const class Comm& group, long steps, const std::map<std::string, double>& predicted);

// The model's shape, Ψ and FLOPs per token (the first lines of every run).
void print_model(RunLog& log, const ModelConfig& m);

// "1.23 MiB"
std::string human_bytes(double b);
// The memory table: each category measured (this rank's allocator, per-category peak of bytes in
// use) next to the prediction, then the total peak and the allocator's reserved peak (cached
// free blocks included); returned as the summary's "memory" object.
// `staged`: the bytes an asynchronous save held staged (0: no row), next to pred.staging.
Json memory_report(RunLog& log, Device dev, const MemoryPrediction& pred, size_t staged = 0);

// With --experts: sums the step's routing statistics over token_groups (the groups whose ranks
// routed different tokens; none in 01) into r's log fields and note, then resets them. With
// --router sigmoid it first moves the routing bias by those summed loads (call it after the
// optimizer step; master: the optimizer's fp32 master copy, undefined when it has none).
void moe_step_report(Model& m, StepResult& r, const std::vector<MPI_Comm>& token_groups,
                     const Tensor& master = Tensor());

}  // namespace ts
