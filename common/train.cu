// train.cu — flags, schedule, AdamW over flat ranges, memory predictions, the step log.
#include "train.h"

#include "checkpoint.h"
#include "comm.h"
#include "data.h"
#include "run.h"
#include "safetensors.h"
#include "threads.h"
#include "trace.h"

#include <cblas.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdarg>

namespace ts {

// ----- flags -------------------------------------------------------------------------------------

Args::Args(int argc, char** argv, std::string doc) : doc_(std::move(doc)) {
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      want_help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) config_error("unexpected argument '%s' (flags start with --; see --help)", a.c_str());
    std::string v;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      v = argv[++i];
    } else {
      v = "\x01";  // a switch with no value
    }
    args_.push_back({a, v});
  }
  load_config();
  used_.assign(args_.size(), false);
  group_ = "run and checkpoint";
  get_str("--config", "", "JSON file of flags ({\"steps\": 100, \"lr-schedule\": \"cosine\"}, _ or -), or a checkpoint's "
          "trainer.json; flags on the command line override it");
  group_ = "";
}

// --config FILE: its flags go before the command line's, so that the command line wins (the last
// occurrence of a flag does). A checkpoint's trainer.json holds them under "flags".
void Args::load_config() {
  for (auto& [flag, value] : args_)
    if (flag == "--config") config_ = value;
  if (config_.empty() || config_ == "\x01") return;
  Json j;
  try {
    j = Json::parse(read_text_file(config_));
    if (j.is_object() && j.contains("flags")) j = j.at("flags");
    if (!j.is_object()) throw FormatError("expected an object of flags");
  } catch (const FormatError& e) {
    config_error("--config %s: %s", config_.c_str(), e.what());
  }
  std::vector<std::pair<std::string, std::string>> from;
  for (auto& [key, v] : j.items()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (flag == "--config") continue;
    if (v.is_bool()) {
      if (v.as_bool()) from.push_back({flag, "\x01"});
    } else if (v.is_string()) {
      from.push_back({flag, v.as_string()});
    } else if (v.is_number()) {
      // JSON's 1e400 parses to inf, which dump() writes as null: the flag's parser names it instead.
      const double d = v.as_double();
      from.push_back({flag, std::isfinite(d) ? v.dump() : d > 0 ? "inf" : "-inf"});
    } else {
      config_error("--config %s: \"%s\" must be a string, a number or true/false", config_.c_str(), key.c_str());
    }
  }
  from_config_ = from.size();
  args_.insert(args_.begin(), from.begin(), from.end());
}

Json Args::effective() const {
  Json j = Json::object();
  for (auto& [flag, v] : effective_)
    if (flag != "--config") j[flag.substr(2)] = v;
  return j;
}

const char* Args::take(const std::string& flag, const std::string& def, const std::string& help, bool sw) {
  help_.push_back({group_, "  " + flag + (sw ? "" : " <" + def + ">") + "\n      " + help});
  declared_.push_back(flag);
  const char* found = nullptr;
  for (size_t i = 0; i < args_.size(); i++)
    if (args_[i].first == flag) {
      used_[i] = true;
      found = args_[i].second.c_str();  // the last occurrence wins
    }
  if (found && !sw && std::string(found) == "\x01") config_error("%s needs a value", flag.c_str());
  if (sw) effective_.push_back({flag, Json(found != nullptr)});
  else effective_.push_back({flag, Json(found ? std::string(found) : def == "\"\"" ? std::string() : def)});
  return found;
}

bool Args::has(const std::string& flag) const {
  for (auto& a : args_)
    if (a.first == flag) return true;
  return false;
}

bool Args::declares(const std::string& flag) const {
  return std::find(declared_.begin(), declared_.end(), flag) != declared_.end();
}

// " in [1, 2147483647]", " in (0, inf)": a range as the messages show it, "" for any number.
static std::string range_text(long double lo, long double hi, const Range& r, bool integer) {
  if (std::isinf(lo) && std::isinf(hi)) return "";
  auto num = [integer](long double v) {
    char b[48];
    if (std::isinf(v)) snprintf(b, sizeof b, "%sinf", v < 0 ? "-" : "");
    else if (integer) snprintf(b, sizeof b, "%.0Lf", v);
    else snprintf(b, sizeof b, "%.10Lg", v);
    return std::string(b);
  };
  const bool lo_open = r.lo_open || std::isinf(lo), hi_open = r.hi_open || std::isinf(hi);  // no number is inf
  return std::string(lo_open ? " in (" : " in [") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
}

