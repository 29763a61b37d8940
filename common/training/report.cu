// report.cu — the step log, the run summary, the memory table and the per-group comm report.
#include "training/report.h"
#include "tensor/allocator.h"

#include "comm/comm.h"
#include "training/run.h"
#include "tensor/device.h"
#include "tensor/shape_only.h"
#include "comm/fake_world.h"
#include "comm/watchdog.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>

namespace ts {

std::string human_bytes(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::fabs(b) >= 1024 && i < 4) b /= 1024, i++;
  char buf[32];
  snprintf(buf, sizeof buf, i ? "%.2f %s" : "%.0f %s", b, u[i]);
  return buf;
}

std::string device_description(Device dev) {
  if (shape_only()) return "shape (tensors with sizes and no values, counted as the CPU's; no kernel runs)";
#ifdef TS_CUDA
  if (dev == Device::CUDA) {
    int d = 0;
    cudaGetDevice(&d);
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, d));
    return p.name;
  }
#endif
  (void)dev;
  return "cpu";
}

// The playbook's peak table (dense, no sparsity) by device name; the CPU has no meaningful
// entry, so MFU there is reported against --peak-tflops only (0 otherwise).
double peak_tflops_for(Device dev, DType dt, double override_tflops) {
  if (override_tflops > 0) return override_tflops;
  std::string n = device_description(dev);
  bool bf = dt == DType::BF16;
  if (n.find("H100") != std::string::npos || n.find("H200") != std::string::npos) return bf ? 989 : 67;
  if (n.find("A100") != std::string::npos) return bf ? 312 : 19.5;
  return 0;
}

RunLog::RunLog(const RunConfig& rc, Device) : rc_(rc), rank0_(world_rank() == 0) {
  check_output_paths(rc);
  every_ = rc.log_every > 0 ? rc.log_every : std::max(1L, (rc.steps + 49) / 50);
  if (rank0_ && !rc.log_json.empty()) {
    json_ = fopen(rc.log_json.c_str(), "w");
    if (!json_) config_error("--log-json %s: cannot open for writing", rc.log_json.c_str());
  }
}

RunLog::~RunLog() {
  if (json_) fclose(json_);
}

void RunLog::line(const char* fmt, ...) {
  if (!rank0_) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n");
  fflush(stdout);
}

// "45s", "3m05s", "2h07m"
static std::string short_duration(double s) {
  char buf[32];
  const long t = std::lround(s);
  if (t < 60) snprintf(buf, sizeof buf, "%lds", t);
  else if (t < 3600) snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, t % 3600 / 60);
  return buf;
}

bool RunLog::line_due(long step, std::chrono::steady_clock::time_point now) const {
  if (rc_.quiet) return std::chrono::duration<double>(now - last_line_).count() >= rc_.progress_seconds;
  return step == first_ || step + 1 == rc_.steps || step % every_ == 0;
}

// " | eval 2.345678" on the steps that evaluated.
static std::string eval_field(double eval_loss) {
  if (!std::isfinite(eval_loss)) return "";
  char buf[32];
  snprintf(buf, sizeof buf, " | eval %.6f", eval_loss);
  return buf;
}

