// train.cu — the shared start (Program), init or resume, the held-out loss and the training loop.
#include "training/train.h"
#include "tensor/allocator.h"
#include "formats/data_sources.h"
#include "training/checkpoint_files.h"
#include "training/config_flags.h"
#include "tensor/hooks.h"
#include "model/tp_ops.h"
#include "model/mlp_block.h"
#include "kernels/kernels.h"

#include "training/numerics.h"
#include "training/program.h"
#include "training/report.h"
#include "training/step_time.h"

#include "kernels/kernels_bf16.h"
#include "kernels/profile.h"
#include "formats/data.h"
#include "comm/comm.h"
#include "comm/fake_world.h"
#include "training/fake_world_flags.h"
#include "tensor/shape_only.h"
#include "training/memory_timeline.h"
#include "comm/flight_recorder.h"
#include "comm/threads.h"
#include "comm/trace.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "training/run.h"
#include "comm/watchdog.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <map>

namespace ts {

// The training data (every rank loads the same tokens and reads its own windows), after choosing
// the threads per rank (collective) and the BLAS check on the CPU; prints the threads, the
// device, the source and its loss floor.
static TokenData open_data(const RunConfig& rc, Device dev, RunLog& log);

static MicroBatch microbatch_at(const TokenData& d, long batch, int B, int T, int seq0, int nseq, Device dev) {
  std::vector<int32_t> in(size_t(nseq) * T), tg(size_t(nseq) * T);
  fill_batch(d, batch, B, T, seq0, nseq, in.data(), tg.data());
  return {upload_ints(in, dev), upload_ints(tg, dev)};
}

// A training step reads batch `step` of the stream, unless a rewind skipped batches before it.
MicroBatch make_microbatch(const TokenData& d, long step, int B, int T, int seq0, int nseq, Device dev) {
  return microbatch_at(d, numerics().batch_of(step), B, T, seq0, nseq, dev);
}

// ----- the shared start ----------------------------------------------------------------------------

Program::Program(int argc, char** argv, const char* doc, const std::function<void(Args&, RunConfig&, MeshConfig&)>& own) {
  comm_init(&argc, &argv);
  Args args(argc, argv, doc);
  rc = parse_run_config(args);
  read_fake_world_flags(args, rc);
  memory_timeline_open(args.get_str("--memory-timeline", "", "write every allocation and free with its phase (forward/"
                                    "backward unit k, optimizer) to FILE (CSV; scripts/plot.py --timeline draws it)"));
  numerics().configure(rc);
  set_comm_timeout(rc.timeout);  // the watchdog's deadline, before any collective
  flight::configure(rc.flight_entries, rc.flight_dir);
  rc.program = argc > 0 ? std::string(argv[0]).substr(std::string(argv[0]).find_last_of('/') + 1) : "";
  // DeepSeek-V3's routing bias moves in the step report (moe_step_report) that only 01, 07 and 08 call.
  const auto is = [&](const char* prefix) { return rc.program.rfind(prefix, 0) == 0; };
  if (rc.model.sigmoid_router && rc.model.bias_update_rate > 0 && !is("01_") && !is("07_") && !is("08_"))
    config_error("%s does not move the routing bias of --router sigmoid (01, 07 and 08 do): pass --bias-update-rate 0",
                 rc.program.c_str());
  own(args, rc, mc);
  args.finish();
  rc.flags = args.effective();
  if (!rc.dry_run && !fake_world()) check_launch(args, mc);  // a fake world checks its mesh in make_mesh
  resolve_batch(rc, mc.dp);
  log_ = std::make_unique<RunLog>(rc, Device::CPU);
}

Program::~Program() {
  log_.reset();
  mesh = Mesh();  // communicators go before MPI does
  comm_finalize();
}

bool Program::dry_run(const std::function<void()>& print) {
  if (!rc.dry_run) return false;
  print();
  return true;
}

void Program::open() {
  dev = parse_device(rc.device);
  mesh = make_mesh(mc, dev);
  // Which transport the run's tensors take (NCCL, MPI, MPI staged through the host; notes/collectives).
  if (mesh.world > 1)
    log().line("mesh: %d ranks = dp %d x pp %d x cp %d x tp %d; %s tensors travel by %s", mesh.world, mc.dp, mc.pp,
               mc.cp, mc.tp, device_name(dev), mesh.world_comm().transport(dev));
  data = open_data(rc, dev, log());
  if (rc.eval_every > 0) {
    const int64_t windows = int64_t(rc.eval_batches) * rc.batch;
    held_out = split_held_out(data, rc.eval_data, rc.model.vocab, windows, rc.model.seq);
    log().line("held out: %s; %lld evaluation windows of %d (--eval-batches %d × --batch %d) every %ld steps and at "
               "the end", held_out.description.c_str(), (long long)windows, rc.model.seq, rc.eval_batches, rc.batch,
               rc.eval_every);
  }
}

void print_model(RunLog& log, const ModelConfig& m) {
  log.line("model: dim %d, layers %d, heads %d (kv %d), ffn %d, vocab %d, seq %d", m.dim, m.layers, m.heads,
           m.kv_heads, m.ffn, m.vocab, m.seq);
  log.line("parameters: %.3fM (%.3fM without the embedding); %.3f GFLOP per token (6N + 12·L·h·s)",
           param_count(m) / 1e6, param_count(m, false) / 1e6, flops_per_token(m) / 1e9);
  if (m.experts > 0)
    log.line("mixture of experts: %d experts of ffn %d per layer, top-%d, capacity factor %g%s, aux-loss coef %g; "
             "FLOPs count the %.3fM active parameters",
             m.experts, m.expert_width(), m.top_k, double(m.capacity_factor), m.capacity_factor > 0 ? "" : " (dropless)",
             double(m.aux_loss_coef), (flops_per_token(m) - 12.0 * m.layers * m.dim * double(m.seq)) / 6e6);
  if (m.sigmoid_router || m.shared_experts > 0 || m.expert_ffn > 0)
    log.line("DeepSeekMoE: %d shared experts of ffn %d, %s router, routed scaling %g, bias update rate %g, each token "
             "in %d of %d expert groups",
             m.shared_experts, m.expert_width(), m.sigmoid_router ? "sigmoid" : "softmax", double(m.routed_scaling),
             double(m.bias_update_rate), m.group_limit, m.expert_groups);
}

// ----- the shared loop ---------------------------------------------------------------------------

TokenData open_data(const RunConfig& rc, Device dev, RunLog& log) {
  const ThreadChoice threads = setup_threads(rc.threads, int64_t(rc.micro_batch) * rc.model.seq, rc.model.dim);
  // On the CPU: the sgemm kernel OpenBLAS runs and, for bf16, the path of the bf16 matmuls (chosen
  // here, before any step, so that a TS_BF16_GEMM this CPU cannot run stops every rank at once).
  std::string kernels;
  if (dev == Device::CPU) kernels = "; " + sgemm_core_note();
  if (dev == Device::CPU && rc.dtype == DType::BF16) kernels += "; " + cpu::bf16_gemm_note();
  log.line("threads: %s%s", describe(threads).c_str(), kernels.c_str());
  if (const std::string w = sgemm_core_warning(); dev == Device::CPU && !w.empty() && world_rank() == 0)
    fprintf(stderr, "%s\n", w.c_str());
  TokenData data = load_data(rc.data, rc.model.vocab, rc.seed, rc.model.seq + 2);
  log.line("device: %s | data: %s", device_description(dev).c_str(), data.description.c_str());
  if (std::isfinite(data.entropy_floor))
    log.line("loss floor (entropy rate of the source): %.4f nats/token; ln(vocab) = %.4f", data.entropy_floor,
             std::log(double(rc.model.vocab)));
  return data;
}

// Every range init_or_resume filled in this process, so that --on-spike rewind can load a
// checkpoint into the same places (the models and optimizers live as long as the run).
struct LoadedRange {
  const Model* model;
  AdamW* opt;
  int64_t b, e;
  Tensor weights;
};
static std::vector<LoadedRange>& loaded_ranges() {
  static std::vector<LoadedRange> r;
  return r;
}

// [b, e) of the weights and moments from the checkpoint in dir; returns its step.
static long load_range(const std::string& dir, const LoadedRange& r, const RunConfig& rc) {
  Tensor w32 = Tensor::empty({r.e - r.b}, DType::F32, r.model->dev, Tag::Workspace);
  r.opt->ensure_state();
  const CheckpointInfo info = load_checkpoint(dir, rc.model, r.model->table, r.b, r.e, w32, r.opt);
  numerics().load_skips(info.trainer);
  convert(r.weights, w32);  // a copy in fp32, a rounding to bf16 otherwise
  r.opt->load_master(*r.model, w32);
  return info.step;
}

long init_or_resume(Model& model, AdamW& opt, const RunConfig& rc, int64_t b, int64_t e, const Tensor& weights) {
  numerics().attach(model);
  memory_timeline_attach(model);
  const LoadedRange r{&model, &opt, b, e, weights};
  loaded_ranges().push_back(r);
  if (!rc.resume_dir.empty()) return load_range(rc.resume_dir, r, rc);
  Tensor w32 = Tensor::empty({e - b}, DType::F32, model.dev, Tag::Workspace);
  Model::init_range(model.table, rc.seed, b, e, w32);
  convert(weights, w32);
  opt.load_master(model, w32);
  return 0;
}

// --on-spike rewind after a spike at `step`: every rank loads its ranges again from `dir` (the
// newest checkpoint this run saved or resumed from), and from that checkpoint's step c on the
// run reads the batches after the spike's, skipping those of steps c..step (PaLM's remedy: the
// same weights, other data). Returns c. A spike that recurs at the same checkpoint three
// times is not the data's: the run stops.
static long rewind(const RunConfig& rc, RunLog& log, const std::string& dir, long step) {
  finish_async_save();  // the checkpoint to read must be published
  static std::map<long, int> rewinds;  // checkpoint step -> rewinds to it
  const std::string at = resolve_checkpoint(dir);  // --keep-last: the newest step_ under it
  long c = -1;
  for (const LoadedRange& r : loaded_ranges()) c = load_range(at, r, rc);
  if (++rewinds[c] > 3)
    config_error("spike at step %ld: rewound to the checkpoint of step %ld three times already; the spikes do not "
                 "come from the data (try a lower --lr)", step, c);
  numerics().add_skip(c, step);
  log.line("rewind: weights and optimizer state of step %ld loaded from %s; batches %ld..%ld skipped", c,
           at.c_str(), numerics().batch_of(c) - (step - c + 1), numerics().batch_of(c) - 1);
  Json e = Json::object();
  e["event"] = "rewind";
  e["step"] = step;
  e["to_step"] = c;
  e["skipped_batches"] = numerics().skips_json();
  log.event(e);
  return c;
}

Tensor weights_f32(const Tensor& weights, const AdamW& opt) {
  if (opt.master.defined()) return opt.master;
  if (weights.dtype == DType::F32) return weights;  // read before the next update changes it
  Tensor w = Tensor::empty(weights.shape, DType::F32, weights.device(), Tag::Workspace);
  convert(w, weights);
  return w;
}

void print_memory(RunLog& log, Device dev, long step, const char* when) {
  const MemStats& s = mem_stats(dev);
  auto b = [&](Tag t) { return human_bytes(double(s.current[int(t)])); };
  log.line("  step %ld %-15s params %10s  grads %10s  optimizer %10s  activations %10s", step, when,
           b(Tag::Params).c_str(), b(Tag::Grads).c_str(), b(Tag::Optimizer).c_str(), b(Tag::Activations).c_str());
}

bool show_step_memory(Model& model, RunLog& log, const RunConfig& rc, long step) {
  const bool show = step < 2 && !rc.quiet;
  model.after_forward.clear();
  if (show) model.after_forward.add([&log, &model, step] { print_memory(log, model.dev, step, "after forward"); });
  return show;
}

double held_out_loss(Model& model, const TokenData& held_out, const RunConfig& rc, int seq0, int nseq,
                     const std::vector<MPI_Comm>& token_groups) {
  const int T = rc.model.seq, mb = rc.micro_batch;
  LossTally sum;  // read once at the end, as the training loss is read once per step
  // Evaluation batch k reads the windows training step k would read, in the held-out tokens.
  for (long k = 0; k < rc.eval_batches; k++)
    for (int s0 = 0; s0 < nseq; s0 += mb) {
      MicroBatch b = microbatch_at(held_out, k, rc.batch, T, seq0 + s0, mb, model.dev);
      Tensor logits = model.forward_logits(b.inputs, mb);
      Tensor losses = Tensor::empty({int64_t(mb) * T}, DType::F32, model.dev, Tag::Workspace);
      // grad_scale 0: the loss function's gradient output is zeros, written over the logits.
      model.loss->forward_backward(losses, logits, logits, b.targets, model.vocab_start, 0.f);
      sum.add(losses);
    }
  return global_mean_loss(sum.take(), double(rc.eval_batches) * rc.batch * T, token_groups);
}

// Without an evaluation pass a technique refuses the flag rather than ignoring it: its checkpoint
// holds the whole model, which 01 evaluates.
static void check_eval_available(const RunConfig& rc, const Loop& loop) {
  if (rc.eval_every == 0 || loop.eval) return;
  config_error("--eval-every is not available in %s: it has no evaluation pass (01, 02 and 03 have one); save with "
               "--save DIR and evaluate its checkpoint with 01_single_gpu --resume DIR --steps <the checkpoint's step> "
               "--eval-every 1 (and the same --preset and --data)", rc.program.c_str());
}

StepTimes step_times(long first_step, const std::vector<double>& seconds) {
  StepTimes t;
  t.first_step = first_step;
  if (seconds.empty()) return t;
  t.warmup_s = seconds[0];
  std::vector<double> rest(seconds.begin() + 1, seconds.end());
  t.measured = rest.size();
  if (rest.empty()) {
    t.median_s = seconds[0];
    return t;
  }
  std::sort(rest.begin(), rest.end());
  const size_t n = rest.size();
  t.median_s = n % 2 ? rest[n / 2] : (rest[n / 2 - 1] + rest[n / 2]) / 2;
  return t;
}

// The seconds a save holds training up: all of it when synchronous; the staging copy (and any
// wait for the previous save) under --async-save.
static double timed_save(Loop& loop, long step) {
  auto t0 = std::chrono::steady_clock::now();
  loop.save(step);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The stall per save, and the staging buffer of an asynchronous one next to its formula.
static Json checkpoint_report(RunLog& log, const RunConfig& rc, const std::vector<double>& stalls) {
  std::vector<double> periodic(stalls.begin(), stalls.end() - (stalls.size() > 1 ? 1 : 0));  // the last waits for itself
  std::sort(periodic.begin(), periodic.end());
  Json c = Json::object();
  c["saves"] = int64_t(stalls.size());
  c["async"] = rc.async_save;
  c["stall_s_median"] = periodic[periodic.size() / 2];
  c["stall_s_max"] = periodic.back();
  c["staging_bytes"] = int64_t(checkpoint_staging_peak());
  log.line("checkpoints: %zu saves (%s); training stalled %.4f s per save (median; max %.4f)%s", stalls.size(),
           rc.async_save ? "asynchronous: staged in memory, written behind training" : "synchronous",
           periodic[periodic.size() / 2], periodic.back(), stalls.size() > 1 ? ", the final save not counted" : "");
  return c;
}

// The numerics' fields join the technique's own (MoE routing statistics) in the step record.
static void merge_into(Json& extra, const Json& more) {
  if (!more.is_object() || more.size() == 0) return;
  if (!extra.is_object()) extra = Json::object();
  for (const auto& [k, v] : more.items()) extra[k] = v;
}

// What the steps leave for the summary.
struct RunTally {
  std::vector<double> seconds;  // each step's wall time
  std::vector<double> stalls;   // seconds each save held training up
  double last_loss = NAN, last_eval = NAN;
  long done = 0;
  int stop = 0;  // the signal that stopped the run
};

// The summary line and JSON: memory table, communication, losses, throughput, checkpoint stalls,
// the step-time model against the measured steps, the technique's own fields.
static void summarize(const RunConfig& rc, Device dev, RunLog& log, const TokenData& data, Loop& loop, long first,
                      const RunTally& t) {
  const double tokens = double(rc.batch) * rc.model.seq;
  Json summary = Json::object();
  summary["memory"] = memory_report(log, dev, loop.predicted, rc.async_save ? checkpoint_staging_peak() : 0);
  summary["comm"] = loop.comm ? loop.comm(t.done - first) : Json::object();
  summary["final_loss"] = t.last_loss;
  summary["steps_done"] = t.done;
  if (t.stop) summary["stopped_by"] = t.stop == SIGINT ? "SIGINT" : "SIGTERM";
  summary["loss_floor"] = data.entropy_floor;
  if (rc.eval_every > 0) summary["eval_loss"] = t.last_eval;
  if (!t.seconds.empty()) {
    std::vector<double> tps;
    for (double s : t.seconds) tps.push_back(tokens / s);
    std::sort(tps.begin(), tps.end());
    summary["tokens_per_s_median"] = tps[tps.size() / 2];
    char eval[48] = "";
    if (rc.eval_every > 0) snprintf(eval, sizeof eval, "; eval loss %.4f", t.last_eval);
    if (shape_only())  // no values, no loss (tensor/shape_only.h); the step time is the host's bookkeeping alone
      log.line("median step %.3f s over %zu steps (--device shape: no kernels ran, no loss)", tokens / tps[tps.size() / 2],
               tps.size());
    else
      log.line("median %.0f tokens/s over %zu steps; final loss %.4f (floor %.4f)%s", tps[tps.size() / 2], tps.size(),
               t.last_loss, data.entropy_floor, eval);
  }
  if (!t.stalls.empty()) summary["checkpoint"] = checkpoint_report(log, rc, t.stalls);
  if (loop.step_time && !t.seconds.empty()) summary["step_time"] = loop.step_time(step_times(first, t.seconds));
  if (loop.extra) loop.extra(summary);
  log.summary(summary);
}

void train_loop(const RunConfig& rc, Device dev, RunLog& log, const TokenData& data, long first, Loop& loop) {
  check_eval_available(rc, loop);
  // tokens/s is the whole job's (the global batch per step) and the peak is one device's: MFU is
  // per device, so the job's FLOP rate is measured against the peak of all its devices.
  int world = 1;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  const double peak = world * peak_tflops_for(dev, rc.dtype, rc.peak_tflops) * 1e12;
  const double tokens = double(rc.batch) * rc.model.seq;
  if (!rc.trace.empty()) Trace::get().enable();
  ProfileScope::reset();
  catch_stop_signals();
  RunTally t;
  t.done = first;
  long saved = -1, evaluated = -1;
  std::string rewind_to = rc.resume_dir;  // the newest checkpoint: --on-spike rewind goes back to it
  for (long step = first; step < rc.steps && !t.stop; step++) {
    set_current_step(step);
    memory_phase("step start");  // the micro-batches' tokens, until the first unit's forward
    numerics().begin_step(step);
    auto t0 = std::chrono::steady_clock::now();
    StepResult r = loop.step(step);
    device_sync(dev);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm))
      numerics().locate_nonfinite(step, r.loss, r.grad_norm, [&] { loop.step(step); }, log);
    merge_into(r.extra, numerics().end_step(step, r.loss, r.grad_norm, log, r.note));
    t.seconds.push_back(secs);
    t.last_loss = r.loss;
    t.done = step + 1;
    // After the update, outside the step's time: the loss of the weights this step produced.
    const bool eval_due = rc.eval_every > 0 && (t.done % rc.eval_every == 0 || t.done == rc.steps);
    if (eval_due) t.last_eval = loop.eval(), evaluated = t.done;
    log.step({step, r.loss, lr_at(rc, step), r.grad_norm, tokens / secs,
              peak > 0 ? flops_per_token(rc.model) * tokens / secs / peak : 0.0, secs * 1e3, mem_stats(dev).total_peak,
              r.extra, r.note, flops_per_token(rc.model) * tokens / secs, eval_due ? t.last_eval : NAN});
    if (numerics().rewind_due() && !rewind_to.empty()) {
      step = rewind(rc, log, rewind_to, step) - 1;  // the loop goes on at the checkpoint's step
      t.done = step + 1;
      continue;
    }
    if (numerics().rewind_due()) log.line("rewind: no checkpoint yet to rewind to; the update was applied");
    progress_async_save();  // an asynchronous save moves on (collective; nothing without one)
    if (!rc.save_dir.empty() && rc.save_every > 0 && t.done % rc.save_every == 0 && t.done < rc.steps) {
      t.stalls.push_back(timed_save(loop, t.done));
      saved = t.done;
      rewind_to = rc.save_dir;
    }
    t.stop = agreed_stop_signal();
  }
  set_current_step(-1);
  // No step ran (a --resume at its own step: evaluating a checkpoint), or a signal stopped the run.
  if (rc.eval_every > 0 && evaluated != t.done) {
    t.last_eval = loop.eval();
    log.line("eval loss %.6f after step %ld (held-out data)", t.last_eval, t.done);
  }
  if (!rc.save_dir.empty() && saved != t.done) t.stalls.push_back(timed_save(loop, t.done));
  finish_async_save();
  if (t.stop)
    log.line("%s: stopped after %ld of %ld steps; %s", t.stop == SIGINT ? "SIGINT" : "SIGTERM", t.done, rc.steps,
             rc.save_dir.empty() ? "no --save, so nothing to resume from" : ("resume with --resume " + rc.save_dir).c_str());
  summarize(rc, dev, log, data, loop, first, t);
  memory_timeline_close();
  if (!rc.trace.empty()) Trace::get().write(rc.trace);
  ProfileScope::print();
}