// The one parser of numeric flags. Long double holds every 64-bit integer exactly, so a value one
// past a type's limit is refused instead of wrapping. [type_lo, type_hi]: what the type holds.
static long double parse_number(const std::string& flag, const char* s, const Range& r, bool integer,
                                long double type_lo, long double type_hi) {
  const long double lo = std::max<long double>(r.lo, type_lo), hi = std::min<long double>(r.hi, type_hi);
  char* end = nullptr;
  const long double v = strtold(s, &end);
  const bool number = end != s && *end == 0 && std::isfinite(double(v));  // 1e400 is a long double, not a double
  const bool whole = !integer || v == std::floor(v);
  const bool inside = (r.lo_open ? v > lo : v >= lo) && (r.hi_open ? v < hi : v <= hi);
  if (!number || !whole || !inside)
    config_error("%s expects %s%s, got '%s'", flag.c_str(), integer ? "an integer" : "a finite number",
                 range_text(lo, hi, r, integer).c_str(), s);
  return v;
}

long Args::get_long(const std::string& flag, long def, const std::string& help, Range r) {
  const char* v = take(flag, std::to_string(def), help, false);
  return v ? long(parse_number(flag, v, r, true, LONG_MIN, LONG_MAX)) : def;
}
int Args::get_int(const std::string& flag, int def, const std::string& help, Range r) {
  const char* v = take(flag, std::to_string(def), help, false);
  return v ? int(parse_number(flag, v, r, true, INT_MIN, INT_MAX)) : def;
}
double Args::get_double(const std::string& flag, double def, const std::string& help, Range r) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", def);
  const char* v = take(flag, buf, help, false);
  return v ? double(parse_number(flag, v, r, false, -HUGE_VALL, HUGE_VALL)) : def;
}
std::string Args::get_str(const std::string& flag, const std::string& def, const std::string& help) {
  const char* v = take(flag, def.empty() ? "\"\"" : def, help, false);
  return v ? std::string(v) : def;
}
bool Args::get_bool(const std::string& flag, const std::string& help) {
  const char* v = take(flag, "", help, true);
  if (v && std::string(v) != "\x01") config_error("%s is a switch and takes no value (got '%s')", flag.c_str(), v);
  return v != nullptr;
}

// Edits (insert, delete or replace one character) that turn a into b: Levenshtein's distance.
static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// "; did you mean --steps?" when one declared flag is within a few edits of a typo, else "".
static std::string nearest_flag(const std::string& typo, const std::vector<std::string>& declared) {
  std::string best;
  size_t best_d = std::max<size_t>(2, typo.size() / 4) + 1;  // farther than this is another word
  for (const std::string& f : declared)
    if (size_t d = edit_distance(typo, f); d < best_d) best = f, best_d = d;
  return best.empty() ? "" : "; did you mean " + best + "?";
}

std::string Args::group(const std::string& heading) {
  std::string previous = group_;
  group_ = heading;
  return previous;
}

void Args::finish() {
  if (want_help_) {
    if (world_rank() == 0) {
      printf("%s\n\nflags:\n", doc_.c_str());
      // The program's own flags first, then the shared ones, group by group.
      std::vector<std::string> headings = {"", "model", "optimizer", "data", "run and checkpoint", "operations"};
      for (auto& h : help_)
        if (std::find(headings.begin(), headings.end(), h.first) == headings.end()) headings.push_back(h.first);
      for (const std::string& g : headings) {
        if (!g.empty()) printf("\n%s flags:\n", g.c_str());
        for (auto& h : help_)
          if (h.first == g) printf("%s\n", h.second.c_str());
      }
    }
    comm_finalize();
    exit(0);
  }
  for (size_t i = 0; i < args_.size(); i++)
    if (!used_[i])
      config_error("unknown flag %s%s%s (see --help)", args_[i].first.c_str(),
                   i < from_config_ ? (" in --config " + config_).c_str() : "",
                   nearest_flag(args_[i].first, declared_).c_str());
}

