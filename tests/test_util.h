// test_util.h — running the technique binaries from tests and reading what they report.
//
// End-to-end tests start the real binaries (under mpirun for several ranks), read their
// --log-json output and compare numbers; error-path tests assert the exit status and message.
#pragma once
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tensor/rng.h"
#include "formats/json.h"
#include "formats/safetensors.h"

namespace tst {

// A fresh directory under /tmp, removed with everything in it when the test ends.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/ts_test_XXXXXX";
    if (!mkdtemp(tmpl)) abort();
    path = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

inline std::string build_dir() {
  const char* b = getenv("TS_BUILD");
  return b ? b : "build";
}

// A scratch directory unique to this process; catch_main.cpp removes it when every case has passed.
inline std::string scratch(const std::string& name) {
  std::string d = "/tmp/ts_test_" + std::to_string(getpid());
  std::filesystem::create_directories(d);  // throws, and so fails the test, if it cannot
  return d + "/" + name;
}

struct Result {
  int status = -1;  // exit status (128 + signal when killed)
  std::string output;  // stdout and stderr together
};

// Runs a shell command, bounded by `timeout` seconds so that a hang fails instead of blocking.
inline Result run(const std::string& cmd, int timeout_s = 300) {
  std::string full = "OMP_NUM_THREADS=1 timeout " + std::to_string(timeout_s) + " " + cmd + " 2>&1";
  Result r;
  FILE* p = popen(full.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// run() pins every binary to one OpenMP thread; pass this as run_bin's extra_env to let the binary
// choose its threads itself, as it does for a user.
inline const std::string kOwnThreads = "-u OMP_NUM_THREADS";

// The command line for `np` ranks of a technique binary (np 1 runs it directly). Technique runs
// default to the CPU even where a GPU is visible: the equivalence tests prove the techniques on
// the CPU reference, and the [cuda] cases compare CUDA with it explicitly (--device cuda).
inline std::string bin_command(const std::string& bin, const std::string& args, int np = 1,
                               const std::string& extra_env = "") {
  std::string exe = build_dir() + "/" + bin;
  const std::string name = bin.substr(bin.rfind('/') + 1);  // a seeded bug's variant: tests/bugs/02_...+BUG
  const bool technique = name.size() > 1 && name[0] == '0';
  const std::string dev = technique && args.find("--device") == std::string::npos ? " --device cpu" : "";
  // Tests run inside an MPI job themselves; a child job must not inherit its PMI connection.
  std::string env = "env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u PMI_PORT -u PMI_ID -u PMI_HOSTNAME -u MPI_LOCALRANKID "
                    "-u MPI_LOCALNRANKS -u PMIX_RANK -u PMI_SPAWNED -u PMI_APPNUM " + extra_env + " ";
  if (np == 1) return env + exe + " " + args + dev;
  return env + "mpirun -np " + std::to_string(np) + " " + exe + " " + args + dev;
}

inline Result run_bin(const std::string& bin, const std::string& args, int np = 1, int timeout_s = 300,
                      const std::string& extra_env = "") {
  return run(bin_command(bin, args, np, extra_env), timeout_s);
}

// The JSON lines of a --log-json file: per-step records and events, then {"summary": ...}.
struct Log {
  std::vector<ts::Json> steps;
  std::vector<ts::Json> events;  // {"event": "spike" | "rewind" | "non_finite", "step": ...}
  ts::Json summary;
  std::vector<double> losses() const {
    std::vector<double> v;
    for (auto& s : steps) v.push_back(s.at("loss").as_double());
    return v;
  }
};

inline Log read_log(const std::string& path) {
  Log l;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    ts::Json j = ts::Json::parse(line);
    if (j.contains("summary")) l.summary = j.at("summary");
    else if (j.contains("event")) l.events.push_back(j);
    else l.steps.push_back(j);
  }
  return l;
}

inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); i++)
    m = std::max(m, std::fabs(a[i] - b[i]) / std::max(1e-30, std::fabs(b[i])));
  return m;
}

// Every tensor of a safetensors file, as floats.
inline std::vector<std::pair<std::string, std::vector<float>>> read_tensors(const std::string& path) {
  ts::SafetensorsReader r(path);
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const std::string& n : r.names()) {
    std::vector<float> v(size_t(r.entry(n).numel()));
    r.read(n, 0, v.data(), int64_t(v.size()));
    out.push_back({n, v});
  }
  return out;
}

