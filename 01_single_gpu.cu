// 01_single_gpu.cu — the baseline: one device trains the whole model.
//
// The playbook's first chapter, runnable: the anatomy of a training step (forward, backward,
// optimizer), where the memory goes (parameters, gradients, optimizer states, activations),
// activation recomputation, gradient accumulation and mixed precision. Every other technique is
// proven against the losses and weights this file produces.
//
//   ./build/01_single_gpu --preset tiny --steps 200
//   ./build/01_single_gpu --dry-run --preset 8b --micro-batch 1 --dtype bf16 --recompute full
#ifndef TS_01_SINGLE_GPU_CU
#define TS_01_SINGLE_GPU_CU
#include <cmath>

#include "checkpoint.h"
#include "comm.h"
#include "data.h"
#include "model.h"
#include "moe.h"
#include "run.h"
#include "train.h"

using namespace ts;

static const char* kDoc =
    "01_single_gpu: train the Llama-style model on one device (the baseline of every technique).\n"
    "usage: 01_single_gpu [flags]";

// ----- predict: the playbook's memory formulas for this model, before anything is allocated ----

static void print_prediction(RunLog& log, const RunConfig& rc) {
  const MemoryPrediction p = predict_replica(rc, param_count(rc.model));
  print_model(log, rc.model);
  log.line("predicted memory (%s, micro-batch %d, recompute %s):", dtype_name(rc.dtype), rc.micro_batch,
           recompute_name(rc.recompute));
  log.line("  params      %12s", human_bytes(p.params).c_str());
  log.line("  grads       %12s", human_bytes(p.grads).c_str());
  log.line("  optimizer   %12s", human_bytes(p.optimizer).c_str());
  log.line("  activations %12s", human_bytes(p.activations).c_str());
  log.line("  total       %12s", human_bytes(p.params + p.grads + p.optimizer + p.activations).c_str());
}

// ----- one optimizer step -----------------------------------------------------------------------

// Gradient accumulation: the global batch runs as batch/micro_batch forward-backward passes whose
// gradients add up in the fp32 gradient buffer; each token's loss is scaled by 1/(batch·seq) so
// the sum is the mean over every token of the global batch, whatever the micro-batch size.
static StepResult train_step(Model& model, AdamW& opt, const TokenData& data, const RunConfig& rc, long step,
                          RunLog& log) {
  const int T = rc.model.seq, mb = rc.micro_batch;
  const float scale = 1.f / (float(rc.batch) * T);
  zero(model.grads);
  const bool show = step < 2 && !rc.quiet;  // the first two steps print their memory
  model.after_forward.clear();
  if (show) model.after_forward.add([&] { print_memory(log, model.dev, step, "after forward"); });
  for (int s0 = 0; s0 < rc.batch; s0 += mb) {
    MicroBatch b = make_microbatch(data, step, rc.batch, T, s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, scale);
  }
  if (show) print_memory(log, model.dev, step, "after backward");
  const double loss = global_mean_loss(model.take_loss(), double(rc.batch) * T, {});
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  if (show) print_memory(log, model.dev, step, "after optimizer");
  StepResult r{loss, norm};
  moe_step_report(model, r, {});  // tokens per expert, dropped fraction, aux loss (with --experts)
  return r;
}

// ----- main -----------------------------------------------------------------------------------------
#if TS_PROGRAM == 1
int main(int argc, char** argv) {
  Program prog(argc, argv, kDoc, [](Args&, RunConfig&, MeshConfig&) {
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != 1) config_error("01_single_gpu runs on one rank (got %d); see 02_data_parallel for more", world);
  });
  RunConfig& rc = prog.rc;
  RunLog& log = prog.log();
  if (prog.dry_run([&] { print_prediction(log, rc); })) return 0;
  prog.open();
  print_prediction(log, rc);
  check_memory_fits(predict_replica(rc, param_count(rc.model)), prog.dev);

  Model model(rc.model, prog.dev, rc.dtype, rc.recompute);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  const long first = init_or_resume(model, opt, rc, 0, model.table.total, model.params);
  if (first > 0) log.line("resumed from %s at step %ld", rc.resume_dir.c_str(), first);

  Loop loop;
  loop.predicted = predict_replica(rc, param_count(rc.model));
  loop.step = [&](long step) { return train_step(model, opt, prog.data, rc, step, log); };
  loop.save = [&](long step) {
    Json mesh = Json::object();
    mesh["world"] = 1;
    save_checkpoint(rc.save_dir, rc, model.table, {{0, model.table.total, weights_f32(model.params, opt), &opt}}, step,
                    mesh);
  };
  train_loop(rc, prog.dev, log, prog.data, first, loop);
  return 0;
}
#endif  // TS_PROGRAM == 1
#endif  // TS_01_SINGLE_GPU_CU