// ----- the run configuration -------------------------------------------------------------------

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
  else return false;
  if (name != "tiny" && name != "small" && name != "124m") m.rope_theta = 500000.f;
  return true;
}

const char* recompute_name(Recompute r) {
  return r == Recompute::None ? "none" : r == Recompute::Selective ? "selective" : "full";
}

// The model's shape: a preset, then any flag that overrides it.
static void parse_model_flags(Args& a, RunConfig& rc) {
  a.group("model");
  const char* presets = "tiny, small, 124m, 1b, 3b, 8b, 70b, 80b";  // apply_preset's names, in --help and the error
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
  m.experts = a.get_int("--experts", 0, "mixture of experts: E SwiGLU experts of width --ffn per layer (0: dense MLP)",
                         {-HUGE_VAL, 1 << 16});
  m.top_k = a.get_int("--top-k", 2, "experts per token K (with --experts)", {-HUGE_VAL, 1 << 16});
  m.aux_loss_coef = float(a.get_double("--aux-loss-coef", 0, "weight α of the load-balancing loss E·Σ f_e·P_e (with --experts)"));
  m.capacity_factor = float(a.get_double("--capacity-factor", 0, "tokens per expert and sequence: c·T·K/E (0: dropless)"));
}

// The numbers, the batch and the optimizer.
static void parse_training_flags(Args& a, RunConfig& rc) {
  a.group("operations");
  rc.device = a.get_str("--device", "auto", "auto | cpu | cuda");
  a.group("model");
  std::string dt = a.get_str("--dtype", "fp32", "fp32 | bf16 (bf16 compute, fp32 master weights and gradients)");
  if (dt == "fp32") rc.dtype = DType::F32;
  else if (dt == "bf16") rc.dtype = DType::BF16;
  else config_error("--dtype must be fp32 or bf16 (got '%s')", dt.c_str());
  rc.master_weights = !a.get_bool("--no-master-weights", "bf16: update the bf16 weights directly (the playbook's failure)");
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
  a.group("");  // the program's own flags, declared next, print first
  if (rc.model.experts == 0) rc.model.top_k = 0;
  check_run_config(rc);
  rc.without_steps = rc.eval_every > 0 || a.has("--sample");  // --sample: 01's flag, read after these
  check_resume(rc);
  return rc;
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

// ----- optimizer ---------------------------------------------------------------------------------

AdamW::AdamW(const Model& m, int64_t b, int64_t e, bool master_weights) : begin(b), end(e), dev(m.dev) {
  if (m.dtype != DType::F32 && master_weights) master = Tensor::empty({e - b}, DType::F32, m.dev, Tag::Optimizer);
}

void AdamW::ensure_state() {
  if (m1.defined()) return;
  m1 = Tensor::zeros({end - begin}, DType::F32, dev, Tag::Optimizer);
  m2 = Tensor::zeros({end - begin}, DType::F32, dev, Tag::Optimizer);
}

void AdamW::load_master(const Model&, const Tensor& weights_range) {
  if (master.defined()) convert(master, weights_range);
}

float clip_coefficient(double norm, double clip) {
  if (clip <= 0) return 1.f;
  return float(std::min(1.0, clip / (norm + 1e-6)));
}

double global_mean_loss(double local_sum, double global_tokens, const std::vector<MPI_Comm>& token_groups) {
  double v = local_sum;
  for (MPI_Comm c : token_groups) {
    double all = 0;
    watched_allreduce(&v, &all, 1, MPI_DOUBLE, MPI_SUM, c, "all_reduce (the step's loss)");
    v = all;
  }
  return v / global_tokens;
}

// Copies that do not count are cut out of each range; what remains is summed in pieces as long
// as possible (one piece per range when nothing is replicated: the order 01 uses).
double global_grad_norm(const ParamTable& t, const std::vector<GradRange>& ranges,
                        const std::vector<MPI_Comm>& shard_groups) {
  std::vector<Tensor> pieces;
  for (const GradRange& r : ranges) {
    const int64_t end = r.begin + r.grads.numel();
    int64_t from = r.begin;
    auto piece = [&](int64_t upto) {
      if (upto > from) pieces.push_back(r.grads.view(from - r.begin, {upto - from}));
    };
    t.for_each_overlap(r.begin, end, [&](const ParamEntry& p, int64_t lo, int64_t hi) {
      if (p.counts) return;
      piece(lo);
      from = hi;
    });
    piece(end);
  }
  double sq = 0;
  for (double s : sum_squares_each(pieces)) sq += s;  // in range order: one host sync on CUDA
  for (MPI_Comm c : shard_groups) {
    double all = 0;
    watched_allreduce(&sq, &all, 1, MPI_DOUBLE, MPI_SUM, c, "all_reduce (the gradient norm)");
    sq = all;
  }
  return std::sqrt(sq);
}

// The range may cut through tensors (ZeRO shards): each parameter's intersection with it is
// updated with that parameter's weight-decay rule.
void AdamW::step(const Model& m, const Tensor& w, const Tensor& g, double lr, long t, float clip_coef,
                 const RunConfig& rc) {
  ensure_state();
  TraceScope trace("optimizer");
  AdamWParams p{float(lr), float(rc.beta1), float(rc.beta2), float(rc.eps), float(rc.weight_decay), t};
  m.table.for_each_overlap(begin, end, [&](const ParamEntry& e, int64_t lo, int64_t hi) {
    const int64_t o = lo - begin, n = hi - lo;
    if (master.defined()) {
      adamw_step(master.view(o, {n}), g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef,
                 w.view(o, {n}));
    } else if (w.dtype == DType::F32) {
      adamw_step(w.view(o, {n}), g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef, Tensor());
    } else {
      // --no-master-weights: the update is applied to a widened copy and rounded straight back
      // to bf16, so updates below half a bf16 ulp of the weight are lost (the playbook's failure).
      Tensor tmp = Tensor::empty({n}, DType::F32, m.dev, Tag::Workspace);
      convert(tmp, w.view(o, {n}));
      adamw_step(tmp, g.view(o, {n}), m1.view(o, {n}), m2.view(o, {n}), p, e.decay, clip_coef, w.view(o, {n}));
    }
  });
}

// ----- data --------------------------------------------------------------------------------------

MicroBatch make_microbatch(const TokenData& d, long step, int B, int T, int seq0, int nseq, Device dev) {
  std::vector<int32_t> in(size_t(nseq) * T), tg(size_t(nseq) * T);
  fill_batch(d, step, B, T, seq0, nseq, in.data(), tg.data());
  return {from_host_i32(in, dev), from_host_i32(tg, dev)};
}

// ----- memory predictions ----------------------------------------------------------------------

MemoryPrediction predict_states(int64_t psi, int64_t psi_opt, DType dt, bool master_weights) {
  MemoryPrediction p;
  p.params = double(psi) * dtype_size(dt);
  p.grads = 4.0 * psi;  // fp32 gradients (accumulated in fp32 under bf16 too)
  p.optimizer = 8.0 * psi_opt + (dt != DType::F32 && master_weights ? 4.0 * psi_opt : 0.0);
  return p;
}

MemoryPrediction predict_replica(const RunConfig& rc, int64_t psi) {
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

// Bytes per token of the micro-batch saved by one decoder layer (notes/01 and notes/04 derive
// each term). e = bytes per element of the compute dtype; statistics (two 1/rms, one lse per
// head) are fp32. Tensor parallelism keeps 1/t of the head- and ffn-sized tensors; sequence
// parallelism also keeps 1/t of the norm-region ones (r = 1/t), plain TP all of them (r = 1).
static double layer_saved_per_token(const ModelConfig& c, double e, Recompute rc, double t, double r) {
  const double D = c.dim, KV = c.kv_dim(), F = c.ffn, H = c.heads;
  const double region = r * (4 * D * e + 8);                      // x, h1, x_mid, h2 + rstd1, rstd2
  const double split = ((2 * D + 2 * KV + 3 * F) * e + 4 * H) / t;  // q, y, k, v, g, u, act + lse
  if (c.experts > 0) {  // dropless MoE (moe.h): probs, choices, src per token; per routed row its
    const double E = c.experts, K = c.top_k;  // token, weight, g, u, act, input and output rows
    // Attention is split over tp; the MoE block is replicated (every tp rank routes every token).
    const double moe = ((2 * D + 2 * KV) * e + 4 * H) / t + 4 * E + 8 * K + K * (8 + (3 * F + 2 * D) * e);
    if (rc == Recompute::None) return region + moe;
    if (rc == Recompute::Selective) return region + moe - r * 2 * D * e - K * F * e;
  }
  if (rc == Recompute::None) return region + split;
  if (rc == Recompute::Selective) return region + split - r * 2 * D * e - F * e / t;  // minus h1, h2, act
  return r * D * e;  // full: the layer input only
}

// What the head holds at its peak, per token: final norm input/output and 1/rms, logits [N, V/t].
static double head_saved_per_token(const ModelConfig& c, double e, double t, double r) {
  return r * (2.0 * c.dim * e + 4.0) + c.vocab * e / t;
}

double layer_activation_bytes(const ModelConfig& c, DType dt, Recompute rc, int tp, bool sp) {
  return layer_saved_per_token(c, double(dtype_size(dt)), rc, tp, sp ? 1.0 / tp : 1.0);
}
double head_activation_bytes(const ModelConfig& c, DType dt, int tp, bool sp) {
  return head_saved_per_token(c, double(dtype_size(dt)), tp, sp ? 1.0 / tp : 1.0);
}

// The peak of saved activations is the larger of two moments:
//  A) the end of the forward: every layer's saved set + the head's (final norm in/out, logits);
//  F) the forward of the last layer: L-1 saved sets + that layer's complete set + its output.
double predict_activations(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp, bool sp) {
  const double e = double(dtype_size(dt)), tokens = double(b) * c.seq, t = tp, r = sp ? 1.0 / tp : 1.0;
  const double saved = layer_saved_per_token(c, e, rc, t, r);
  const double all = layer_saved_per_token(c, e, Recompute::None, t, r);
  const double head = head_saved_per_token(c, e, t, r);
  const double A = c.layers * saved + head;
  const double F = (c.layers - 1) * saved + all + r * c.dim * e;
  return tokens * std::max(A, F);
}

// ----- reporting ---------------------------------------------------------------------------------

std::string human_bytes(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::fabs(b) >= 1024 && i < 4) b /= 1024, i++;
  char buf[32];
  snprintf(buf, sizeof buf, i ? "%.2f %s" : "%.0f %s", b, u[i]);
  return buf;
}

std::string device_description(Device dev) {
#ifdef TS_CUDA
  if (dev == Device::CUDA) {
    int d = 0;
    cudaGetDevice(&d);
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, d));
    return p.name;
  }