// Largest |a − b| over every element of two checkpoint files (INFINITY when their tensors differ
// in names or sizes): for runs that must agree bit for bit, or nearly.
inline double max_abs_diff_files(const std::string& a, const std::string& b) {
  auto ta = read_tensors(a), tb = read_tensors(b);
  if (ta.size() != tb.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < ta.size(); i++) {
    if (ta[i].first != tb[i].first || ta[i].second.size() != tb[i].second.size()) return INFINITY;
    for (size_t k = 0; k < ta[i].second.size(); k++)
      m = std::max(m, double(std::fabs(ta[i].second[k] - tb[i].second[k])));
  }
  return m;
}

// "--steps S --batch B --micro-batch M": the same global batch run in micro-batches of M.
inline std::string steps_args(int steps, int batch, int micro) {
  return "--steps " + std::to_string(steps) + " --batch " + std::to_string(batch) + " --micro-batch " +
         std::to_string(micro);
}

// ----- shared end-to-end pieces (need Catch2's macros: include after catch.hpp) -----------------

// A run of a technique binary with --log-json and a checkpoint after every step (--save-every 1
// --keep-last), so that the first step's gradients can be read from its optimizer state; runs are
// cached by their command line, because several test cases read the same run.
struct CachedRun {
  Log log;
  std::string output;
  std::string ckpt;   // the checkpoint after the last step
  std::string first;  // the checkpoint after step 1
};
inline std::string step_checkpoint(const std::string& root, long step) {
  char name[32];
  snprintf(name, sizeof name, "/step_%06ld", step);
  return root + name;
}
inline const CachedRun& cached_run(const std::string& bin, int np, const std::string& args, int timeout_s = 180,
                                   const std::string& extra_env = "") {
  static std::map<std::string, CachedRun> cache;
  const std::string key = extra_env + " " + bin + " " + std::to_string(np) + " " + args;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const std::string tag = "run" + std::to_string(cache.size());
  CachedRun r;
  const std::string root = scratch(tag + "_ck"), log = scratch(tag + ".jsonl");
  Result res = run_bin(bin, args + " --save " + root + " --save-every 1 --keep-last 1000 --log-json " + log, np, timeout_s,
                       extra_env);
  INFO(key << "\n" << res.output);
  REQUIRE(res.status == 0);
  r.output = res.output;
  r.log = read_log(log);
  REQUIRE(r.log.steps.size() > 0);
  r.ckpt = step_checkpoint(root, long(r.log.steps.back().at("step").as_double()) + 1);
  r.first = step_checkpoint(root, long(r.log.steps.front().at("step").as_double()) + 1);
  return cache[key] = r;
}

// Bad input: each case exits non-zero on every rank without hanging (124 is the timeout) and
// prints an error containing `message`.
struct ErrorCase {
  int np;
  std::string args, message;
};
inline void check_errors(const std::string& bin, const std::string& prefix, const std::vector<ErrorCase>& cases) {
  for (const ErrorCase& c : cases) {
    Result r = run_bin(bin, prefix + c.args, c.np, 60);
    INFO("mpirun -np " << c.np << " " << bin << " " << c.args << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.status != 124);
    CHECK(r.output.find(c.message) != std::string::npos);
    CHECK(r.output.find("error") != std::string::npos);
  }
}

