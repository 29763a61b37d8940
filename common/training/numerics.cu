// numerics.cu — per-unit statistics, the non-finite locator and spike detection (numerics.h).
#include "training/numerics.h"
#include "model/tp_ops.h"

#include "kernels/kernels.h"
#include "comm/comm.h"
#include "training/report.h"
#include "comm/watchdog.h"

#include <mpi.h>

#include <climits>
#include <cmath>

namespace ts {

Numerics& numerics() {
  static Numerics n;
  return n;
}

// ----- the rolling window --------------------------------------------------------------------------

double SpikeWindow::mean() const {
  double s = 0;
  for (double v : v_) s += v;
  return v_.empty() ? 0 : s / double(v_.size());
}

double SpikeWindow::stddev() const {
  const double m = mean();
  double s = 0;
  for (double v : v_) s += (v - m) * (v - m);
  return v_.empty() ? 0 : std::sqrt(s / double(v_.size()));
}

void SpikeWindow::push(double v) {
  if (size_ <= 0) return;
  if (int(v_.size()) == size_) v_.pop_front();
  v_.push_back(v);
}

// ----- what the model's hooks see --------------------------------------------------------------------

// The squares of a unit's output or gradient, summed in double: not finite exactly when one of its
// elements is not (a finite fp32 value squared cannot overflow a double). bf16 is widened first.
static double squares(const Tensor& t) {
  if (t.dtype == DType::F32) return sum_squares(t);
  Tensor w = Tensor::empty({t.numel()}, DType::F32, t.device(), Tag::Workspace);
  convert(w, t.reshape({t.numel()}));
  return sum_squares(w);
}

// Wraps the model's loss function (the technique's, 04's vocabulary-parallel one included): the
// token losses before the update for --on-spike skip, and the loss and the logits' gradient
// checked while a diverged step is being located.
struct NumericsLoss : LossFn {
  NumericsLoss(Numerics& n, std::unique_ptr<LossFn> inner) : n_(n), inner_(std::move(inner)) {}
  void forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                        int64_t vocab_start, float grad_scale) override {
    inner_->forward_backward(losses, dlogits, logits, targets, vocab_start, grad_scale);
    n_.on_loss(losses, dlogits, grad_scale);
  }
  Numerics& n_;
  std::unique_ptr<LossFn> inner_;
};

void Numerics::configure(const RunConfig& rc) {
  cfg_ = rc.numerics;
  layers_ = rc.model.layers;
  loss_window_ = SpikeWindow(cfg_.spike_window, cfg_.spike_sigma);
  norm_window_ = SpikeWindow(cfg_.spike_window, cfg_.spike_sigma);
  load_skips(Json());
}

void Numerics::attach(Model& m) {
  for (const Model* a : attached_)
    if (a == &m) return;
  attached_.push_back(&m);
  layers_ = m.cfg.layers;
  m.unit_output.add([this](int u, const Tensor& x) { on_output(u, x); });
  m.unit_input_grad.add([this](int u, const Tensor& dx) { on_input_grad(u, dx); });
  m.loss = std::make_unique<NumericsLoss>(*this, std::move(m.loss));
}

// The order keys of NonFiniteSite: forward units 0..L, the losses L+1, the logits' gradient
// L+2, backward units L..0 from L+3, parameter gradients of units L+1..0 after those.
void Numerics::on_output(int u, const Tensor& x) {
  if (!active_ || !(probing_ || stats_due_) || u < 0 || u > layers_) return;
  const double sq = squares(x);
  if (probing_ && !std::isfinite(sq)) {
    found(u, u == 0 ? "the output of the embedding (unit 0), in forward"
                    : "the output of layer " + std::to_string(u - 1) + " (unit " + std::to_string(u) + "), in forward");
  }
  if (!stats_due_) return;
  act_sq_.resize(size_t(layers_) + 1, 0.0);
  act_n_.resize(size_t(layers_) + 1, 0.0);
  act_sq_[size_t(u)] += sq;
  act_n_[size_t(u)] += double(x.numel());
}

void Numerics::on_input_grad(int u, const Tensor& dx) {
  if (active_ && step_ == cfg_.nan_step && u == cfg_.nan_layer + 1 && dx.numel() > 0) {  // --inject-nan
    const float nan = NAN;
    from_host_f32(dx.reshape({dx.numel()}).view(0, {1}), &nan);
  }
  if (!active_ || !probing_ || std::isfinite(squares(dx))) return;
  found(layers_ + 3 + (layers_ - u),
        u == 0 ? "the gradient w.r.t. the embedding's output (unit 0), in backward"
               : "the gradient w.r.t. the input of layer " + std::to_string(u - 1) + " (unit " + std::to_string(u) +
                     "), in backward");
}