#endif
  (void)dev;
  return "cpu";
}

// The playbook's peak table (dense, no sparsity) by device name; the CPU has no meaningful
// entry, so MFU there is reported against --peak-tflops only (0 otherwise).
double peak_tflops_for(Device dev, DType dt, double override_tflops) {
  if (override_tflops > 0) return override_tflops;
  std::string n = device_description(dev);
  bool bf = dt == DType::BF16;
  if (n.find("H100") != std::string::npos || n.find("H200") != std::string::npos) return bf ? 989 : 67;
  if (n.find("A100") != std::string::npos) return bf ? 312 : 19.5;
  return 0;
}

RunLog::RunLog(const RunConfig& rc, Device) : rc_(rc), rank0_(world_rank() == 0) {
  check_output_paths(rc);
  every_ = rc.log_every > 0 ? rc.log_every : std::max(1L, (rc.steps + 49) / 50);
  if (rank0_ && !rc.log_json.empty()) {
    json_ = fopen(rc.log_json.c_str(), "w");
    if (!json_) config_error("--log-json %s: cannot open for writing", rc.log_json.c_str());
  }
}

RunLog::~RunLog() {
  if (json_) fclose(json_);
}

void RunLog::line(const char* fmt, ...) {
  if (!rank0_) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n");
  fflush(stdout);
}