// ----- what "equal to 01" means -----------------------------------------------------------------
//
// One criterion for every technique, derived in notes/00_architecture.md ("What equal to 01
// means"). A technique reorders fp32 sums (split matmuls, ring reductions, other BLAS blockings),
// so it cannot reproduce 01 bit for bit; it must reproduce it to within what reordering can do:
//  * losses: the forward pass only reorders sums, so each step's loss agrees to a relative bound;
//  * step 1's gradients, per tensor and normwise, read from the optimizer state after step 1
//    (exp_avg = (1 − β1)·clip·g): computed from identical weights, before AdamW can amplify
//    anything;
//  * the final weights, normwise against the whole update: ‖w − w01‖ / ‖w01 − w0‖. AdamW divides
//    each gradient element by its own RMS, so an element whose gradient is at rounding level
//    moves by up to ~lr whatever its sign; such elements are rare, so the whole difference stays
//    a small fraction of the whole update;
//  * every element within AdamW's per-step bound (adam_step_bound), summed over the run's steps.
namespace equiv {
// fp32 unit roundoff, 2^-24.
constexpr double kU = 5.9604644775390625e-8;
// √n for the longest sum a test model reduces in one piece: the 256-entry vocabulary softmax, and
// a weight gradient over a micro-batch's tokens (≤ 8 sequences × 32 = 256). In the probabilistic
// model of rounding (Higham and Mary 2019) reordering a sum of n terms moves it by ≲ √n·u relative.
constexpr double kSqrtN = 16;
// Reductions along the forward pass of a test model (≤ 4 layers): per layer the two norms,
// q/k/v, scores, softmax, values, o, gate/up and down (10), plus the final norm and the head's
// logits and softmax: ≤ 43. Independent rounding errors add in quadrature: √43 < 6.6.
constexpr double kSqrtStages = 6.6;
// Each step's loss: √43 · 16 · u = 6.3e-6 relative.
constexpr double kLossRel = kSqrtStages * kSqrtN * kU;
// Gradients (step 1's per tensor, normwise; every step's norm): the backward runs the chain twice
// more (input and weight gradients), so √3 × the loss bound: 1.1e-5.
constexpr double kGradRel = 1.7320508075688772 * kLossRel;
// Final weights, ‖w − w01‖ / ‖w01 − w0‖: AdamW's update of an element is ≈ lr·sign(g) early on,
// so reordering changes it only where |g_i| is below its rounding error, a fraction ≈ 2·p(0)·δ of
// the elements for a relative error δ and a density p(0) ≤ 0.4 at zero (in units of the
// gradient's RMS; Gaussian or flatter). Each such element moves at most twice its share of the
// whole update: ratio ≤ 2·√(0.8·δ) with δ = kGradRel: 5.9e-3.
inline const double kUpdateRel = 2 * std::sqrt(0.8 * kGradRel);
}  // namespace equiv

// AdamW's largest possible update of one element at step t (1-based), in units of lr: with bias
// correction, |m̂_t| / √v̂_t ≤ (1−β1)/(1−β1^t) · √((1−β2^t)/(1−β2)) · √(Σ_{j<t} (β1²/β2)^j) by
// Cauchy–Schwarz over the gradient history (1 at t = 1: the update is lr·sign(g)). ε and the
// decoupled weight decay (which shrinks differences by (1 − lr·wd)) only make it smaller.
inline double adam_step_bound(double beta1, double beta2, int t) {
  double sum = 0;
  for (int j = 0; j < t; j++) sum += std::pow(beta1 * beta1 / beta2, j);
  return (1 - beta1) / (1 - std::pow(beta1, t)) * std::sqrt((1 - std::pow(beta2, t)) / (1 - beta2)) * std::sqrt(sum);
}

// The weights a run starts from: a pure function of (seed, name, index), as the model draws them
// (matrices N(0, 0.02), norm weights 1).
inline std::vector<float> initial_weights(const std::string& name, size_t n, uint64_t seed) {
  std::vector<float> w(n, 1.f);
  if (name.find("norm") != std::string::npos) return w;
  const uint64_t key = ts::rng_key(seed, name);
  for (size_t i = 0; i < n; i++) w[i] = 0.02f * ts::rng_normal(key, i);
  return w;
}

inline double norm2(const std::vector<float>& a, const std::vector<float>* b = nullptr) {
  double s = 0;
  for (size_t i = 0; i < a.size(); i++) {
    const double d = double(a[i]) - (b ? double((*b)[i]) : 0.0);
    s += d * d;
  }
  return s;
}

// How far a run is from the reference on each measure of the criterion.
struct Equivalence {
  double loss_rel = 0;       // max over steps of |L − L01| / L01
  double norm_rel = 0;       // max over steps of |‖g‖ − ‖g01‖| / ‖g01‖ (before clipping)
  double grad_rel = 0;       // max over tensors of ‖g − g01‖ / ‖g01‖ at step 1
  std::string grad_worst;    // ... and the tensor where it is largest
  double update_rel = 0;     // ‖w − w01‖ / ‖w01 − w0‖ over every tensor
  double max_abs = 0;        // max |w − w01| over every element
  double cap = 0;            // AdamW's bound on max_abs for this run's steps and learning rates
};

