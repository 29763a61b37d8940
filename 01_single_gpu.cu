// 01_single_gpu.cu — the baseline: one device trains the whole model.
//
// The playbook's first chapter, runnable: the anatomy of a training step (forward, backward,
// optimizer), where the memory goes (parameters, gradients, optimizer states, activations),
// activation recomputation, gradient accumulation and mixed precision. Every other technique is
// proven against the losses and weights this file produces.
//
//   ./build/01_single_gpu --preset tiny --steps 200
//   ./build/01_single_gpu --dry-run --preset 8b --micro-batch 1 --dtype bf16 --recompute full
//   ./build/01_single_gpu --preset tiny --steps 200 --eval-every 50 --sample 200 --prompt "the "
#ifndef TS_01_SINGLE_GPU_CU
#define TS_01_SINGLE_GPU_CU
#include <cmath>
#include <vector>

#include "tensor/rng.h"
#include "formats/data.h"
#include "comm/comm.h"
#include "model/model.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/report.h"
#include "training/train.h"

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
  const bool show = show_step_memory(model, log, rc, step);
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
  moe_step_report(model, r, {}, opt.master);  // tokens per expert, dropped fraction, aux loss, the routing bias
  return r;
}

// ----- sampling ---------------------------------------------------------------------------------------

// Bytes as a terminal shows them: printable ASCII as is, \n, \t and \\ escaped, anything else \xNN.
static std::string escape_bytes(const std::vector<int32_t>& bytes) {
  std::string out;
  for (int32_t b : bytes) {
    char buf[8];
    if (b == '\n') out += "\\n";
    else if (b == '\t') out += "\\t";
    else if (b == '\\') out += "\\\\";
    else if (b >= 0x20 && b < 0x7f) out += char(b);
    else snprintf(buf, sizeof buf, "\\x%02x", unsigned(b)), out += buf;
  }
  return out;
}

// The next byte from one row of logits: the argmax (temperature 0), or a draw from
// softmax(logits / temperature) with the counter-based generator (the same bytes on every run
// with the same --seed).
static int32_t next_byte(const std::vector<float>& logits, double temperature, uint64_t key, uint64_t i) {
  int32_t best = 0;
  for (int32_t v = 1; v < int32_t(logits.size()); v++)
    if (logits[size_t(v)] > logits[size_t(best)]) best = v;
  if (temperature == 0) return best;
  std::vector<double> p(logits.size());
  double total = 0;
  for (size_t v = 0; v < p.size(); v++) total += p[v] = std::exp((logits[v] - logits[size_t(best)]) / temperature);
  double u = rng_uniform(key, i) * total;
  for (size_t v = 0; v < p.size(); v++)
    if ((u -= p[v]) <= 0) return int32_t(v);
  return best;  // rounding left u just above 0
}

// n bytes after `context`. Attention is causal: the logits at position t depend only on the
// tokens up to t, so one full forward over the last `seq` tokens, read at the last position,
// gives the next byte's distribution. That recomputes the whole window for every byte (no
// key-value cache): simple, and fast enough for the models this program trains.
static std::vector<int32_t> generate(Model& model, std::vector<int32_t> context, int n, double temperature,
                                     uint64_t seed) {
  const uint64_t key = rng_key(seed, "sample");
  std::vector<int32_t> out;
  for (int i = 0; i < n; i++) {
    const size_t S = std::min(context.size(), size_t(model.cfg.seq));
    const std::vector<int32_t> window(context.end() - long(S), context.end());
    const Tensor logits = model.forward_logits(from_host_i32(window, model.dev), 1);
    const int64_t V = model.cfg.vocab;  // only the last position's row comes to the host
    const int32_t b = next_byte(to_host_f32(logits.view((int64_t(S) - 1) * V, {V})), temperature, key, uint64_t(i));
    out.push_back(b);
    context.push_back(b);
  }
  return out;
}

struct SampleFlags {
  int bytes = 0;
  std::string prompt;
  double temperature = 0.8;
};