// "45s", "3m05s", "2h07m"
static std::string short_duration(double s) {
  char buf[32];
  const long t = std::lround(s);
  if (t < 60) snprintf(buf, sizeof buf, "%lds", t);
  else if (t < 3600) snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, t % 3600 / 60);
  return buf;
}

bool RunLog::line_due(long step, std::chrono::steady_clock::time_point now) const {
  if (rc_.quiet) return std::chrono::duration<double>(now - last_line_).count() >= rc_.progress_seconds;
  return step == first_ || step + 1 == rc_.steps || step % every_ == 0;
}

// " | eval 2.345678" on the steps that evaluated.
static std::string eval_field(double eval_loss) {
  if (!std::isfinite(eval_loss)) return "";
  char buf[32];
  snprintf(buf, sizeof buf, " | eval %.6f", eval_loss);
  return buf;
}

void RunLog::step(const StepRecord& r) {
  if (!rank0_) return;
  const auto now = std::chrono::steady_clock::now();
  if (first_ < 0) {
    first_ = r.step;
    start_ = last_line_ = now - std::chrono::microseconds(std::llround(r.step_ms * 1e3));
  }
  if (line_due(r.step, now) || std::isfinite(r.eval_loss)) {  // an evaluation is always shown
    // The mean wall time per step of this run so far, saves and logging included.
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const long done = r.step + 1 - first_, left = rc_.steps - r.step - 1;
    const std::string eta = left > 0 ? "ETA " + short_duration(elapsed / double(done) * double(left))
                                     : "took " + short_duration(elapsed);
    const int width = int(std::to_string(rc_.steps).size());
    // MFU needs a peak (known GPUs, or --peak-tflops); without one the achieved rate says more than 0.00%.
    char rate[32];
    if (r.mfu > 0) snprintf(rate, sizeof rate, "MFU %5.2f%%", 100 * r.mfu);
    else snprintf(rate, sizeof rate, "%6.2f GFLOP/s", r.flops_per_s * 1e-9);
    printf("step %*ld/%ld | loss %.6f%s | lr %.3e | grad norm %.4f | %8.0f tok/s | %s | %7.1f ms | peak %s%s | %s\n",
           width, r.step, rc_.steps, r.loss, eval_field(r.eval_loss).c_str(), r.lr, r.grad_norm, r.tokens_per_s, rate,
           r.step_ms, human_bytes(double(r.peak_mem_bytes)).c_str(), r.note.c_str(), eta.c_str());
    fflush(stdout);
    last_line_ = now;
  }
  if (json_) {
    Json j = Json::object();
    j["step"] = r.step;
    j["loss"] = r.loss;
    if (std::isfinite(r.eval_loss)) j["eval_loss"] = r.eval_loss;
    j["lr"] = r.lr;
    j["grad_norm"] = r.grad_norm;
    j["tokens_per_s"] = r.tokens_per_s;
    j["mfu"] = r.mfu;
    j["flops_per_s"] = r.flops_per_s;
    j["step_ms"] = r.step_ms;
    j["peak_mem_bytes"] = int64_t(r.peak_mem_bytes);
    if (r.extra.is_object())
      for (const auto& [k, v] : r.extra.items()) j[k] = v;
    fprintf(json_, "%s\n", j.dump().c_str());
    fflush(json_);
  }
}

