// config.cu — the run configuration: 01's flags parsed and checked, presets, the batch split, the lr schedule.
#include "training/config.h"
#include "training/checkpoint_files.h"
#include "training/config_flags.h"

#include "comm/algorithms.h"
#include "formats/data.h"
#include "training/checkpoint.h"
#include "training/run.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>

namespace ts {

bool apply_preset(const std::string& name, ModelConfig& m) {
  // {dim, layers, heads, kv_heads, ffn, vocab, seq}
  if (name == "tiny") m = {64, 2, 4, 2, 160, 256, 32};
  else if (name == "small") m = {256, 4, 8, 4, 688, 256, 256};
  else if (name == "124m") m = {768, 12, 12, 12, 2048, 50304, 1024};
  else if (name == "1b") m = {2048, 16, 32, 8, 8192, 128256, 2048};
  else if (name == "3b") m = {3072, 28, 24, 8, 8192, 128256, 4096};     // Llama-3.2-3B
  else if (name == "8b") m = {4096, 32, 32, 8, 14336, 128256, 4096};    // Llama-3-8B
  else if (name == "70b") m = {8192, 80, 64, 8, 28672, 128256, 4096};   // Llama-3-70B
  // The playbook's 80B benchmark model, known by its size only: 70B's width, 96 layers (so that its
  // pipelines of 16 and 32 stages divide them) and the MLP narrowed to 26,880: 80.0B parameters.
  else if (name == "80b") m = {8192, 96, 64, 8, 26880, 128256, 4096};
  // Llama-3.1-405B (Dubey et al. 2024, table 3): 126 layers, pretrained on sequences of 8192.
  else if (name == "405b") m = {16384, 126, 128, 8, 53248, 128256, 8192};
  // Mixtral-8x7B (Jiang et al. 2024): Mistral-7B's shape with 8 experts per layer, 2 per token.
  else if (name == "8x7b") {
    m = {4096, 32, 32, 8, 14336, 32000, 4096};
    m.experts = 8;
    m.top_k = 2;
  } else if (name == "deepseek-v3") {
    // DeepSeek-V3 (technical report §4.2): 61 layers, h 7168, 128 heads, 256 routed experts of
    // width 2048 and 1 shared, top-8 within 4 of 8 groups, the sigmoid router scaled by 2.5, the
    // bias moved by 0.001, vocabulary 129,280, sequences of 4096. Not expressible here: MLA (an
    // approximation: 128 full heads of 56, kv 128 — its projections within 10% of MLA's, its
    // attention core narrower, notes/07) and the first 3 layers dense of ffn 18,432 (here every
    // layer is MoE; 9 × 2048 = 18,432, so a token's FLOPs are the same).
    m = {7168, 61, 128, 128, 18432, 129280, 4096};
    m.experts = 256, m.top_k = 8, m.expert_ffn = 2048, m.shared_experts = 1;
    m.sigmoid_router = true, m.routed_scaling = 2.5f, m.bias_update_rate = 0.001f;
    m.expert_groups = 8, m.group_limit = 4;
  } else return false;
  if (name == "deepseek-v3") return true;  // rope θ 10000 (the default), YaRN later
  if (name != "tiny" && name != "small" && name != "124m") m.rope_theta = name == "8x7b" ? 1e6f : 500000.f;
  return true;
}

const char* recompute_name(Recompute r) {
  return r == Recompute::None ? "none" : r == Recompute::Selective ? "selective" : "full";
}

// DeepSeekMoE (DeepSeek-V3 report §2.1.2): fine-grained routed experts, shared experts, the
// sigmoid router with its selection-only bias, node-limited (group-limited) routing. Each flag
// defaults to the preset's value (deepseek-v3 sets them; the others leave Mixtral's block).
static void read_deepseek_moe_flags(Args& a, ModelConfig& m) {
  m.expert_ffn = a.get_int("--expert-ffn", m.expert_ffn, "width F_e of each routed and shared expert (0: --ffn)", {0, 1 << 20});
  m.shared_experts = a.get_int("--shared-experts", m.shared_experts, "shared experts S every token passes through (one SwiGLU of width S·F_e)",
                               {0, 1 << 10});
  const std::string r = a.get_str("--router", m.sigmoid_router ? "sigmoid" : "softmax", "softmax (Mixtral) or sigmoid (DeepSeek-V3: sigmoid affinities, "
                                                         "selection-only bias, gate weights renormalised)");
  if (r != "softmax" && r != "sigmoid") config_error("--router must be softmax or sigmoid (got %s)", r.c_str());
  m.sigmoid_router = r == "sigmoid";
  m.routed_scaling = float(a.get_double("--routed-scaling", m.routed_scaling, "gate weights times this factor (DeepSeek-V3: 2.5; --router sigmoid)"));
  m.bias_update_rate = float(a.get_double("--bias-update-rate", m.bias_update_rate > 0 ? m.bias_update_rate : m.sigmoid_router ? 0.001 : 0,
                                          "γ: b_e += γ·sign(mean load − load_e) after each step (--router sigmoid)"));
  const int preset_limit = m.expert_groups > 1 ? m.group_limit : 0;
  m.expert_groups = a.get_int("--expert-groups", m.expert_groups, "G groups of experts for group-limited routing (--router sigmoid)",
                              {-HUGE_VAL, 1 << 16});
  m.group_limit = a.get_int("--group-limit", preset_limit > 0 ? preset_limit : m.expert_groups, "groups M each token may route to (--router sigmoid)",
                            {-HUGE_VAL, 1 << 16});
}

// The model's shape: a preset, then any flag that overrides it.
static void parse_model_flags(Args& a, RunConfig& rc) {
  a.group("model");
  const char* presets = "tiny, small, 124m, 1b, 3b, 8b, 70b, 80b, 405b, 8x7b, deepseek-v3";  // apply_preset's names, in --help and the error
  rc.preset = a.get_str("--preset", "tiny", std::string("model shape: ") + presets + " (explicit flags override)");
  if (!apply_preset(rc.preset, rc.model)) config_error("unknown --preset '%s' (%s)", rc.preset.c_str(), presets);
  ModelConfig& m = rc.model;
  m.dim = a.get_int("--dim", m.dim, "hidden size h", between(1, 1 << 17));
  m.layers = a.get_int("--layers", m.layers, "decoder layers L", between(1, 4096));
  m.heads = a.get_int("--heads", m.heads, "attention heads a", between(1, 4096));
  m.kv_heads = a.get_int("--kv-heads", m.kv_heads, "key/value heads (GQA)", between(1, 4096));
  m.ffn = a.get_int("--ffn", m.ffn, "SwiGLU intermediate size", between(1, 1 << 20));
  m.vocab = a.get_int("--vocab", m.vocab, "vocabulary size", between(2, 1 << 24));
  m.seq = a.get_int("--seq", m.seq, "sequence length s", between(1, 1 << 24));
  m.experts = a.get_int("--experts", m.experts, "mixture of experts: E SwiGLU experts of width --ffn per layer (0: dense MLP)",
                         {-HUGE_VAL, 1 << 16});
  m.top_k = a.get_int("--top-k", m.top_k > 0 ? m.top_k : 2, "experts per token K (with --experts)", {-HUGE_VAL, 1 << 16});
  m.aux_loss_coef = float(a.get_double("--aux-loss-coef", 0, "weight α of the load-balancing loss E·Σ f_e·P_e (with --experts)"));
  m.capacity_factor = float(a.get_double("--capacity-factor", 0, "tokens per expert and sequence: c·T·K/E (0: dropless)"));
  read_deepseek_moe_flags(a, m);
}

const char* fp8_recipe_name(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::Off: return "off";
    case Fp8Recipe::Tensorwise: return "tensorwise";
    case Fp8Recipe::Delayed: return "delayed";
    case Fp8Recipe::Blockwise: return "blockwise";
  }
  return "?";
}