// Sampling prints bytes: the model and the data must be byte-level (checked before training).
static void check_sample(const RunConfig& rc, const TokenData& data, const SampleFlags& f) {
  if (f.bytes == 0) return;
  if (rc.model.vocab < 256) config_error("--sample needs a vocabulary of bytes (--vocab 256 or more, got %d)", rc.model.vocab);
  if (!data.bytes)
    config_error("--sample: %s holds token ids, not bytes (an llm.c shard of another tokenizer); --sample prints "
                 "bytes: train on text, or on scripts/prepare_data.py's shards", data.description.c_str());
}

// After training: `f.bytes` bytes greedily and at the temperature, after the prompt (the data's
// first byte without one).
static void print_samples(Model& model, const TokenData& data, const RunConfig& rc, const SampleFlags& f, RunLog& log) {
  std::vector<int32_t> prompt(f.prompt.begin(), f.prompt.end());
  for (auto& b : prompt) b &= 0xff;  // char may be signed
  if (prompt.empty()) prompt.push_back(data.tokens[0]);
  log.line("sample, greedy, %d bytes after \"%s\":", f.bytes, escape_bytes(prompt).c_str());
  log.line("  %s", escape_bytes(generate(model, prompt, f.bytes, 0, rc.seed)).c_str());
  log.line("sample, temperature %g, seed %llu, %d bytes after \"%s\":", f.temperature, (unsigned long long)rc.seed,
           f.bytes, escape_bytes(prompt).c_str());
  log.line("  %s", escape_bytes(generate(model, prompt, f.bytes, f.temperature, rc.seed)).c_str());
}

// ----- main -----------------------------------------------------------------------------------------
#if TS_PROGRAM == 1
// The chapter's flags: --sample and its prompt and temperature; 01 runs on one rank.
static SampleFlags read_sample_flags(Args& args) {
  SampleFlags f;
  f.bytes = args.get_int("--sample", 0, "after training, print N bytes generated by the model (byte data: vocab >= 256)",
                         between(0, 1 << 24));
  f.prompt = args.get_str("--prompt", "", "--sample: the text to continue (default: the data's first byte)");
  f.temperature = args.get_double("--temperature", f.temperature,
                                  "--sample: softmax temperature of the second sample (the first is greedy)");
  if (f.temperature <= 0) config_error("--temperature must be > 0 (got %g)", f.temperature);
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) config_error("01_single_gpu runs on one rank (got %d); see 02_data_parallel for more", world);
  return f;
}

// The whole model on one rank is the checkpoint: written as one slice.
static void save(const RunConfig& rc, Model& model, AdamW& opt, long step) {
  Json mesh = Json::object();
  mesh["world"] = 1;
  save_checkpoint(rc.save_dir, rc, model.table, {{0, model.table.total, weights_f32(model.params, opt), &opt}}, step,
                  mesh);
}

int main(int argc, char** argv) {
  SampleFlags sample;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig&) { sample = read_sample_flags(a); },
                  /*priced=*/false);
  RunConfig& rc = run.rc;
  const MemoryPrediction predicted = predict_replica(rc, param_count(rc.model));
  if (!run.start([&] { print_prediction(run.log(), rc); }, [&] { return predicted; })) return 0;
  check_sample(rc, run.data, sample);
  Model& model = run.build_model();
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);
  Loop loop;
  loop.predicted = predicted;
  loop.step = [&](long step) { return train_step(model, opt, run.data, rc, step, run.log()); };
  loop.save = [&](long step) { save(rc, model, opt, step); };
  loop.eval = [&] { return held_out_loss(model, run.held_out, rc, 0, rc.batch, {}); };
  run.train(loop);
  if (sample.bytes > 0) print_samples(model, run.data, rc, sample, run.log());
  return 0;
}
#endif  // TS_PROGRAM == 1
#endif  // TS_01_SINGLE_GPU_CU