void RunLog::summary(Json s) {
  if (!rank0_ || !json_) return;
  Json j = Json::object();
  j["summary"] = std::move(s);
  fprintf(json_, "%s\n", j.dump().c_str());
  fflush(json_);
}

Json comm_report(RunLog& log, const Comm& group, long steps, const std::map<std::string, double>& predicted) {
  Json ops = Json::object();
  const double n = double(std::max(1L, steps));
  for (auto& [op, s] : group.stats()) {
    Json o = Json::object();
    o["calls"] = double(s.calls) / n;
    o["bytes"] = s.wire_bytes / n;
    o["payload_bytes"] = s.payload_bytes / n;
    const double p = predicted.count(op) ? predicted.at(op) : 0.0;
    o["predicted"] = p;
    log.line("comm %-6s %-14s per step: %6.1f calls, %12s sent per rank, predicted %12s", group.name().c_str(),
             op.c_str(), double(s.calls) / n, human_bytes(s.wire_bytes / n).c_str(), human_bytes(p).c_str());
    ops[op] = std::move(o);
  }
  Json c = Json::object();
  c[group.name()] = std::move(ops);
  return c;
}

Json memory_report(RunLog& log, Device dev, const MemoryPrediction& pred) {
  const MemStats& s = mem_stats(dev);
  const double predicted[kNumTags] = {pred.params, pred.grads, pred.optimizer, pred.activations, -1, -1};
  Json mem = Json::object();
  log.line("memory (rank 0, peak per category)   measured        predicted   measured/predicted");
  for (int t = 0; t < kNumTags; t++) {
    Json c = Json::object();
    c["measured"] = int64_t(s.peak[t]);
    if (predicted[t] >= 0) {
      c["predicted"] = int64_t(std::llround(predicted[t]));
      log.line("  %-12s %22s %16s   %.4f", tag_name(Tag(t)), human_bytes(double(s.peak[t])).c_str(),
               human_bytes(predicted[t]).c_str(), predicted[t] > 0 ? double(s.peak[t]) / predicted[t] : 0.0);
    } else {
      log.line("  %-12s %22s", tag_name(Tag(t)), human_bytes(double(s.peak[t])).c_str());
    }
    mem[tag_name(Tag(t))] = std::move(c);
  }
  if (pred.comm_holds.empty()) {
    log.line("  (no prediction for comm: host staging of CUDA tensors sent over MPI when ranks share a GPU; nor for workspace:");
  } else {
    log.line("  (no prediction for comm: %s,", pred.comm_holds.c_str());
    log.line("   and host staging of CUDA tensors sent over MPI when ranks share a GPU; nor for workspace:");
  }
  log.line("   scratch freed within one call, chiefly the fp32 weight copy at init, resume and save, and kernel temporaries)");
  log.line("  %-12s %22s", "total peak", human_bytes(double(s.total_peak)).c_str());
  log.line("  %-12s %22s   (allocator, incl. cached free blocks)", "reserved",
           human_bytes(double(s.reserved_peak)).c_str());
  mem["total_peak"] = int64_t(s.total_peak);
  mem["reserved_peak"] = int64_t(s.reserved_peak);
  return mem;
}

