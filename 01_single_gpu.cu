// 01_single_gpu.cu — the baseline: one device trains the whole model.
//
// The playbook's first chapter, runnable: the anatomy of a training step (forward, backward,
// optimizer), where the memory goes (parameters, gradients, optimizer states, activations),
// activation recomputation, gradient accumulation and mixed precision. Every other technique is
// proven against the losses and weights this file produces.
//
//   ./build/01_single_gpu --preset tiny --steps 200
//   ./build/01_single_gpu --dry-run --preset 8b --micro-batch 1 --dtype bf16 --recompute full
#include <algorithm>
#include <chrono>
#include <cmath>

#include "checkpoint.h"
#include "comm.h"
#include "data.h"
#include "model.h"
#include "train.h"

using namespace ts;

static const char* kDoc =
    "01_single_gpu: train the Llama-style model on one device (the baseline of every technique).\n"
    "usage: 01_single_gpu [flags]";

// ----- predict: the playbook's memory formulas for this model, before anything is allocated ----

static MemoryPrediction predict(const RunConfig& rc) {
  const int64_t psi = param_count(rc.model);
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

static void print_prediction(RunLog& log, const RunConfig& rc) {
  const ModelConfig& m = rc.model;
  const MemoryPrediction p = predict(rc);
  log.line("model: dim %d, layers %d, heads %d (kv %d), ffn %d, vocab %d, seq %d", m.dim, m.layers, m.heads,
           m.kv_heads, m.ffn, m.vocab, m.seq);
  log.line("parameters: %.3fM (%.3fM without the embedding); %.3f GFLOP per token (6N + 12·L·h·s)",
           param_count(m) / 1e6, param_count(m, false) / 1e6, flops_per_token(m) / 1e9);
  log.line("predicted memory (%s, micro-batch %d, recompute %s):", dtype_name(rc.dtype), rc.micro_batch,
           recompute_name(rc.recompute));
  log.line("  params      %12s", human_bytes(p.params).c_str());
  log.line("  grads       %12s", human_bytes(p.grads).c_str());
  log.line("  optimizer   %12s", human_bytes(p.optimizer).c_str());
  log.line("  activations %12s", human_bytes(p.activations).c_str());
  log.line("  total       %12s", human_bytes(p.params + p.grads + p.optimizer + p.activations).c_str());
}

// ----- weights: counter-based init, or a checkpoint -----------------------------------------------

// Fills the model's weights (and the optimizer's master copy) and returns the first step to run.
static long init_or_resume(Model& model, AdamW& opt, const RunConfig& rc) {
  Tensor w32 = Tensor::empty({model.table.total}, DType::F32, model.dev, Tag::Workspace);
  long step = 0;
  if (rc.resume_dir.empty()) {
    Model::init_range(model.table, rc.seed, 0, model.table.total, w32);
  } else {
    opt.ensure_state();
    step = load_checkpoint(rc.resume_dir, rc.model, model.table, 0, model.table.total, w32, &opt).step;
  }
  convert(model.params, w32);  // a copy in fp32, a rounding to bf16 otherwise
  opt.load_master(model, w32);
  return step;
}

static Tensor master_weights_f32(const Model& model, const AdamW& opt) {
  if (opt.master.defined()) return opt.master;
  Tensor w = Tensor::empty({model.table.total}, DType::F32, model.dev, Tag::Workspace);
  convert(w, model.params);
  return w;
}

static void save(const Model& model, const AdamW& opt, const RunConfig& rc, long step) {
  Json mesh = Json::object();
  mesh["world"] = 1;
  save_checkpoint(rc.save_dir, rc, model.table, {0, model.table.total, master_weights_f32(model, opt), &opt}, step,
                  mesh);
}

// ----- the first-step anomaly: memory after forward, backward and the optimizer -------------------

static void print_memory(RunLog& log, Device dev, long step, const char* when) {
  const MemStats& s = mem_stats(dev);
  log.line("  step %ld %-15s params %10s  grads %10s  optimizer %10s  activations %10s", step, when,
           human_bytes(double(s.current[int(Tag::Params)])).c_str(), human_bytes(double(s.current[int(Tag::Grads)])).c_str(),
           human_bytes(double(s.current[int(Tag::Optimizer)])).c_str(),
           human_bytes(double(s.current[int(Tag::Activations)])).c_str());
}

// ----- one optimizer step -----------------------------------------------------------------------

struct StepOut {
  double loss, grad_norm;
};

// Gradient accumulation: the global batch runs as batch/micro_batch forward-backward passes whose
// gradients add up in the fp32 gradient buffer; each token's loss is scaled by 1/(batch·seq) so
// the sum is the mean over every token of the global batch, whatever the micro-batch size.
static StepOut train_step(Model& model, AdamW& opt, const TokenData& data, const RunConfig& rc, long step,
                          RunLog& log) {
  const int T = rc.model.seq, mb = rc.micro_batch;
  const float scale = 1.f / (float(rc.batch) * T);
  zero(model.grads);
  double loss_sum = 0;
  const bool show = step < 2 && !rc.quiet;  // the first two steps print their memory
  model.after_forward = show ? std::function<void()>([&] { print_memory(log, model.dev, step, "after forward"); })
                             : std::function<void()>();
  for (int s0 = 0; s0 < rc.batch; s0 += mb) {
    MicroBatch b = make_microbatch(data, step, rc.batch, T, s0, mb, model.dev);
    loss_sum += model.forward_backward(b.inputs, b.targets, mb, scale);
  }
  if (show) print_memory(log, model.dev, step, "after backward");
  const double loss = loss_sum / (double(rc.batch) * T);
  if (!std::isfinite(loss)) fatal("loss is %f at step %ld: the run diverged (try a lower --lr)", loss, step);
  const double norm = std::sqrt(sum_squares(model.grads));
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  if (show) print_memory(log, model.dev, step, "after optimizer");
  return {loss, norm};
}

// ----- main -----------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  comm_init(&argc, &argv);
  Args args(argc, argv, kDoc);
  RunConfig rc = parse_run_config(args);
  args.finish();
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) config_error("01_single_gpu runs on one rank (got %d); see 02_data_parallel for more", world);
  if (rc.micro_batch == 0) rc.micro_batch = rc.batch;
  if (rc.batch % rc.micro_batch)
    config_error("--batch %d is not divisible by --micro-batch %d", rc.batch, rc.micro_batch);
  RunLog log(rc, Device::CPU);
  if (rc.dry_run) {
    print_prediction(log, rc);
    comm_finalize();
    return 0;
  }

  const Device dev = parse_device(rc.device);
  if (dev == Device::CPU) check_blas_setup();
  TokenData data = load_data(rc.data, rc.model.vocab, rc.seed, rc.model.seq + 2);
  log.line("device: %s | data: %s", device_description(dev).c_str(), data.description.c_str());
  if (std::isfinite(data.entropy_floor))
    log.line("loss floor (entropy rate of the source): %.4f nats/token; ln(vocab) = %.4f", data.entropy_floor,
             std::log(double(rc.model.vocab)));
  print_prediction(log, rc);

  Model model(rc.model, dev, rc.dtype, rc.recompute);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  const long first = init_or_resume(model, opt, rc);
  if (first > 0) log.line("resumed from %s at step %ld", rc.resume_dir.c_str(), first);

  const double peak = peak_tflops_for(dev, rc.dtype, rc.peak_tflops) * 1e12;
  const double tokens = double(rc.batch) * rc.model.seq;
  std::vector<double> tps;
  double last_loss = NAN;
  for (long step = first; step < rc.steps; step++) {
    set_current_step(step);
    auto t0 = std::chrono::steady_clock::now();
    StepOut r = train_step(model, opt, data, rc, step, log);
    device_sync(dev);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tps.push_back(tokens / secs);
    last_loss = r.loss;
    log.step({step, r.loss, lr_at(rc, step), r.grad_norm, tokens / secs,
              peak > 0 ? flops_per_token(rc.model) * tokens / secs / peak : 0.0, secs * 1e3,
              mem_stats(dev).total_peak});
    if (!rc.save_dir.empty() && rc.save_every > 0 && (step + 1) % rc.save_every == 0 && step + 1 < rc.steps)
      save(model, opt, rc, step + 1);
  }
  set_current_step(-1);
  if (!rc.save_dir.empty()) save(model, opt, rc, std::max(first, rc.steps));

  Json summary = Json::object();
  summary["memory"] = memory_report(log, dev, predict(rc));
  summary["comm"] = Json::object();
  summary["final_loss"] = last_loss;
  summary["loss_floor"] = data.entropy_floor;
  if (!tps.empty()) {
    std::sort(tps.begin(), tps.end());
    summary["tokens_per_s_median"] = tps[tps.size() / 2];
    log.line("median %.0f tokens/s over %zu steps; final loss %.4f", tps[tps.size() / 2], tps.size(), last_loss);
  }
  log.summary(summary);
  comm_finalize();
  return 0;
}