inline std::string flag_of(const ts::Json& trainer, const char* name) { return trainer.at("flags").at(name).as_string(); }

// `whole` is the reference run from its first step (for the cap, which sums AdamW's bound over
// every step the weights took); it differs from `ref` only for a resumed run.
inline Equivalence compare(const CachedRun& r, const CachedRun& ref, const CachedRun& whole) {
  Equivalence e;
  const std::vector<double> l = r.log.losses(), l01 = ref.log.losses();
  e.loss_rel = max_rel_diff(l, l01);
  const ts::Json trainer = ts::Json::parse(ts::read_text_file(ref.ckpt + "/trainer.json"));
  const double beta1 = std::stod(flag_of(trainer, "beta1")), beta2 = std::stod(flag_of(trainer, "beta2"));
  const uint64_t seed = uint64_t(trainer.at("seed").as_double());
  for (size_t t = 0; t < whole.log.steps.size(); t++)
    e.cap += 2 * whole.log.steps[t].at("lr").as_double() * adam_step_bound(beta1, beta2, int(t) + 1);
  // Gradient norms before clipping, every step: AdamW and clipping are blind to a constant
  // gradient scale (a sum where a mean belongs), the norm is not.
  std::vector<double> n, n01;
  for (auto& s : r.log.steps) n.push_back(s.at("grad_norm").as_double());
  for (auto& s : ref.log.steps) n01.push_back(s.at("grad_norm").as_double());
  e.norm_rel = max_rel_diff(n, n01);
  // Step 1's gradients: exp_avg after step 1 is (1 − β1)·c·g with c the clipping coefficient
  // min(1, clip/‖g‖); g = exp_avg / c up to the common factor (1 − β1).
  std::vector<std::pair<std::string, std::vector<float>>> m, m01;
  if (!r.first.empty()) m = read_tensors(r.first + "/optimizer.safetensors");
  if (!ref.first.empty()) m01 = read_tensors(ref.first + "/optimizer.safetensors");
  if (m.size() != m01.size()) e.grad_rel = INFINITY;
  const double clip = std::stod(flag_of(trainer, "clip"));
  auto unclip = [&](std::vector<float>& v, double norm) {
    if (clip > 0 && norm > clip)
      for (float& x : v) x = float(double(x) * norm / clip);
  };
  for (size_t i = 0; i < m.size() && i < m01.size(); i++) {
    if (m[i].first.rfind("exp_avg.", 0) != 0) continue;
    if (m[i].first != m01[i].first || m[i].second.size() != m01[i].second.size()) {
      e.grad_rel = INFINITY;
      continue;
    }
    unclip(m[i].second, n.at(0));
    unclip(m01[i].second, n01.at(0));
    const double d = std::sqrt(norm2(m[i].second, &m01[i].second) / std::max(1e-300, norm2(m01[i].second)));
    if (d > e.grad_rel || std::isnan(d)) e.grad_rel = d, e.grad_worst = m[i].first;
  }
  // The final weights against the whole update.
  auto w = read_tensors(r.ckpt + "/model.safetensors"), w01 = read_tensors(ref.ckpt + "/model.safetensors");
  double diff = 0, update = 0;
  if (w.size() != w01.size()) diff = INFINITY;
  for (size_t i = 0; i < w.size() && i < w01.size(); i++) {
    if (w[i].first != w01[i].first || w[i].second.size() != w01[i].second.size()) {
      diff = INFINITY;
      continue;
    }
    const std::vector<float> w0 = initial_weights(w01[i].first, w01[i].second.size(), seed);
    diff += norm2(w[i].second, &w01[i].second);
    update += norm2(w01[i].second, &w0);
    for (size_t k = 0; k < w[i].second.size(); k++)
      e.max_abs = std::max(e.max_abs, double(std::fabs(w[i].second[k] - w01[i].second[k])));
  }
  e.update_rel = std::sqrt(diff / std::max(1e-300, update));
  return e;
}