// ----- the shared start ----------------------------------------------------------------------------

Program::Program(int argc, char** argv, const char* doc, const std::function<void(Args&, RunConfig&, MeshConfig&)>& own) {
  comm_init(&argc, &argv);
  Args args(argc, argv, doc);
  rc = parse_run_config(args);
  set_comm_timeout(rc.timeout);  // the watchdog's deadline, before any collective
  rc.program = argc > 0 ? std::string(argv[0]).substr(std::string(argv[0]).find_last_of('/') + 1) : "";
  own(args, rc, mc);
  args.finish();
  rc.flags = args.effective();
  if (!rc.dry_run) check_launch(args, mc);
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
             m.experts, m.ffn, m.top_k, double(m.capacity_factor), m.capacity_factor > 0 ? "" : " (dropless)",
             double(m.aux_loss_coef), (flops_per_token(m) - 12.0 * m.layers * m.dim * double(m.seq)) / 6e6);
}

// ----- the shared loop ---------------------------------------------------------------------------

TokenData open_data(const RunConfig& rc, Device dev, RunLog& log) {
  const ThreadChoice threads = setup_threads(rc.threads, int64_t(rc.micro_batch) * rc.model.seq, rc.model.dim);
  log.line("threads: %s%s", describe(threads).c_str(),
           dev == Device::CPU ? ("; " + sgemm_core_note()).c_str() : "");
  if (const std::string w = sgemm_core_warning(); dev == Device::CPU && !w.empty() && world_rank() == 0)
    fprintf(stderr, "%s\n", w.c_str());
  TokenData data = load_data(rc.data, rc.model.vocab, rc.seed, rc.model.seq + 2);
  log.line("device: %s | data: %s", device_description(dev).c_str(), data.description.c_str());
  if (std::isfinite(data.entropy_floor))
    log.line("loss floor (entropy rate of the source): %.4f nats/token; ln(vocab) = %.4f", data.entropy_floor,
             std::log(double(rc.model.vocab)));
  return data;
}

long init_or_resume(const Model& model, AdamW& opt, const RunConfig& rc, int64_t b, int64_t e, const Tensor& weights) {
  Tensor w32 = Tensor::empty({e - b}, DType::F32, model.dev, Tag::Workspace);
  long step = 0;
  if (rc.resume_dir.empty()) {
    Model::init_range(model.table, rc.seed, b, e, w32);
  } else {
    opt.ensure_state();
    step = load_checkpoint(rc.resume_dir, rc.model, model.table, b, e, w32, &opt).step;
  }
  convert(weights, w32);  // a copy in fp32, a rounding to bf16 otherwise
  opt.load_master(model, w32);
  return step;
}

