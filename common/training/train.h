// train.h — what a chapter's train_step and main use from the loop every technique shares: its
// micro-batches, init or resume, the held-out loss, the Loop a chapter fills and train_loop. With
// it come the run's interfaces, one header per concern: flags.h, config.h (the run configuration
// and the lr schedule), optimizer.h (AdamW, clipping, loss and norm across the mesh) and
// memory_model.h (the playbook's memory formulas). The machinery behind them sits in headers of
// its own, off a chapter's reading path: program.h (MPI, flags, mesh, data: what start.h runs),
// report.h (the step log and the summary tables), numerics.h, step_time.h (the lab's step time).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "formats/data.h"
#include "formats/json.h"
#include "comm/mesh.h"
#include "model/model.h"
#include "training/config.h"
#include "training/flags.h"
#include "training/memory_model.h"
#include "training/optimizer.h"

namespace ts {

class RunLog;      // report.h: the step lines and the JSON log
struct StepTimes;  // step_time.h: the measured step times the step-time line compares

// ----- data on the device ----------------------------------------------------------------------
struct MicroBatch {
  Tensor inputs, targets;  // int32 [nseq * seq]
};
// Global sequences [seq0, seq0 + nseq) of step `step` (the data order of notes/00), on `dev`.
MicroBatch make_microbatch(const TokenData& d, long step, int B, int T, int seq0, int nseq, Device dev);

// ----- the loop every technique shares ------------------------------------------------------------
// Weights of the global range [b, e) from the counter-based init or --resume, into `weights`
// (the compute copy: fp32, or bf16 rounded from fp32) and the optimizer's master copy.
// Returns the first step to run. Also attaches the numerics (numerics.h) to the model: every
// technique calls this once its model is complete (its loss function installed).
long init_or_resume(Model& model, AdamW& opt, const RunConfig& rc, int64_t b, int64_t e, const Tensor& weights);
// fp32 values of a range of weights for checkpointing: the master copy when there is one, the
// weights themselves when they are fp32 (a save reads them before the next update).
Tensor weights_f32(const Tensor& weights, const AdamW& opt);
// Prints the current bytes per category (the first-step anomaly lines).
void print_memory(RunLog& log, Device dev, long step, const char* when);
// The first two steps (not under --quiet) print their memory after each forward (armed here on
// model.after_forward), after backward and after the optimizer: the optimizer states appear
// only at the first update. Returns whether `step` prints; the caller prints the last two lines.
bool show_step_memory(Model& model, RunLog& log, const RunConfig& rc, long step);

// The held-out loss: the mean token loss over rc.eval_batches batches of rc.batch windows of
// `held_out`, forward only (no gradient or optimizer state is touched). This rank evaluates
// sequences [seq0, seq0 + nseq) of each batch in micro-batches of rc.micro_batch, as it trains;
// the sums add up over `token_groups`, as global_mean_loss does for the training loss.
double held_out_loss(Model& model, const TokenData& held_out, const RunConfig& rc, int seq0, int nseq,
                     const std::vector<MPI_Comm>& token_groups);

struct StepResult {
  double loss, grad_norm;
  Json extra;        // more fields for the step's JSON record (MoE routing statistics), or null
  std::string note;  // appended to the step's line
};

struct Loop {
  std::function<StepResult(long step)> step;            // one optimizer step (the technique)
  std::function<void(long next_step)> save;             // write a checkpoint (collective)
  std::function<Json(long steps_run)> comm;             // the summary's "comm" object
  std::function<void(Json&)> extra;                     // anything else for the summary
  // The held-out loss of the current weights (collective; see held_out_loss). A technique that
  // sets none refuses --eval-every.
  std::function<double()> eval;
  // Prints the step time predicted for this run next to the measured one and returns the
  // summary's "step_time" object (02–08 set it; see common/training/step_time.h, predict_step_time).
  std::function<Json(const StepTimes&)> step_time;
  MemoryPrediction predicted;
};
// Runs steps [first, rc.steps): timing, the step log (loss, lr, grad norm, tokens/s, MFU, peak
// memory), NaN/inf detection and location, spike detection, --numerics-every statistics, the held-out loss every --eval-every steps and at the end, periodic
// and final checkpoints, then the summary with the memory table. Collective: every rank calls it.
void train_loop(const RunConfig& rc, Device dev, RunLog& log, const TokenData& data, long first, Loop& loop);

}  // namespace ts