inline std::ostream& operator<<(std::ostream& o, const Equivalence& e) {
  return o << "loss rel " << e.loss_rel << " (bound " << equiv::kLossRel << "), grad norm rel " << e.norm_rel
           << " (bound " << equiv::kGradRel << "), step-1 grad rel " << e.grad_rel << " at "
           << e.grad_worst << " (bound " << equiv::kGradRel << "), ‖w − w01‖/‖w01 − w0‖ " << e.update_rel << " (bound "
           << equiv::kUpdateRel << "), max |Δw| " << e.max_abs << " (AdamW cap " << e.cap << ")";
}

// Whether the run reproduces the reference (a 01 run of the same global batch): every measure
// within its bound, the same number of steps.
inline Equivalence compare(const CachedRun& r, const CachedRun& ref) { return compare(r, ref, ref); }
inline bool equivalent(const Equivalence& e) {
  return e.loss_rel <= equiv::kLossRel && e.norm_rel <= equiv::kGradRel && e.grad_rel <= equiv::kGradRel && e.update_rel <= equiv::kUpdateRel &&
         e.max_abs <= e.cap;
}
// With TS_EQUIV_REPORT=FILE every comparison appends its measures to FILE, one line each (how
// notes/00_architecture.md's table of measured values is made).
inline void report(const Equivalence& e) {
  if (const char* f = getenv("TS_EQUIV_REPORT")) {
    std::ofstream o(f, std::ios::app);
    o << e.loss_rel << " " << e.norm_rel << " " << e.grad_rel << " " << e.update_rel << " " << e.max_abs << " " << e.cap
      << "\n";
  }
}
// The bounds a comparison is held to: fp32's here, bf16's and FP8's with the same four measures
// (below, test_fp8_mesh.cpp). Every element is held to AdamW's cap, which Equivalence carries.
struct Bounds {
  double loss, norm, grad, update;
};
inline const Bounds kFp32Bounds{equiv::kLossRel, equiv::kGradRel, equiv::kGradRel, equiv::kUpdateRel};

inline void check_within(const Equivalence& e, const Bounds& b) {
  INFO("bounds: loss " << b.loss << ", gradient norms " << b.norm << ", step-1 gradients " << b.grad << ", weights "
                       << b.update);
  CHECK(e.loss_rel <= b.loss);
  CHECK(e.norm_rel <= b.norm);
  CHECK(e.grad_rel <= b.grad);
  CHECK(e.update_rel <= b.update);
  CHECK(e.max_abs <= e.cap);
}

// How far past its bound the worst measure is: over 1 fails.
inline double worst_ratio(const Equivalence& e, const Bounds& b = kFp32Bounds) {
  return std::max({e.loss_rel / b.loss, e.norm_rel / b.norm, e.grad_rel / b.grad, e.update_rel / b.update,
                   e.max_abs / e.cap});
}

inline void check_equivalent(const CachedRun& r, const CachedRun& ref, const Bounds& b = kFp32Bounds) {
  REQUIRE(r.log.steps.size() == ref.log.steps.size());
  const Equivalence e = compare(r, ref);
  report(e);
  INFO(e);
  check_within(e, b);
}

// ----- what "equal to 01" means in bf16 (notes/00_architecture.md, "... under bf16") -----------
//
// bf16 weights and activations round to 8 significant bits (u = 2^-8). Where a technique sums in
// another order before a value is rounded, the value crosses a rounding boundary now and then, and
// from there the two runs round it independently: two independent roundings differ by RMS
// sqrt(2/3)·u relative. The fp32 criterion's chain then applies with that in place of a reordered
// sum's sqrt(n)·u: up to 43 such stages along the forward add in quadrature, the backward runs the
// chain twice more. The FP8 criterion (test_fp8_mesh.cpp) starts from the same per-rounding term.
namespace equiv {
// Two independently rounded operands with unit roundoffs u_a, u_b: a product differs by
// sqrt(2/3)·sqrt(u_a² + u_b²) relative, normwise.
inline double gemm_rel(double ua, double ub) { return std::sqrt(2.0 / 3.0) * std::sqrt(ua * ua + ub * ub); }
constexpr double kUbf16 = 1.0 / 256;
// A forward's value: sqrt(43) stages × sqrt(2/3)·u = 0.021.
inline const double kBf16ForwardRel = kSqrtStages * std::sqrt(2.0 / 3.0) * kUbf16;
// A step's loss averages `tokens` tokens' losses, each moved independently: 1.3e-3 at 256 tokens.
inline double bf16_loss_rel(int tokens) { return kBf16ForwardRel / std::sqrt(double(tokens)); }
// Gradients (step 1's per tensor, and every step's norm): sqrt(3) × the forward's, 0.036.
inline const double kBf16GradRel = 1.7320508075688772 * kBf16ForwardRel;
// Weights: the fp32 criterion's 2·sqrt(0.8·δ) with the gradient bound as δ, 0.34.
inline const double kBf16UpdateRel = 2 * std::sqrt(0.8 * kBf16GradRel);
}  // namespace equiv