// --fp8-*: the recipe of --dtype fp8 (fp8_linear.h). Given without --dtype fp8 they are refused,
// rather than ignored.
static void parse_fp8_flags(Args& a, Fp8Config& f, bool fp8) {
  const std::string r = a.get_str("--fp8-recipe", "tensorwise",
                                  "tensorwise | delayed | blockwise: current per-tensor scales, scales from an amax "
                                  "history, or 1 x tile / tile x tile block scales (DeepSeek-V3)");
  if (r == "tensorwise") f.recipe = Fp8Recipe::Tensorwise;
  else if (r == "delayed") f.recipe = Fp8Recipe::Delayed;
  else if (r == "blockwise") f.recipe = Fp8Recipe::Blockwise;
  else config_error("--fp8-recipe must be tensorwise, delayed or blockwise (got '%s')", r.c_str());
  if (!fp8) f.recipe = Fp8Recipe::Off;
  f.history = a.get_int("--fp8-history", f.history, "delayed: steps of amax history (the scale uses their max)",
                        between(1, 1 << 16));
  f.margin = a.get_int("--fp8-margin", f.margin, "scale = max_fp8 / amax / 2^margin", between(-100, 100));
  f.tile = a.get_int("--fp8-tile", f.tile, "blockwise: tile width (1 x tile activations and gradients, tile x tile weights)",
                     between(1, 1 << 20));
  f.accum_bits = a.get_int("--fp8-accum-bits", f.accum_bits,
                           "mantissa bits the GEMM accumulator keeps (23: fp32; ~14 emulates Hopper's FP8 MMA)",
                           between(1, 23));
  f.promote_every = a.get_int("--fp8-promote-every", f.promote_every,
                              "N_C: add partial sums into fp32 every N_C products (DeepSeek-V3: 128; 0: never)",
                              between(0, 1 << 24));
  // A value other than the default needs --dtype fp8 (a checkpoint's trainer.json records every
  // flag with its value, defaults included, and --config replays them).
  const Fp8Config d;
  const std::pair<const char*, bool> changed[] = {
      {"--fp8-recipe", r != "tensorwise"},         {"--fp8-history", f.history != d.history},
      {"--fp8-margin", f.margin != d.margin},      {"--fp8-tile", f.tile != d.tile},
      {"--fp8-accum-bits", f.accum_bits != d.accum_bits}, {"--fp8-promote-every", f.promote_every != d.promote_every}};
  if (!fp8)
    for (const auto& [flag, differs] : changed)
      if (differs) config_error("%s needs --dtype fp8", flag);
}

