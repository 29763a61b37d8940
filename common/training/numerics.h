// numerics.h — what the training loop watches in the numbers themselves: per-unit gradient norms
// and activation RMS (--numerics-every), the first non-finite value of a diverged step (which
// unit, which tensor, forward or backward), and loss and gradient-norm spikes against a rolling
// window (--spike-window, --spike-sigma), with what a spike does (--on-spike report|stop|skip|
// rewind), and the batch order a rewind leaves (the batches it skipped, saved in checkpoints).
//
// Every technique goes through the same three shared calls, so none of them knows about this:
// init_or_resume attaches the numerics to the finished model (its unit_output/unit_input_grad
// hooks and a wrapper round its loss function), global_grad_norm hands over the step's norm (and
// the per-unit norms when due), and AdamW::step asks allow_update() before it touches anything.
#pragma once
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "formats/json.h"
#include "model/model.h"
#include "training/config.h"

namespace ts {

class RunLog;

// The values of the last `size` steps; a value is a spike when the window is full and it lies
// above mean + sigma · std (population std), as OLMo-core's skip-step optimizer tests it.
class SpikeWindow {
 public:
  SpikeWindow(int size = 0, double sigma = 0) : size_(size), sigma_(sigma) {}
  bool full() const { return size_ > 0 && int(v_.size()) == size_; }
  bool is_spike(double v) const { return full() && v > threshold(); }
  double mean() const;
  double stddev() const;
  double threshold() const { return mean() + sigma_ * stddev(); }
  void push(double v);  // the oldest value leaves once the window is full
 private:
  int size_;
  double sigma_;
  std::deque<double> v_;
};

// One step's verdict: which of its two values spiked, with the window they were tested against.
struct SpikeVerdict {
  bool loss = false, norm = false;
  double loss_value = 0, loss_threshold = 0, norm_value = 0, norm_threshold = 0;
  bool any() const { return loss || norm; }
};

// Where a non-finite value was first seen on this rank: `key` orders the places the way a step
// computes them (forward units, the loss, backward units, then parameter gradients), so that the
// ranks can agree on the earliest one.
struct NonFiniteSite {
  long key = -1;     // -1: none found
  std::string what;  // "the output of layer 3 (unit 4), in forward"
};

// The batches a rewind skipped: from step `from` on, every step reads `count` batches further
// along the stream than before (a rewind to the checkpoint of step c after a spike at step s
// adds {c, s - c + 1}: the batches of steps c..s are never read again).
struct BatchSkip {
  long from = 0, count = 0;
};

class Numerics {
 public:
  void configure(const RunConfig& rc);
  // Subscribes to the model's hooks and wraps its loss function, once per model (03 calls
  // init_or_resume once per unit).
  void attach(Model& m);

  // ----- the training loop (train_loop) -------------------------------------------------------
  void begin_step(long step);
  // The step's numbers for its JSON record (per-unit grad norms and activation RMS on the
  // --numerics-every steps; collective then), and the spike verdict: a line and a JSON event for
  // each spike, a config_error on every rank under --on-spike stop. Returns the JSON to merge.
  Json end_step(long step, double loss, double grad_norm, RunLog& log, std::string& note);
  // The step had a non-finite loss or gradient norm (every rank sees the same: both come out of
  // all-reduces). Reruns it with every unit's output and input gradient checked (`rerun`: the
  // technique's step; the update is refused again), agrees on the earliest site across the ranks
  // and ends the run on every rank with a message naming step, unit, tensor and direction.
  [[noreturn]] void locate_nonfinite(long step, double loss, double grad_norm, const std::function<void()>& rerun,
                                     RunLog& log);

  // ----- the batch order and --on-spike rewind (train.cu) --------------------------------------
  long batch_of(long step) const;  // the batch a training step reads: step plus the skips before it
  // The step spiked under --on-spike rewind: train_loop reloads the last checkpoint.
  bool rewind_due() const { return rewind_due_; }
  void add_skip(long from, long through) { skips_.push_back({from, through - from + 1}); }
  const std::vector<BatchSkip>& skips() const { return skips_; }
  Json skips_json() const;               // [[from, count], ...] for trainer.json
  void load_skips(const Json& trainer);  // a resumed run keeps skipping what the saved one skipped

  // ----- the shared optimizer calls (optimizer.cu) ---------------------------------------------
  bool unit_stats_due() const { return active_ && stats_due_; }
  void note_grad_norm(double norm) { norm_ = norm; }
  void note_unit_grad_squares(const std::vector<double>& sq) { unit_grad_sq_ = sq; }
  // Collective on the first call of a step (every rank's optimizer calls it in the same order):
  // false when the update must not be applied, because the gradient norm is not finite or, under
  // --on-spike skip, the step spiked. `g` covers [begin, end) of the model's flat buffers: when
  // the norm is not finite its parameter gradients are scanned for the report.
  bool allow_update(const Model& m, const Tensor& g, int64_t begin, int64_t end);

 private:
  friend struct NumericsLoss;
  void on_output(int u, const Tensor& x);
  void on_input_grad(int u, const Tensor& dx);
  void on_loss(const Tensor& losses, const Tensor& dlogits, float grad_scale);
  void found(long key, const std::string& what);
  SpikeVerdict judge(double loss, double norm);
  bool skip_spike();
  Json unit_stats();
  void report_spike(long step, const SpikeVerdict& v, RunLog& log, std::string& note);

  NumericsConfig cfg_;
  int layers_ = 0;
  std::vector<const Model*> attached_;
  SpikeWindow loss_window_, norm_window_;
  bool active_ = false, stats_due_ = false, probing_ = false, decided_ = false, allow_ = true;
  long step_ = -1;
  double norm_ = 0;
  SpikeVerdict skipped_;            // the spike the gate skipped this step (--on-spike skip)
  LossTally tally_;                 // --on-spike skip: the step's token losses before the update
  double tally_tokens_ = 0;
  std::vector<double> act_sq_, act_n_, unit_grad_sq_;
  NonFiniteSite first_;
  bool rewind_due_ = false;
  std::vector<BatchSkip> skips_;
};

// The process's numerics (one model trains per process).
Numerics& numerics();

}  // namespace ts