// The bf16 bounds for steps of `tokens` tokens, which a bf16 run is held to against 01's bf16 run
// (check_equivalent(r, ref, bf16_bounds(tokens))). Even dp, whose samples each take 01's path,
// rounds in other places: a GEMM library may block a sum differently for a smaller micro-batch
// (OpenBLAS's Cooperlake sgemm under TS_BF16_GEMM=widen does), and one crossed boundary is enough.
inline Bounds bf16_bounds(int tokens) {
  return {equiv::bf16_loss_rel(tokens), equiv::kBf16GradRel, equiv::kBf16GradRel, equiv::kBf16UpdateRel};
}

// ----- the FP8 bounds (notes/00_architecture.md, "What equal to 01 means under FP8") -------------
// u: a format's unit roundoff, half its relative spacing: e4m3 2^-4, e5m2 2^-3. A run that
// reorders a sum moves an operand's codes by at most one step; after a few quantizations in
// sequence the two runs' rounding errors are independent (δ → sqrt(δ·u) per quantization), so
// each operand differs as two independent roundings do: RMS sqrt(2/3)·u relative.
namespace equiv {
constexpr double kU4 = 1.0 / 16, kU5 = 1.0 / 8;
// Weight gradients: dy in e5m2 (tensorwise, delayed) or e4m3 (blockwise), x in e4m3.
inline double fp8_grad_rel(const std::string& recipe) { return gemm_rel(recipe == "blockwise" ? kU4 : kU5, kU4); }
// The loss: the forward GEMMs (both operands e4m3) move each token's loss independently, and the
// step's loss averages `tokens` of them.
inline double fp8_loss_rel(int tokens) { return gemm_rel(kU4, kU4) / std::sqrt(double(tokens)); }
// Weights: the fp32 criterion's 2·sqrt(0.8·δ) with the gradient bound as δ.
inline double fp8_update_rel(const std::string& recipe) { return 2 * std::sqrt(0.8 * fp8_grad_rel(recipe)); }
}  // namespace equiv
inline Bounds fp8_bounds(const std::string& recipe, int tokens) {
  return {equiv::fp8_loss_rel(tokens), equiv::fp8_grad_rel(recipe), equiv::fp8_grad_rel(recipe), equiv::fp8_update_rel(recipe)};
}

// Resumes `bin` (np ranks, `args` + --resume from_ckpt) to the reference's last step and checks
// that it continues the reference run by the same criterion: the losses of the steps after the
// checkpoint and the final weights (step 1's gradients belong to the run that wrote from_ckpt).
inline void check_resume(const std::string& bin, int np, const std::string& args, const std::string& from_ckpt,
                         const CachedRun& ref, int steps_done) {
  CachedRun r;
  const std::string log = scratch("resume.jsonl");
  r.ckpt = scratch("resume_ck");
  std::filesystem::remove_all(r.ckpt);
  Result res = run_bin(bin, args + " --resume " + from_ckpt + " --save " + r.ckpt + " --log-json " + log, np, 120);
  INFO(bin << " " << args << "\n" << res.output);
  REQUIRE(res.status == 0);
  r.log = read_log(log);
  REQUIRE(r.log.steps.size() == ref.log.steps.size() - size_t(steps_done));
  CachedRun tail = ref;  // the reference from the same step on
  tail.log.steps.erase(tail.log.steps.begin(), tail.log.steps.begin() + steps_done);
  tail.first = r.first = "";
  const Equivalence e = compare(r, tail, ref);
  report(e);
  INFO(e);
  CHECK(e.loss_rel <= equiv::kLossRel);
  CHECK(e.norm_rel <= equiv::kGradRel);
  CHECK(e.update_rel <= equiv::kUpdateRel);
  CHECK(e.max_abs <= e.cap);
}

}  // namespace tst