// The numbers, the batch and the optimizer.
static void parse_training_flags(Args& a, RunConfig& rc) {
  a.group("operations");
  rc.device = a.get_str("--device", "auto", "auto | cpu | cuda | shape (shapes and sizes without values: memory at any shape, no losses)");
  a.group("model");
  std::string dt = a.get_str("--dtype", "fp32",
                              "fp32 | bf16 (bf16 compute, fp32 master weights and gradients) | fp8 (bf16, and the dense "
                              "linears' GEMMs on FP8 operands)");
  if (dt == "fp32") rc.dtype = DType::F32;
  else if (dt == "bf16" || dt == "fp8") rc.dtype = DType::BF16;
  else config_error("--dtype must be fp32, bf16 or fp8 (got '%s')", dt.c_str());
  rc.master_weights = !a.get_bool("--no-master-weights", "bf16: update the bf16 weights directly (the playbook's failure)");
  parse_fp8_flags(a, rc.fp8, dt == "fp8");
  a.group("data");
  rc.batch = a.get_int("--batch", rc.batch, "global batch: sequences per optimizer step", between(1, 1 << 24));
  rc.micro_batch = a.get_int("--micro-batch", 0, "sequences per forward pass (0 = whole local batch)", between(0, 1 << 24));
  a.group("optimizer");
  rc.steps = a.get_long("--steps", rc.steps, "optimizer steps (0: save or evaluate the weights as they are)", at_least(0));
  rc.lr = a.get_double("--lr", rc.lr, "peak learning rate", positive());
  rc.beta1 = a.get_double("--beta1", rc.beta1, "AdamW beta1", {0, 1, false, true});
  rc.beta2 = a.get_double("--beta2", rc.beta2, "AdamW beta2", {0, 1, false, true});
  rc.eps = a.get_double("--eps", rc.eps, "AdamW epsilon", positive(1));
  rc.weight_decay = a.get_double("--weight-decay", rc.weight_decay, "decoupled weight decay (2-D weights only)", at_least(0));
  rc.clip = a.get_double("--clip", rc.clip, "global gradient-norm clip (0 disables)", at_least(0));
  rc.lr_schedule = a.get_str("--lr-schedule", rc.lr_schedule, "constant | cosine");
  rc.warmup_steps = a.get_long("--warmup-steps", 0, "linear warm-up steps", at_least(0));
  rc.min_lr = a.get_double("--min-lr", 0, "final learning rate of the cosine schedule", at_least(0));
}

