// config.h — the run configuration (01's flags; the other techniques add their own), the
// presets, the batch split over dp and the learning-rate schedule.
#pragma once
#include <string>

#include "tensor/core.h"
#include "formats/json.h"
#include "model/model.h"
#include "training/flags.h"

namespace ts {

// --dtype fp8: the dense linears' three GEMMs take FP8 operands (fp8_linear.h); the rest of the
// model computes in bf16, with fp32 master weights, gradients and AdamW.
enum class Fp8Recipe : uint8_t { Off, Tensorwise, Delayed, Blockwise };
const char* fp8_recipe_name(Fp8Recipe r);  // "off", "tensorwise", "delayed", "blockwise"
struct Fp8Config {
  Fp8Recipe recipe = Fp8Recipe::Off;
  int history = 16;        // delayed: steps of amax history; the scale uses their maximum
  int margin = 0;          // scale = max_fp8 / amax / 2^margin (Transformer Engine's margin)
  int tile = 128;          // blockwise: 1 x tile activation/gradient tiles, tile x tile weight blocks
  int accum_bits = 23;     // the accumulator's mantissa bits (23: fp32; Hopper's FP8 MMA keeps ~14)
  int promote_every = 0;   // N_C: partial sums promoted to fp32 every N_C products (0: never)
};

// ----- numerics (numerics.h): per-layer statistics, non-finite location, spike detection ---------
// What a spike does (NumericsConfig::on_spike): report it and go on; stop the run; skip the
// step's update (weights and optimizer state untouched); rewind to the last checkpoint and skip
// the batches read since (PaLM's remedy).
enum class OnSpike : uint8_t { Report, Stop, Skip, Rewind };
const char* on_spike_name(OnSpike s);  // "report", "stop", "skip", "rewind"
struct NumericsConfig {
  long every = 0;            // --numerics-every: per-unit grad norms and activation RMS every N steps (0: off)
  int spike_window = 128;    // --spike-window: steps in the rolling window (0: off); OLMo-core's 128
  double spike_sigma = 6;    // --spike-sigma: a value above mean + sigma·std of the window is a spike
  OnSpike on_spike = OnSpike::Report;
  // The lab's provocations (notes/fp8.md): batch `poison_batch` has its loss gradient multiplied
  // by 1000 (a bad batch: a gradient-norm spike); a NaN is written into the gradient w.r.t. the
  // input of layer `nan_layer` in the backward of step `nan_step`. -1: off.
  // --skip-batches FROM:COUNT,...: from step FROM on, read COUNT batches further along the data
  // (an operator's rewind by hand: resume a checkpoint and skip the batches of a spike).
  std::vector<std::pair<long, long>> skip_batches;
  long poison_batch = -1;
  long nan_step = -1;
  int nan_layer = -1;
};

struct RunConfig {
  ModelConfig model;
  std::string preset = "tiny";
  std::string device = "auto";
  DType dtype = DType::F32;
  bool master_weights = true;  // bf16 only: --no-master-weights updates bf16 weights directly
  Fp8Config fp8;               // --dtype fp8 (dtype is then bf16, the compute dtype around the FP8 GEMMs)
  int batch = 8, micro_batch = 0;  // global sequences per step; sequences per forward (0 = batch)
  long steps = 50;
  double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, clip = 1.0;
  std::string lr_schedule = "cosine";
  long warmup_steps = 0;
  double min_lr = 0;
  uint64_t seed = 1337;
  std::string data;  // "" = embedded synthetic source
  // The held-out loss every eval_every steps and at the end (0: none, and no data held out), over
  // eval_batches batches of `batch` windows of eval_data, or of the data's tail when "".
  long eval_every = 0;
  int eval_batches = 4;
  std::string eval_data;
  std::string program;  // the binary's name, for messages
  bool without_steps = false;  // evaluating or sampling: --resume may run no step (--steps = its step)
  Recompute recompute = Recompute::None;
  std::string log_json, trace, save_dir, resume_dir;
  long save_every = 0;
  int keep_last = 0;         // > 0: keep the last N checkpoints as save_dir/step_NNNNNN
  bool reschedule = false;   // resume even when the learning-rate curve would change
  bool overwrite = false;    // --save may replace a checkpoint this run did not resume from
  bool dry_run = false;
  double timeout = 300, peak_tflops = 0;
  bool quiet = false;  // no per-step lines, only a progress line every progress_seconds
  long log_every = 0;  // step lines every N steps (0: about 50 per run), always the first and last
  double progress_seconds = 10;
  int threads = 0;     // CPU threads per rank (0: chosen from the cores, see threads.h)
  bool async_save = false;  // checkpoints staged in memory and written by a background thread
  int flight_entries = 2000;  // the flight recorder's ring per rank (0: off; flight_recorder.h)
  std::string flight_dir;     // where its dumps go: DIR.flight beside --save DIR, else ./tinyscale-flight
  Json flags;          // every flag of this run and its value (Args::effective), kept in trainer.json
  NumericsConfig numerics;  // --numerics-every, --spike-window, --spike-sigma, --on-spike
};
const char* recompute_name(Recompute r);

// ----- schedule, optimizer, clipping ---------------------------------------------------------
// Linear warm-up to lr, then constant or cosine decay to min_lr at the last step.
double lr_at(const RunConfig& rc, long step);
}  // namespace ts
