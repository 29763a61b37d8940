// train.h — the start and the loop every technique shares: the Program (MPI, flags, mesh, data),
// init or resume, the held-out loss, the step timing and train_loop. It includes the rest of the
// shared training substrate, one header per concern: flags.h, config.h (the run configuration
// and the lr schedule), optimizer.h (AdamW, clipping, loss and norm across the mesh),
// memory_model.h (the playbook's memory formulas) and report.h (the step log and the summary).
#pragma once
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
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
#include "training/numerics.h"
#include "training/optimizer.h"
#include "training/report.h"

namespace ts {

// ----- data on the device ----------------------------------------------------------------------
struct MicroBatch {
  Tensor inputs, targets;  // int32 [nseq * seq]
};
// Global sequences [seq0, seq0 + nseq) of step `step` (the data order of notes/00), on `dev`.
MicroBatch make_microbatch(const TokenData& d, long step, int B, int T, int seq0, int nseq, Device dev);

// ----- the start every technique's main() shares ------------------------------------------------
// In order: MPI, the shared flags, the technique's own flags and checks (`own`, which sets the
// mesh degrees), the unknown-flag check, the batch split over the dp ranks, the watchdog timeout
// and the log. Then either dry_run() (predictions only) or open() (device, mesh, data).
class Program {
 public:
  Program(int argc, char** argv, const char* doc, const std::function<void(Args&, RunConfig&, MeshConfig&)>& own);
  ~Program();  // releases the mesh's communicators, then finalises MPI
  RunConfig rc;
  MeshConfig mc;
  Device dev = Device::CPU;
  Mesh mesh;
  TokenData data;
  TokenData held_out;  // with --eval-every: the evaluation windows' tokens (see split_held_out)
  RunLog& log() { return *log_; }
  // --dry-run: calls print (the technique's predictions) and returns true: main returns 0.
  bool dry_run(const std::function<void()>& print);
  // The device, the mesh (validated against the world before any collective), the data and,
  // with --eval-every, the held-out data.
  void open();

 private:
  std::unique_ptr<RunLog> log_;
};
// The model's shape, Ψ and FLOPs per token (the first lines of every run).
void print_model(RunLog& log, const ModelConfig& m);

// ----- the loop every technique shares ------------------------------------------------------------
// The training data (every rank loads the same tokens and reads its own windows), after choosing
// the threads per rank (collective) and the BLAS check on the CPU; prints the threads, the
// device, the source and its loss floor.
TokenData open_data(const RunConfig& rc, Device dev, RunLog& log);

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

// With --experts: sums the step's routing statistics over token_groups (the groups whose ranks
// routed different tokens; none in 01) into r's log fields and note, then resets them. With
// --router sigmoid it first moves the routing bias by those summed loads (call it after the
// optimizer step; master: the optimizer's fp32 master copy, undefined when it has none).
void moe_step_report(Model& m, StepResult& r, const std::vector<MPI_Comm>& token_groups,
                     const Tensor& master = Tensor());

// The measured step times of a run, for the predicted-step-time line: the first step this process
// runs is warm-up (allocations, the optimizer states' first touch, caches), so "measured" is the
// median of the others (the first alone when it is the only one).
struct StepTimes {
  long first_step = 0;     // the warm-up step's number
  double warmup_s = 0;     // its seconds
  double median_s = 0;     // the median of the steps after it
  size_t measured = 0;     // how many steps that median is over (0: only the warm-up step ran)
};
StepTimes step_times(long first_step, const std::vector<double>& seconds);

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