// grad_scale 0 is the held-out loss: it is neither tallied nor checked.
void Numerics::on_loss(const Tensor& losses, const Tensor& dlogits, float grad_scale) {
  if (!active_ || grad_scale == 0) return;
  if (cfg_.poison_batch >= 0 && batch_of(step_) == cfg_.poison_batch && dlogits.defined())
    scale_inplace(dlogits, 1000.f);  // --poison-batch: a bad batch's gradient
  if (cfg_.on_spike == OnSpike::Skip) {
    tally_.add(losses);
    tally_tokens_ += double(losses.numel());
  }
  if (!probing_) return;
  if (!std::isfinite(squares(losses))) found(layers_ + 1, "the token losses (cross-entropy of the logits), in forward");
  if (dlogits.defined() && !std::isfinite(squares(dlogits)))
    found(layers_ + 2, "the gradient w.r.t. the logits, in backward");
}

// The first site in time on this rank wins: a later one is usually the first one spreading.
void Numerics::found(long key, const std::string& what) {
  if (first_.key >= 0) return;
  first_ = {key, what};
}

// ----- the step --------------------------------------------------------------------------------------

void Numerics::begin_step(long step) {
  active_ = true;
  step_ = step;
  stats_due_ = cfg_.every > 0 && step % cfg_.every == 0;
  decided_ = false;
  allow_ = true;
  rewind_due_ = false;
  skipped_ = SpikeVerdict();
  tally_.take();
  tally_tokens_ = 0;
  act_sq_.assign(size_t(layers_) + 1, 0.0);
  act_n_.assign(size_t(layers_) + 1, 0.0);
  unit_grad_sq_.clear();
}

// Tests both values against their windows; values that are not spikes join them (a spike does
// not: it would widen the window and hide the next one).
SpikeVerdict Numerics::judge(double loss, double norm) {
  SpikeVerdict v;
  v.loss_value = loss, v.loss_threshold = loss_window_.threshold(), v.loss = loss_window_.is_spike(loss);
  v.norm_value = norm, v.norm_threshold = norm_window_.threshold(), v.norm = norm_window_.is_spike(norm);
  if (!v.any()) loss_window_.push(loss), norm_window_.push(norm);
  return v;
}

// --on-spike skip, before the update: the step's mean token loss from every rank's tally (tp
// ranks count their replicated tokens on both sides of the ratio, pipeline stages without the
// head add 0 / 0), then the verdict, agreed with one more all-reduce so that every rank skips or
// none does.
bool Numerics::skip_spike() {
  double mine[2] = {tally_.take(), tally_tokens_}, all[2] = {0, 0};
  watched_allreduce(mine, all, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, "all_reduce (the spike test's loss)");
  const SpikeVerdict v = judge(all[1] > 0 ? all[0] / all[1] : 0.0, norm_);
  int spiked = v.any(), agreed = 0;
  watched_allreduce(&spiked, &agreed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, "all_reduce (the spike verdict)");
  if (agreed) skipped_ = v;
  return agreed != 0;
}

bool Numerics::allow_update(const Model& m, const Tensor& g, int64_t begin, int64_t end) {
  if (!active_) return true;  // an optimizer outside train_loop (tests)
  if (!decided_) {
    decided_ = true;
    // The norm comes out of the all-reduces over every group that holds different gradients
    // (or is computed from all-reduced gradients): every rank sees the same non-finite value.
    if (!std::isfinite(norm_)) allow_ = false;
    else allow_ = !(cfg_.on_spike == OnSpike::Skip && cfg_.spike_window > 0 && skip_spike());
  }
  if (!std::isfinite(norm_) && probing_) {
    // Which parameter gradients are not finite: the highest unit first, as backward makes them.
    m.table.for_each_overlap(begin, end, [&](const ParamEntry& p, int64_t lo, int64_t hi) {
      if (std::isfinite(squares(g.view(lo - begin, {hi - lo})))) return;
      const long key = 2L * layers_ + 4 + (layers_ + 1 - p.unit);
      if (first_.key < 0 || key < first_.key)
        first_ = {key, "the gradient of " + p.name + " (unit " + std::to_string(p.unit) + "), in backward"};
    });
  }
  return allow_;
}

// ----- what the loop reports ------------------------------------------------------------------------

static Json array_of(const std::vector<double>& v) {
  Json a = Json::array();
  for (double x : v) a.push_back(x);
  return a;
}

