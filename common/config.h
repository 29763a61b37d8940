// config.h — the run configuration (01's flags; the other techniques add their own), the
// presets, the batch split over dp and the learning-rate schedule.
#pragma once
#include <string>

#include "core.h"
#include "flags.h"
#include "json.h"
#include "model.h"

namespace ts {

struct RunConfig {
  ModelConfig model;
  std::string preset = "tiny";
  std::string device = "auto";
  DType dtype = DType::F32;
  bool master_weights = true;  // bf16 only: --no-master-weights updates bf16 weights directly
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
};
// Reads the flags shared by every technique (not finish(): the technique adds its own first).
// --resume DIR resolves to the checkpoint it names (see resolve_checkpoint), whose recorded
// learning-rate schedule must give every remaining step the same rate as this run's
// (check_resume_schedule).
RunConfig parse_run_config(Args& a);
// The global batch split: dp ranks × micro-batches × --micro-batch sequences. Defaults the
// micro-batch to the whole local batch and validates the split (config_error on every rank).
void resolve_batch(RunConfig& rc, int dp);
// Named shapes: tiny (the test fixture's), small (the benchmark's), 124m, 1b, 3b (Llama-3.2-3B),
// 8b (Llama-3-8B), 70b (Llama-3-70B).
bool apply_preset(const std::string& name, ModelConfig& m);
const char* recompute_name(Recompute r);

// ----- schedule, optimizer, clipping ---------------------------------------------------------
// Linear warm-up to lr, then constant or cosine decay to min_lr at the last step.
double lr_at(const RunConfig& rc, long step);
// Resuming at `step` under a schedule other than the checkpoint's (trainer.json: lr_schedule,
// steps, lr, warmup_steps, min_lr) would bend the learning-rate curve: a config_error naming the
// recorded and requested values, unless --reschedule, which says what changes and goes on.
void check_resume_schedule(const RunConfig& rc, const Json& trainer, long step);

}  // namespace ts
