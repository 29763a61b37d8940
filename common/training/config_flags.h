// config_flags.h — how the shared flags become a RunConfig (config.h): the parse, the presets,
// the batch split over dp, a model from a string of flags, and the check a resume makes of the
// learning-rate schedule. Program (train.cu) runs them; a chapter sees only their result.
#pragma once
#include <string>

#include "formats/json.h"
#include "training/config.h"
#include "training/flags.h"

namespace ts {

// Reads the flags shared by every technique (not finish(): the technique adds its own first).
// --resume DIR resolves to the checkpoint it names (see resolve_checkpoint), whose recorded
// learning-rate schedule must give every remaining step the same rate as this run's
// (check_resume_schedule).
RunConfig parse_run_config(Args& a);
// The global batch split: dp ranks × micro-batches × --micro-batch sequences. Defaults the
// micro-batch to the whole local batch and validates the split (config_error on every rank).
void resolve_batch(RunConfig& rc, int dp);
// The model a string of model flags gives ("--dim 256 --experts 8 …", a calibration's "model"):
// the flags applied as a run applies them, on --preset's shape (tiny unless named).
ModelConfig model_of_flags(const std::string& flags);
// Whether two models cost the same per token: the shapes and the routing, not the optimizer or
// numerics settings.
bool same_cost_shape(const ModelConfig& a, const ModelConfig& b);
// Named shapes: tiny (the test fixture's), small (the benchmark's), 124m, 1b, 3b (Llama-3.2-3B),
// 8b (Llama-3-8B), 70b (Llama-3-70B).
bool apply_preset(const std::string& name, ModelConfig& m);
// Resuming at `step` under a schedule other than the checkpoint's (trainer.json: lr_schedule,
// steps, lr, warmup_steps, min_lr) would bend the learning-rate curve: a config_error naming the
// recorded and requested values, unless --reschedule, which says what changes and goes on.
void check_resume_schedule(const RunConfig& rc, const Json& trainer, long step);

}  // namespace ts