Tensor weights_f32(const Tensor& weights, const AdamW& opt) {
  if (opt.master.defined()) return opt.master;
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
      MicroBatch b = make_microbatch(held_out, k, rc.batch, T, seq0 + s0, mb, model.dev);
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

void train_loop(const RunConfig& rc, Device dev, RunLog& log, const TokenData& data, long first, Loop& loop) {
  check_eval_available(rc, loop);
  // tokens/s is the whole job's (the global batch per step) and the peak is one device's: MFU is
  // per device, so the job's FLOP rate is measured against the peak of all its devices.
  int world = 1;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  const double peak = world * peak_tflops_for(dev, rc.dtype, rc.peak_tflops) * 1e12;
  const double tokens = double(rc.batch) * rc.model.seq;
  std::vector<double> seconds;  // each step's wall time
  double last_loss = NAN;
  if (!rc.trace.empty()) Trace::get().enable();
  ProfileScope::reset();
  catch_stop_signals();
  long done = first, saved = -1, evaluated = -1;
  double last_eval = NAN;
  int stop = 0;
  for (long step = first; step < rc.steps && !stop; step++) {
    set_current_step(step);
    auto t0 = std::chrono::steady_clock::now();
    StepResult r = loop.step(step);
    device_sync(dev);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(r.loss)) fatal("loss is %f at step %ld: the run diverged (try a lower --lr)", r.loss, step);
    seconds.push_back(secs);
    last_loss = r.loss;
    done = step + 1;
    // After the update, outside the step's time: the loss of the weights this step produced.
    const bool eval_due = rc.eval_every > 0 && (done % rc.eval_every == 0 || done == rc.steps);
    if (eval_due) last_eval = loop.eval(), evaluated = done;
    log.step({step, r.loss, lr_at(rc, step), r.grad_norm, tokens / secs,
              peak > 0 ? flops_per_token(rc.model) * tokens / secs / peak : 0.0, secs * 1e3, mem_stats(dev).total_peak,
              r.extra, r.note, flops_per_token(rc.model) * tokens / secs, eval_due ? last_eval : NAN});
    if (!rc.save_dir.empty() && rc.save_every > 0 && done % rc.save_every == 0 && done < rc.steps) {
      loop.save(done);
      saved = done;
    }
    stop = agreed_stop_signal();
  }
  set_current_step(-1);
  // No step ran (a --resume at its own step: evaluating a checkpoint), or a signal stopped the run.
  if (rc.eval_every > 0 && evaluated != done) {
    last_eval = loop.eval();
    log.line("eval loss %.6f after step %ld (held-out data)", last_eval, done);
  }
  if (!rc.save_dir.empty() && saved != done) loop.save(done);
  const char* stop_name = stop == SIGINT ? "SIGINT" : "SIGTERM";
  if (stop) {
    log.line("%s: stopped after %ld of %ld steps; %s", stop_name, done, rc.steps,
             rc.save_dir.empty() ? "no --save, so nothing to resume from"
                                 : ("resume with --resume " + rc.save_dir).c_str());
  }

  Json summary = Json::object();
  summary["memory"] = memory_report(log, dev, loop.predicted);
  summary["comm"] = loop.comm ? loop.comm(done - first) : Json::object();
  summary["final_loss"] = last_loss;
  summary["steps_done"] = done;
  if (stop) summary["stopped_by"] = stop_name;
  summary["loss_floor"] = data.entropy_floor;
  if (rc.eval_every > 0) summary["eval_loss"] = last_eval;
  if (!seconds.empty()) {
    std::vector<double> tps;
    for (double s : seconds) tps.push_back(tokens / s);
    std::sort(tps.begin(), tps.end());
    summary["tokens_per_s_median"] = tps[tps.size() / 2];
    char eval[48] = "";
    if (rc.eval_every > 0) snprintf(eval, sizeof eval, "; eval loss %.4f", last_eval);
    log.line("median %.0f tokens/s over %zu steps; final loss %.4f (floor %.4f)%s", tps[tps.size() / 2], tps.size(),
             last_loss, data.entropy_floor, eval);
  }
  if (loop.step_time && !seconds.empty()) summary["step_time"] = loop.step_time(step_times(first, seconds));
  if (loop.extra) loop.extra(summary);
  log.summary(summary);
  if (!rc.trace.empty()) Trace::get().write(rc.trace);
  ProfileScope::print();
}

}  // namespace ts