// Seed, data and evaluation, recomputation, logs, checkpoints and operations.
static void parse_run_flags(Args& a, RunConfig& rc) {
  a.group("data");
  rc.seed = uint64_t(a.get_long("--seed", long(rc.seed), "initialisation and synthetic-data seed", at_least(0)));
  rc.data = a.get_str("--data", "", "training text (.txt, bytes) or llm.c shard (.bin); default: embedded synthetic");
  rc.eval_every = a.get_long("--eval-every", 0, "held-out loss every N steps and at the end (0: none; holds out the "
                             "data's last tenth unless --eval-data)");
  rc.eval_batches = a.get_int("--eval-batches", rc.eval_batches, "--eval-every: batches of --batch windows per evaluation");
  rc.eval_data = a.get_str("--eval-data", "", "--eval-every: held-out text or llm.c shard (e.g. prepare_data.py's "
                           "val .bin) instead of the data's tail");
  a.group("model");
  std::string r = a.get_str("--recompute", "none", "activation recomputation: none | selective | full");
  if (r == "none") rc.recompute = Recompute::None;
  else if (r == "selective") rc.recompute = Recompute::Selective;
  else if (r == "full") rc.recompute = Recompute::Full;
  else config_error("--recompute must be none, selective or full (got '%s')", r.c_str());
  a.group("run and checkpoint");
  rc.log_json = a.get_str("--log-json", "", "write per-step JSON lines and a final summary here");
  rc.trace = a.get_str("--trace", "", "write a Chrome trace (Perfetto) here");
  rc.save_dir = a.get_str("--save", "", "checkpoint directory written at the end (and every --save-every steps)");
  rc.save_every = a.get_long("--save-every", 0, "checkpoint period in steps (0: only at the end)", at_least(0));
  rc.keep_last = a.get_int("--keep-last", 0, "keep the last N checkpoints as DIR/step_NNNNNN (0: DIR is one checkpoint, overwritten)",
                        at_least(0));
  rc.resume_dir = a.get_str("--resume", "", "checkpoint to resume from: a checkpoint directory, or a --keep-last DIR (its newest intact step_)");
  rc.reschedule = a.get_bool("--reschedule", "resume even if this run's lr schedule differs from the checkpoint's");
  rc.overwrite = a.get_bool("--overwrite", "--save may replace a checkpoint that this run did not resume from");
  rc.dry_run = a.get_bool("--dry-run", "print the predicted memory and FLOPs and exit, allocating nothing");
  a.group("operations");
  rc.timeout = a.get_double("--timeout", rc.timeout, "seconds before a stuck collective aborts the job", positive(1e6));
  set_collectives(a.get_str("--collectives", "library", "all-reduce, reduce-scatter, all-gather, broadcast written out: "
                            "library (MPI/NCCL's own) | ring | tree | halving-doubling | two-level (notes/collectives.md)"));
  rc.peak_tflops = a.get_double("--peak-tflops", 0, "peak TFLOP/s for MFU (default: by device name)", at_least(0));
  a.group("run and checkpoint");
  rc.quiet = a.get_bool("--quiet", "no step lines, only a progress line every --progress-seconds");
  rc.log_every = a.get_long("--log-every", 0, "print every N-th step (0: about 50 lines per run); the JSON log has every step",
                            at_least(0));
  rc.progress_seconds = a.get_double("--progress-seconds", rc.progress_seconds, "--quiet: seconds between progress lines", positive(1e6));
  a.group("operations");
  // More threads than cores only slow a rank down, and libgomp dies creating tens of thousands.
  rc.threads = a.get_int("--threads", 0, "CPU threads per rank (0: OMP_NUM_THREADS, else the node's cores / its ranks)",
                         between(0, 1024));
}