void RunLog::step(const StepRecord& r) {
  if (!rank0_) return;
  const auto now = std::chrono::steady_clock::now();
  if (first_ < 0) {
    if (shape_only()) printf("shape-only device: tensors have sizes but no values, so no loss or gradient norm is printed\n");
    first_ = r.step;
    start_ = last_line_ = now - std::chrono::microseconds(std::llround(r.step_ms * 1e3));
  }
  since_line_.push_back({r.tokens_per_s, r.mfu, r.flops_per_s, r.step_ms});
  if (line_due(r.step, now) || std::isfinite(r.eval_loss)) {  // an evaluation is always shown
    // The rates shown are the median step's since the previous line (by tokens/s), not this
    // step's alone: one step is one draw, and on a shared machine a step can take twice the
    // median, so lines that showed single steps disagreed with the summary's median of every step
    // (make demo's read about 104k tokens/s beside a median of 149k). Each line and the summary
    // are now the same statistic, the median step, of the window and of the run; the JSON log
    // keeps every step's own time.
    std::sort(since_line_.begin(), since_line_.end(),
              [](const Rate& a, const Rate& b) { return a.tokens_per_s < b.tokens_per_s; });
    const Rate m = since_line_[since_line_.size() / 2];
    since_line_.clear();
    // The mean wall time per step of this run so far, saves and logging included.
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const long done = r.step + 1 - first_, left = rc_.steps - r.step - 1;
    const std::string eta = left > 0 ? "ETA " + short_duration(elapsed / double(done) * double(left))
                                     : "took " + short_duration(elapsed);
    const int width = int(std::to_string(rc_.steps).size());
    // MFU needs a peak (known GPUs, or --peak-tflops); without one the achieved rate says more than 0.00%.
    char rate[32];
    if (m.mfu > 0) snprintf(rate, sizeof rate, "MFU %5.2f%%", 100 * m.mfu);
    else snprintf(rate, sizeof rate, "%6.2f GFLOP/s", m.flops_per_s * 1e-9);
    if (shape_only())  // tensors without values: no loss, no gradient norm (tensor/shape_only.h)
      printf("step %*ld/%ld | lr %.3e | %7.1f ms | peak %s%s | %s\n", width, r.step, rc_.steps, r.lr, m.step_ms,
             human_bytes(double(r.peak_mem_bytes)).c_str(), r.note.c_str(), eta.c_str());
    else
      printf("step %*ld/%ld | loss %.6f%s | lr %.3e | grad norm %.4f | %8.0f tok/s | %s | %7.1f ms | peak %s%s | %s\n",
             width, r.step, rc_.steps, r.loss, eval_field(r.eval_loss).c_str(), r.lr, r.grad_norm, m.tokens_per_s, rate,
             m.step_ms, human_bytes(double(r.peak_mem_bytes)).c_str(), r.note.c_str(), eta.c_str());
    fflush(stdout);
    last_line_ = now;
  }
  if (json_) {
    Json j = Json::object();
    j["step"] = r.step;
    if (!shape_only()) j["loss"] = r.loss;
    if (std::isfinite(r.eval_loss)) j["eval_loss"] = r.eval_loss;
    j["lr"] = r.lr;
    if (!shape_only()) j["grad_norm"] = r.grad_norm;
    j["tokens_per_s"] = r.tokens_per_s;
    j["mfu"] = r.mfu;
    j["flops_per_s"] = r.flops_per_s;
    j["step_ms"] = r.step_ms;
    j["peak_mem_bytes"] = int64_t(r.peak_mem_bytes);
    if (r.extra.is_object())
      for (const auto& [k, v] : r.extra.items()) j[k] = v;
    fprintf(json_, "%s\n", j.dump().c_str());
    fflush(json_);
  }
}

void RunLog::summary(Json s) {
  if (!rank0_ || !json_) return;
  Json j = Json::object();
  j["summary"] = std::move(s);
  fprintf(json_, "%s\n", j.dump().c_str());
  fflush(json_);
}

void RunLog::event(const Json& e) {
  if (!rank0_ || !json_) return;
  fprintf(json_, "%s\n", e.dump().c_str());
  fflush(json_);
}

Json comm_report(RunLog& log, const Comm& group, long steps, const std::map<std::string, double>& predicted) {
  Json ops = Json::object();
  const double n = double(std::max(1L, steps));
  for (auto& [op, s] : group.stats()) {
    Json o = Json::object();
    o["calls"] = double(s.calls) / n;
    o["bytes"] = s.wire_bytes / n;
    o["payload_bytes"] = s.payload_bytes / n;
    const double p = predicted.count(op) ? predicted.at(op) : 0.0;
    o["predicted"] = p;
    log.line("comm %-6s %-14s per step: %6.1f calls, %12s sent per rank, predicted %12s", group.name().c_str(),
             op.c_str(), double(s.calls) / n, human_bytes(s.wire_bytes / n).c_str(), human_bytes(p).c_str());
    ops[op] = std::move(o);
  }
  Json c = Json::object();
  c[group.name()] = std::move(ops);
  return c;
}