// Collective: the activation RMS of each unit's output over every token of the step. Sums of
// squares and element counts add up over all ranks: tokens held by different dp/cp ranks add,
// tp copies of the same tokens add to both sums alike, stages without the unit add 0 / 0.
Json Numerics::unit_stats() {
  const size_t n = act_sq_.size();
  std::vector<double> mine(act_sq_), all(2 * n);
  mine.insert(mine.end(), act_n_.begin(), act_n_.end());
  watched_allreduce(mine.data(), all.data(), int(2 * n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD,
                    "all_reduce (activation RMS per unit)");
  std::vector<double> rms(n), norms;
  for (size_t u = 0; u < n; u++) rms[u] = all[n + u] > 0 ? std::sqrt(all[u] / all[n + u]) : 0.0;
  for (double sq : unit_grad_sq_) norms.push_back(std::sqrt(sq));
  Json j = Json::object();
  j["grad_norm"] = array_of(norms);  // units 0..L+1: embedding, layers, head
  j["act_rms"] = array_of(rms);      // units 0..L: the embedding's and each layer's output
  return j;
}

void Numerics::report_spike(long step, const SpikeVerdict& v, RunLog& log, std::string& note) {
  const char* action = cfg_.on_spike == OnSpike::Skip     ? "update skipped"
                       : cfg_.on_spike == OnSpike::Stop   ? "stopping"
                       : cfg_.on_spike == OnSpike::Rewind ? "rewinding to the last checkpoint"
                                                          : "reported";
  std::string what;
  char buf[160];
  if (v.loss) snprintf(buf, sizeof buf, "loss %.6g > %.6g", v.loss_value, v.loss_threshold), what += buf;
  if (v.norm) {
    snprintf(buf, sizeof buf, "%sgrad norm %.6g > %.6g", what.empty() ? "" : ", ", v.norm_value, v.norm_threshold);
    what += buf;
  }
  log.line("spike at step %ld: %s (mean + %g std of the last %d steps); %s", step, what.c_str(), cfg_.spike_sigma,
           cfg_.spike_window, action);
  Json e = Json::object();
  e["event"] = "spike";
  e["step"] = step;
  e["loss_spike"] = v.loss, e["loss"] = v.loss_value, e["loss_threshold"] = v.loss_threshold;
  e["grad_norm_spike"] = v.norm, e["grad_norm"] = v.norm_value, e["grad_norm_threshold"] = v.norm_threshold;
  e["action"] = on_spike_name(cfg_.on_spike);
  log.event(e);
  note += std::string(" | spike: ") + action;
  if (cfg_.on_spike == OnSpike::Stop)
    config_error("spike at step %ld: %s; --on-spike stop ended the run (the update of step %ld was applied)", step,
                 what.c_str(), step);
}

// Under --on-spike skip the gate has judged the step already (before the update); otherwise it
// is judged here, after it, on the loss and norm every rank holds alike (both come out of
// all-reduces), so every rank reaches the same verdict without another collective.
Json Numerics::end_step(long step, double loss, double grad_norm, RunLog& log, std::string& note) {
  Json j = Json::object();
  if (stats_due_) j["numerics"] = unit_stats();
  SpikeVerdict v = skipped_;
  if (cfg_.spike_window > 0 && cfg_.on_spike != OnSpike::Skip) v = judge(loss, grad_norm);
  if (v.any()) {
    report_spike(step, v, log, note);
    j["spike"] = on_spike_name(cfg_.on_spike);
    rewind_due_ = cfg_.on_spike == OnSpike::Rewind;
  }
  active_ = false;
  return j;
}

// ----- the batch order ----------------------------------------------------------------------------

long Numerics::batch_of(long step) const {
  long b = step;
  for (const BatchSkip& s : skips_)
    if (step >= s.from) b += s.count;
  return b;
}

Json Numerics::skips_json() const {
  Json a = Json::array();
  for (const BatchSkip& s : skips_) a.push_back(Json::array({Json(int64_t(s.from)), Json(int64_t(s.count))}));
  return a;
}

// The checkpoint's skips, then those of the command line (--skip-batches) it does not hold yet (a
// checkpoint records both, and --config trainer.json repeats the flag).
void Numerics::load_skips(const Json& trainer) {
  skips_.clear();
  if (trainer.is_object() && trainer.contains("skipped_batches")) {
    const Json& a = trainer.at("skipped_batches");
    for (size_t i = 0; i < a.size(); i++) skips_.push_back({long(a[i][0].as_int()), long(a[i][1].as_int())});
  }
  const size_t saved = skips_.size();
  for (const auto& [from, count] : cfg_.skip_batches) {
    bool held = false;
    for (size_t i = 0; i < saved; i++) held = held || (skips_[i].from == from && skips_[i].count == count);
    if (!held) skips_.push_back({from, count});
  }
}

[[noreturn]] void Numerics::locate_nonfinite(long step, double loss, double grad_norm, const std::function<void()>& rerun,
                                             RunLog& log) {
  begin_step(step);
  probing_ = true;
  first_ = NonFiniteSite();
  rerun();  // the same weights and batch: the kernels are deterministic, so the values recur
  probing_ = false;
  // The earliest site over the ranks (the lowest key; the lowest rank among equals).
  long mine = first_.key < 0 ? LONG_MAX : first_.key, lowest = 0;
  watched_allreduce(&mine, &lowest, 1, MPI_LONG, MPI_MIN, MPI_COMM_WORLD, "all_reduce (the first non-finite site)");
  std::string where = first_error(mine == lowest && first_.key >= 0 ? first_.what : "", MPI_COMM_WORLD,
                                  "the first non-finite site");
  if (where.empty()) where = "not found: rerun with the checks on, the step's values were finite (not reproducible)";
  Json e = Json::object();
  e["event"] = "non_finite";
  e["step"] = step;
  e["loss"] = loss;
  e["grad_norm"] = grad_norm;
  e["first"] = where;
  log.event(e);
  config_error("step %ld diverged (loss %g, grad norm %g; the update was not applied): the first non-finite value is "
               "%s; try a lower --lr", step, loss, grad_norm, where.c_str());
}

}  // namespace ts