// What keeps a failure at scale explainable and a save from stalling the run: the flight
// recorder (flight_recorder.h) and asynchronous checkpoints (checkpoint.h).
static void parse_reliability_flags(Args& a, RunConfig& rc) {
  a.group("run and checkpoint");
  rc.async_save = a.get_bool("--async-save", "checkpoints: copy to memory and go on; a background thread writes, syncs and "
                             "publishes (one save in flight)");
  a.group("operations");
  rc.flight_entries = a.get_int("--flight-recorder", rc.flight_entries, "collectives and sends each rank remembers for a "
                                "hang or error report (0: off)", between(0, 10000000));
  rc.flight_dir = a.get_str("--flight-dir", "", "where each rank's flight record goes on a timeout, a fatal error or "
                            "SIGUSR1 (default: DIR.flight beside --save DIR, else ./tinyscale-flight)");
  if (rc.flight_dir.empty()) {
    std::string save = rc.save_dir;
    while (save.size() > 1 && save.back() == '/') save.pop_back();
    rc.flight_dir = save.empty() ? "tinyscale-flight" : save + ".flight";
  }
}

// ----- numerics flags (numerics.h) ----------------------------------------------------------------
const char* on_spike_name(OnSpike s) {
  switch (s) {
    case OnSpike::Report: return "report";
    case OnSpike::Stop: return "stop";
    case OnSpike::Skip: return "skip";
    case OnSpike::Rewind: return "rewind";
  }
  return "?";
}