// ===== the step's report =========================================================================

void moe_step_report(Model& m, StepResult& r, const std::vector<MPI_Comm>& token_groups, const Tensor& master) {
  auto* moe = dynamic_cast<MoeBlock*>(m.mlp.get());
  if (!moe) return;
  MoeStats& st = moe->stats;
  std::vector<int64_t> v = st.counts;
  v.push_back(st.assignments);
  v.push_back(st.dropped);
  v.push_back(st.sequences);
  double aux = st.aux_sum;
  for (MPI_Comm c : token_groups) {
    watched_allreduce(MPI_IN_PLACE, v.data(), int(v.size()), MPI_INT64_T, MPI_SUM, c, "all_reduce (the MoE statistics)");
    watched_allreduce(MPI_IN_PLACE, &aux, 1, MPI_DOUBLE, MPI_SUM, c, "all_reduce (the MoE auxiliary loss)");
  }
  const size_t LE = st.counts.size();
  const int64_t seqs = v[LE + 2];
  moe->update_bias(m, std::vector<int64_t>(v.begin(), v.begin() + long(LE)), master);  // every rank's loads
  int64_t lo = v[0], hi = v[0];
  Json counts = Json::array();
  for (size_t i = 0; i < LE; i++) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    counts.push_back(Json(v[i]));
  }
  const double mean = double(v[LE]) / double(LE);  // N·K choices per layer spread over E experts
  const double dropped = v[LE] ? double(v[LE + 1]) / double(v[LE]) : 0.0;
  const double aux_mean = seqs ? aux / double(seqs) : 0.0;
  r.extra = Json::object();
  r.extra["moe_aux_loss"] = aux_mean;
  r.extra["moe_tokens_per_expert"] = counts;
  r.extra["moe_tokens_min"] = lo;
  r.extra["moe_tokens_max"] = hi;
  r.extra["moe_tokens_mean"] = mean;
  r.extra["moe_dropped_fraction"] = dropped;
  r.extra["moe_load_max_over_mean"] = double(hi) / mean;
  char buf[200];
  snprintf(buf, sizeof buf, " | aux %.4f | tokens/expert %lld..%lld (mean %.1f) | dropped %.2f%%", aux_mean,
           (long long)lo, (long long)hi, mean, 100 * dropped);
  r.note = buf;
  if (m.cfg.sigmoid_router) {  // DeepSeek-V3's balance measure: the busiest expert over the mean
    snprintf(buf, sizeof buf, " | load max/mean %.3f", double(hi) / mean);
    r.note += buf;
  }
  st.reset(m.cfg.layers, m.cfg.experts);
}

}  // namespace ts
