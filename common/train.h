// train.h — the training utilities every technique shares: flags, the run configuration, the
// learning-rate schedule, AdamW over ranges of the flat buffers, gradient clipping, memory
// predictions (the playbook's formulas for this model), the step log and the run summary.
#pragma once
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core.h"
#include "data.h"
#include "json.h"
#include "mesh.h"
#include "model.h"

namespace ts {

// ----- flags -------------------------------------------------------------------------------------
// Flags are declared where they are read (get_*), so --help lists exactly what a binary accepts;
// finish() rejects anything left over — an unknown flag is an error on every rank, never ignored,
// and names the declared flag nearest to it.

// The values a numeric flag accepts: [lo, hi], an end excluded when it is open. Every number must
// also be finite, and an integer flag's value a whole number its type holds (no wrap-around).
struct Range {
  double lo = -HUGE_VAL, hi = HUGE_VAL;
  bool lo_open = false, hi_open = false;
};
// The common ones, named for what they mean.
inline Range at_least(double lo) { return {lo, HUGE_VAL}; }
inline Range positive(double hi = HUGE_VAL) { return {0, hi, true, false}; }
inline Range between(double lo, double hi) { return {lo, hi}; }
// A mesh degree (--dp, --tp, --pp, --cp, --ep): ranks in one group.
inline Range degree_range() { return between(1, 1 << 16); }

class Args {
 public:
  Args(int argc, char** argv, std::string program_doc);
  // A value outside `r` (or not a number, or not finite) is a config_error naming the flag, the
  // range and the value, whether it came from the command line or from --config.
  int get_int(const std::string& flag, int def, const std::string& help, Range r = {});
  long get_long(const std::string& flag, long def, const std::string& help, Range r = {});
  double get_double(const std::string& flag, double def, const std::string& help, Range r = {});
  std::string get_str(const std::string& flag, const std::string& def, const std::string& help);
  bool get_bool(const std::string& flag, const std::string& help);  // a switch: present = true
  bool has(const std::string& flag) const;
  bool declares(const std::string& flag) const;  // whether this binary reads the flag (so far)
  // Every flag read so far with the value this run uses (given or default; switches true/false),
  // as a --config file takes them: {"preset": "tiny", "lr-schedule": "cosine", "quiet": false, ...}.
  Json effective() const;
  void finish();  // --help prints and exits 0; unknown flags are a config_error
  // The --help heading of the flags declared from now on ("": the program's own, listed first);
  // returns the previous one. The shared flags are grouped: model, optimizer, data, run and
  // checkpoint, operations.
  std::string group(const std::string& heading);
 private:
  const char* take(const std::string& flag, const std::string& def, const std::string& help, bool is_switch);
  void load_config();
  std::string doc_;
  std::vector<std::pair<std::string, std::string>> args_;  // flag -> value, in order
  std::vector<bool> used_;
  std::vector<std::pair<std::string, std::string>> help_;  // heading, text
  std::string group_;
  std::vector<std::string> declared_;
  std::vector<std::pair<std::string, Json>> effective_;
  std::string config_;   // the --config file, "" without one
  size_t from_config_ = 0;  // args_[0, from_config_) came from it
  bool want_help_ = false;
};

// ----- the run configuration (01's flags; the other techniques add their own) -------------------
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

// AdamW over the parameter range [begin, end) of the flat buffers: all of it in 01/02, this
// rank's shard under ZeRO. With bf16 weights it keeps the fp32 master copy of its range
// (Tag::Optimizer, the playbook counts it with the optimizer states).
class AdamW {
 public:
  // The moments are allocated at the first step (or a resume), not here: the playbook's
  // first-step anomaly — optimizer memory appears only once the optimizer first runs.
  AdamW(const Model& m, int64_t begin, int64_t end, bool master_weights);
  void ensure_state();
  // Copies the current weights of [begin, end) into the master copy (after init or a load).
  void load_master(const Model& m, const Tensor& weights_range);
  // One update: grads_range and weights_range cover exactly [begin, end) of the flat buffers.
  void step(const Model& m, const Tensor& weights_range, const Tensor& grads_range, double lr, long t,
            float clip_coef, const RunConfig& rc);
  int64_t begin, end;
  Device dev;
  Tensor master, m1, m2;  // master is undefined for fp32 weights (the weights are the master)
};

// min(1, clip / (norm + 1e-6)); 1 when clipping is off.
float clip_coefficient(double grad_norm, double clip);

// ----- loss and gradient norm across the mesh ------------------------------------------------
// The step's mean token loss: each rank's summed token losses, summed over `token_groups` (the
// ranks that hold different tokens: dp × cp; tp ranks hold the same value and are not summed),
// divided by the global token count. A metric: its 8 bytes are not counted with the collectives.
double global_mean_loss(double local_sum, double global_tokens, const std::vector<MPI_Comm>& token_groups);
// The global L2 norm of the gradients: squares of this rank's gradient ranges (each a local flat
// range [begin, begin + numel) of `t`, in order) summed in double, skipping the copies of
// replicated tensors that do not count (so a tp-replicated norm weight counts once), then summed
// over `shard_groups` (every group whose ranks hold different parameters or gradient shards:
// tp, pp, and dp under ZeRO).
struct GradRange {
  int64_t begin;
  Tensor grads;
};
double global_grad_norm(const ParamTable& t, const std::vector<GradRange>& ranges,
                        const std::vector<MPI_Comm>& shard_groups);

// ----- data on the device ----------------------------------------------------------------------
struct MicroBatch {
  Tensor inputs, targets;  // int32 [nseq * seq]
};
// Global sequences [seq0, seq0 + nseq) of step `step` (the data order of notes/00), on `dev`.
MicroBatch make_microbatch(const TokenData& d, long step, int B, int T, int seq0, int nseq, Device dev);

// ----- memory: the playbook's formulas, derived for this model --------------------------------
struct MemoryPrediction {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  // What the unpredicted `comm` row holds in this technique, for the memory table's footnote
  // (every technique adds the host staging of CUDA tensors that ranks sharing a GPU send by MPI).
  std::string comm_holds;
  void comm_also_holds(const std::string& what) {
    if (!what.empty()) comm_holds += (comm_holds.empty() ? "" : ", ") + what;
  }
};
// Per-rank bytes of parameters (Ψ local), gradients and optimizer states, fp32 or bf16 mixed
// precision (bf16 weights + fp32 gradients + fp32 master/m/v = 2Ψ + 4Ψ + 12Ψ).
MemoryPrediction predict_states(int64_t psi_local, int64_t psi_optimizer, DType dt, bool master_weights);
// A rank holding Ψ_local parameters whole (no optimizer sharding) with activations of one
// micro-batch of the whole model: 01 and 02 exactly.
MemoryPrediction predict_replica(const RunConfig& rc, int64_t psi_local);
// Peak bytes of saved activations for one micro-batch of b sequences (see notes/01), at tensor
// parallelism tp with or without sequence parallelism (notes/04).
double predict_activations(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp = 1, bool sp = false);
// Its terms, per token of the micro-batch: what one decoder layer saves for backward under `rc`
// (Recompute::None: the layer's complete set), and what the head holds at its peak. Pipeline
// stages build their own peaks from them (micro-batches in flight × layers held).
double layer_activation_bytes(const ModelConfig& c, DType dt, Recompute rc, int tp = 1, bool sp = false);
double head_activation_bytes(const ModelConfig& c, DType dt, int tp = 1, bool sp = false);

// ----- reporting ----------------------------------------------------------------------------------
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

class RunLog {
 public:
  RunLog(const RunConfig& rc, Device dev);  // rank 0 opens --log-json
  // Every step goes to the JSON log; a line "step 120/4000 | … | ETA 1m05s" is printed on the
  // --log-every cadence, or under --quiet once every --progress-seconds.
  void step(const StepRecord& r);
  // memory: category -> {measured, predicted}; comm: group -> op -> {calls, bytes, predicted}.
  void summary(Json s);
  void line(const char* fmt, ...) __attribute__((format(printf, 2, 3)));  // rank 0 only
  ~RunLog();
 private:
  bool line_due(long step, std::chrono::steady_clock::time_point now) const;
  const RunConfig& rc_;
  FILE* json_ = nullptr;
  bool rank0_;
  long every_ = 1, first_ = -1;  // first_: the first step this run logged
  std::chrono::steady_clock::time_point start_, last_line_;
};

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
// ----- the loop every technique shares ------------------------------------------------------------
// The training data (every rank loads the same tokens and reads its own windows), after choosing
// the threads per rank (collective) and the BLAS check on the CPU; prints the threads, the
// device, the source and its loss floor.
TokenData open_data(const RunConfig& rc, Device dev, RunLog& log);

// Weights of the global range [b, e) from the counter-based init or --resume, into `weights`
// (the compute copy: fp32, or bf16 rounded from fp32) and the optimizer's master copy.
// Returns the first step to run.
long init_or_resume(const Model& model, AdamW& opt, const RunConfig& rc, int64_t b, int64_t e, const Tensor& weights);
// fp32 values of a range of weights for checkpointing: the master copy when there is one.
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
  // summary's "step_time" object (02–08 set it; see common/step_time.h, predict_step_time).
  std::function<Json(const StepTimes&)> step_time;
  MemoryPrediction predicted;
};
// Runs steps [first, rc.steps): timing, the step log (loss, lr, grad norm, tokens/s, MFU, peak
// memory), NaN/inf detection, the held-out loss every --eval-every steps and at the end, periodic
// and final checkpoints, then the summary with the memory table. Collective: every rank calls it.
void train_loop(const RunConfig& rc, Device dev, RunLog& log, const TokenData& data, long first, Loop& loop);

// The summary's "comm" object for one group: per op, calls, wire bytes and payload bytes per step
// (the group's counters divided by the steps run) next to the predicted wire bytes per step.
Json comm_report(RunLog& log, const class Comm& group, long steps, const std::map<std::string, double>& predicted);

// "1.23 MiB"
std::string human_bytes(double b);
// The memory table: each category measured (this rank's allocator, per-category peak of bytes in
// use) next to the prediction, then the total peak and the allocator's reserved peak (cached
// free blocks included); returned as the summary's "memory" object.
Json memory_report(RunLog& log, Device dev, const MemoryPrediction& pred);

}  // namespace ts