// The numerics' flags (numerics.h says what each does).
static void parse_numerics_flags(Args& a, RunConfig& rc) {
  a.group("numerics");
  NumericsConfig& n = rc.numerics;
  n.every = a.get_long("--numerics-every", 0, "per-layer gradient norms and activation RMS in the JSON log every N steps "
                       "(0: off)", at_least(0));
  n.spike_window = a.get_int("--spike-window", n.spike_window, "spike detection: steps of loss and grad norm in the "
                             "rolling window (0: off); it fires once the window is full", between(0, 1 << 20));
  n.spike_sigma = a.get_double("--spike-sigma", n.spike_sigma, "spike: a loss or grad norm above mean + sigma · std of "
                               "the window", positive(1e6));
  const std::string on = a.get_str("--on-spike", "report", "report | stop | skip (the step's update is not applied) | "
                                   "rewind (reload the last checkpoint of --save, skip the batches read since)");
  if (on == "report") n.on_spike = OnSpike::Report;
  else if (on == "stop") n.on_spike = OnSpike::Stop;
  else if (on == "skip") n.on_spike = OnSpike::Skip;
  else if (on == "rewind") n.on_spike = OnSpike::Rewind;
  else config_error("--on-spike must be report, stop, skip or rewind (got '%s')", on.c_str());
  if (n.on_spike != OnSpike::Report && n.spike_window == 0)
    config_error("--on-spike %s needs spike detection (--spike-window > 0)", on.c_str());
  if (n.on_spike == OnSpike::Rewind && (rc.save_dir.empty() || rc.save_every <= 0))
    config_error("--on-spike rewind needs checkpoints to rewind to: --save DIR and --save-every N");
  const std::string skip = a.get_str("--skip-batches", "", "FROM:COUNT[,FROM:COUNT...]: from step FROM on, read COUNT "
                                     "batches further along the data (the batches an --on-spike rewind skips, by hand)");
  for (size_t at = 0; at < skip.size();) {
    const size_t end = std::min(skip.find(',', at), skip.size());
    long from = -1, count = -1;
    char tail = 0;
    if (sscanf(skip.substr(at, end - at).c_str(), "%ld:%ld%c", &from, &count, &tail) != 2 || from < 0 || count < 1)
      config_error("--skip-batches wants FROM:COUNT pairs with FROM >= 0 and COUNT >= 1, separated by commas (got '%s')",
                   skip.c_str());
    n.skip_batches.push_back({from, count});
    at = end + 1;
  }
  n.poison_batch = a.get_long("--poison-batch", -1, "lab: multiply this batch's loss gradient by 1000, a bad batch "
                              "that makes a gradient-norm spike (-1: off)", at_least(-1));
  const std::string nan = a.get_str("--inject-nan", "", "lab: STEP:LAYER writes a NaN into the gradient w.r.t. the "
                                    "input of layer LAYER in the backward of step STEP");
  if (!nan.empty()) {
    char tail = 0;
    if (sscanf(nan.c_str(), "%ld:%d%c", &n.nan_step, &n.nan_layer, &tail) != 2 || n.nan_step < 0 || n.nan_layer < 0 ||
        n.nan_layer >= rc.model.layers)
      config_error("--inject-nan wants STEP:LAYER with 0 <= LAYER < --layers %d (got '%s')", rc.model.layers,
                   nan.c_str());
  }
}

static void check_deepseek_moe(const ModelConfig& m) {
  if (m.experts == 0 && (m.expert_ffn > 0 || m.shared_experts > 0 || m.sigmoid_router))
    config_error("--expert-ffn, --shared-experts and --router sigmoid need --experts E");
  if (!m.sigmoid_router && (m.expert_groups != 1 || m.bias_update_rate != 0 || m.routed_scaling != 1))
    config_error("--expert-groups, --group-limit, --bias-update-rate and --routed-scaling need --router sigmoid");
  if (m.routed_scaling <= 0) config_error("--routed-scaling must be > 0 (got %g)", double(m.routed_scaling));
  if (m.bias_update_rate < 0) config_error("--bias-update-rate must be >= 0 (got %g)", double(m.bias_update_rate));
  const int G = m.expert_groups;
  if (G < 1 || m.experts % G) config_error("--expert-groups %d must be >= 1 and divide --experts %d", G, m.experts);
  if (G > 1 && m.experts / G < 2)
    config_error("--expert-groups %d leaves fewer than 2 experts per group (a group scores by its top 2)", G);
  if (m.group_limit < 1 || m.group_limit > G) config_error("--group-limit %d must be between 1 and --expert-groups %d", m.group_limit, G);
  if (m.experts > 0 && m.top_k > m.group_limit * (m.experts / G))
    config_error("--top-k %d exceeds the %d experts of --group-limit %d groups", m.top_k, m.group_limit * (m.experts / G),
                 m.group_limit);
}