// Every rank's peak per category, gathered on rank 0 for the JSON log (null on one rank): the
// table shows rank 0's, and a pipeline's last stage is not its first (tests/test_fake_world.cpp
// holds a fake world's rank R to the real job's rank R with it).
static Json peaks_of_every_rank(const MemStats& s) {
  int world = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (world == 1) return Json();
  std::vector<long long> mine(s.peak, s.peak + kNumTags), all(size_t(world) * kNumTags);
  watched_gather(mine.data(), kNumTags, MPI_LONG_LONG, all.data(), 0, MPI_COMM_WORLD, "gather (each rank's memory peaks)");
  Json ranks = Json::array();
  for (int r = 0; rank == 0 && r < world; r++) {
    Json o = Json::object();
    for (int t = 0; t < kNumTags; t++) o[tag_name(Tag(t))] = int64_t(all[size_t(r) * kNumTags + t]);
    ranks.push_back(std::move(o));
  }
  return ranks;
}

Json memory_report(RunLog& log, Device dev, const MemoryPrediction& pred, size_t staged) {
  const MemStats& s = mem_stats(dev);
  const double predicted[kNumTags] = {pred.params, pred.grads, pred.optimizer, pred.activations, -1, -1};
  Json mem = Json::object();
  log.line("memory (rank %d, peak per category)   measured        predicted   measured/predicted",
           fake_world() ? fake_world_rank() : 0);
  for (int t = 0; t < kNumTags; t++) {
    Json c = Json::object();
    c["measured"] = int64_t(s.peak[t]);
    if (predicted[t] >= 0) {
      c["predicted"] = int64_t(std::llround(predicted[t]));
      log.line("  %-12s %22s %16s   %.4f", tag_name(Tag(t)), human_bytes(double(s.peak[t])).c_str(),
               human_bytes(predicted[t]).c_str(), predicted[t] > 0 ? double(s.peak[t]) / predicted[t] : 0.0);
    } else {
      log.line("  %-12s %22s", tag_name(Tag(t)), human_bytes(double(s.peak[t])).c_str());
    }
    mem[tag_name(Tag(t))] = std::move(c);
  }
  if (pred.comm_holds.empty()) {
    log.line("  (no prediction for comm: host staging of CUDA tensors sent over MPI when ranks share a GPU; nor for workspace:");
  } else {
    log.line("  (no prediction for comm: %s,", pred.comm_holds.c_str());
    log.line("   and host staging of CUDA tensors sent over MPI when ranks share a GPU; nor for workspace:");
  }
  log.line("   scratch freed within one call, chiefly the fp32 weight copy at init, resume and save, and kernel temporaries)");
  if (staged > 0) {  // host memory, outside the device's categories
    log.line("  %-12s %22s %16s   %.4f   (--async-save: fp32 weights + 2 moments written, 12 B x Ψ_opt)", "ckpt staging",
             human_bytes(double(staged)).c_str(), human_bytes(pred.staging).c_str(),
             pred.staging > 0 ? double(staged) / pred.staging : 0.0);
    Json c = Json::object();
    c["measured"] = int64_t(staged);
    c["predicted"] = int64_t(std::llround(pred.staging));
    mem["checkpoint_staging"] = std::move(c);
  }
  log.line("  %-12s %22s", "total peak", human_bytes(double(s.total_peak)).c_str());
  log.line("  %-12s %22s   (allocator, incl. cached free blocks)", "reserved",
           human_bytes(double(s.reserved_peak)).c_str());
  if (shape_only()) {  // the proof that the tensors above took no memory
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    log.line("  (--device shape: this process's peak resident memory was %s; the tensors' bytes were never allocated)",
             human_bytes(double(u.ru_maxrss) * 1024).c_str());
  }
  mem["total_peak"] = int64_t(s.total_peak);
  if (Json ranks = peaks_of_every_rank(s); !ranks.is_null()) mem["ranks"] = std::move(ranks);
  mem["reserved_peak"] = int64_t(s.reserved_peak);
  return mem;
}

}  // namespace ts