// The checks that need several flags at once.
static void check_run_config(const RunConfig& rc) {
  const ModelConfig& m = rc.model;
  if (m.dim % m.heads) config_error("--dim %d is not divisible by --heads %d", m.dim, m.heads);
  if (m.heads % m.kv_heads) config_error("--heads %d is not divisible by --kv-heads %d", m.heads, m.kv_heads);
  if (m.head_dim() % 2) config_error("head dim %d (dim/heads) must be even for RoPE", m.head_dim());
  if (m.experts < 0) config_error("--experts must be >= 0 (got %d)", m.experts);
  if (m.experts > 0 && (m.top_k < 1 || m.top_k > m.experts))
    config_error("--top-k %d must be between 1 and --experts %d", m.top_k, m.experts);
  if (m.capacity_factor < 0) config_error("--capacity-factor must be >= 0 (got %g)", double(m.capacity_factor));
  if (m.aux_loss_coef < 0) config_error("--aux-loss-coef must be >= 0 (got %g)", double(m.aux_loss_coef));
  check_deepseek_moe(m);
  if (rc.eval_every < 0) config_error("--eval-every must be >= 0 (got %ld)", rc.eval_every);
  if (rc.eval_batches < 1) config_error("--eval-batches must be >= 1 (got %d)", rc.eval_batches);
  if (!rc.eval_data.empty() && rc.eval_every == 0) config_error("--eval-data %s needs --eval-every N", rc.eval_data.c_str());
  // Token positions (step·batch + i)·seq and trainer.json's tokens_seen are 64-bit.
  if (rc.steps > INT64_MAX / (int64_t(rc.batch) * m.seq))
    config_error("--steps %ld × --batch %d × --seq %d tokens overflow a 64-bit count", rc.steps, rc.batch, m.seq);
  if (rc.lr_schedule != "constant" && rc.lr_schedule != "cosine")
    config_error("--lr-schedule must be constant or cosine (got '%s')", rc.lr_schedule.c_str());
}

// --resume: the checkpoint it names, and what differs from this run (each rank reads it).
static void check_resume(RunConfig& rc) {
  if (rc.resume_dir.empty()) return;
  rc.resume_dir = resolve_checkpoint(rc.resume_dir);
  TrainerState t;
  try {
    t = read_trainer(rc.resume_dir);
  } catch (const FormatError& e) {
    config_error("checkpoint %s: %s", rc.resume_dir.c_str(), e.what());
  }
  if (t.present) {
    try {
      for (const std::string& n : resume_notes(t.rec, rc))
        if (world_rank() == 0) printf("resume: %s\n", n.c_str());
    } catch (const FormatError& e) {
      config_error("--resume %s: trainer.json: %s", rc.resume_dir.c_str(), e.what());
    }
    check_resume_schedule(rc, t.json, t.rec.step);
  }
}

RunConfig parse_run_config(Args& a) {
  RunConfig rc;
  parse_model_flags(a, rc);
  parse_training_flags(a, rc);
  parse_run_flags(a, rc);
  parse_reliability_flags(a, rc);
  parse_numerics_flags(a, rc);
  a.group("");  // the program's own flags, declared next, print first
  if (rc.model.experts == 0) rc.model.top_k = 0;
  check_run_config(rc);
  rc.without_steps = rc.eval_every > 0 || a.has("--sample");  // --sample: 01's flag, read after these
  check_resume(rc);
  return rc;
}

ModelConfig model_of_flags(const std::string& flags) {
  std::istringstream in(flags);
  std::vector<std::string> words{"model"};
  for (std::string w; in >> w;) words.push_back(w);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  Args a(int(argv.size()), argv.data(), "");
  RunConfig rc;
  parse_model_flags(a, rc);
  if (rc.model.experts == 0) rc.model.top_k = 0;  // as parse_run_config leaves it
  return rc.model;
}

bool same_cost_shape(const ModelConfig& a, const ModelConfig& b) {
  auto shape = [](const ModelConfig& m) {
    return std::vector<int>{m.dim,         m.layers,         m.heads,          m.kv_heads,      m.ffn,
                            m.vocab,       m.seq,            m.experts,        m.top_k,         m.expert_width(),
                            m.shared_experts, m.expert_groups, m.group_limit, int(m.sigmoid_router)};
  };
  return shape(a) == shape(b);
}

void resolve_batch(RunConfig& rc, int dp) {
  if (dp < 1) config_error("--dp must be >= 1 (got %d)", dp);
  if (rc.batch % dp) config_error("--batch %d is not divisible by --dp %d", rc.batch, dp);
  if (rc.micro_batch == 0) rc.micro_batch = rc.batch / dp;
  if (rc.batch % (dp * rc.micro_batch) == 0) return;
  if (dp == 1) config_error("--batch %d is not divisible by --micro-batch %d", rc.batch, rc.micro_batch);
  config_error("--batch %d is not divisible by dp × micro-batch = %d × %d", rc.batch, dp, rc.micro_batch);
}

double lr_at(const RunConfig& rc, long step) {
  if (step < rc.warmup_steps) return rc.lr * double(step + 1) / double(rc.warmup_steps);
  if (rc.lr_schedule == "constant" || rc.steps <= rc.warmup_steps + 1) return rc.lr;
  double t = double(step - rc.warmup_steps) / double(rc.steps - rc.warmup_steps - 1);
  return rc.min_lr + 0.5 * (rc.lr - rc.min_lr) * (1.0 + std::cos(M_PI * t));
}

// Compares the two curves over the steps still to run rather than the parameters: a constant
// schedule may be extended, and parameters that no remaining step reads do not matter.
void check_resume_schedule(const RunConfig& rc, const Json& trainer, long step) {
  RunConfig rec = rc;
  try {
    if (!trainer.contains("lr_schedule")) {
      if (world_rank() == 0) printf("checkpoint %s records no schedule; using this run's\n", rc.resume_dir.c_str());
      return;
    }
    rec.lr_schedule = trainer.at("lr_schedule").as_string();
    rec.steps = long(trainer.at("steps").as_int());
    rec.lr = trainer.at("lr").as_double();
    rec.warmup_steps = long(trainer.at("warmup_steps").as_int());
    rec.min_lr = trainer.at("min_lr").as_double();
  } catch (const FormatError& e) {
    config_error("checkpoint %s: trainer.json: %s", rc.resume_dir.c_str(), e.what());
  }
  long bent = -1;
  for (long s = step; s < rc.steps && bent < 0; s++)
    if (lr_at(rec, s) != lr_at(rc, s)) bent = s;
  if (bent < 0) return;
  char recorded[256], requested[256];
  auto describe = [](char* buf, const RunConfig& r) {
    snprintf(buf, 256, "--lr-schedule %s --steps %ld --lr %g --warmup-steps %ld --min-lr %g", r.lr_schedule.c_str(),
             r.steps, r.lr, r.warmup_steps, r.min_lr);
  };
  describe(recorded, rec);
  describe(requested, rc);
  char change[160];
  if (bent >= rec.steps)
    snprintf(change, sizeof change, "runs past the end of the recorded schedule (step %ld)", rec.steps);
  else
    snprintf(change, sizeof change, "changes the learning rate from step %ld on (%.4e recorded, %.4e now)", bent,
             lr_at(rec, bent), lr_at(rc, bent));
  if (!rc.reschedule)
    config_error("--resume %s: the checkpoint (step %ld) was trained with\n  %s\nthis run asks for\n  %s\n"
                 "which %s. Pass the recorded flags to continue that schedule, or add --reschedule to follow "
                 "the new one from step %ld.",
                 rc.resume_dir.c_str(), step, recorded, requested, change, step);
  if (world_rank() == 0) printf("--reschedule: this run %s\n  recorded  %s\n  this run  %s\n", change, recorded, requested);
}

}  // namespace ts
