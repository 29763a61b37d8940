// test_util.h — running the technique binaries from tests and reading what they report.
//
// End-to-end tests start the real binaries (under mpirun for several ranks), read their
// --log-json output and compare numbers; error-path tests assert the exit status and message.
#pragma once
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "json.h"
#include "safetensors.h"

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

// A scratch directory unique to this process.
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
  const bool technique = bin.size() > 1 && bin[0] == '0';
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

// The JSON lines of a --log-json file: per-step records, then {"summary": ...}.
struct Log {
  std::vector<ts::Json> steps;
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

// Largest |a - b| / (atol/rtol-scaled) over two checkpoints' weights: returns max |a-b| and the
// max of |b| seen, tensor by tensor, so tests can state their tolerance in one line.
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

// Elementwise comparison of two checkpoints' tensors: the largest |Δ| and how many exceed `loose`.
struct WeightDiff {
  double max_abs = 0;
  long over = 0, total = 0;
};
inline WeightDiff weight_diff(const std::string& a, const std::string& b, double loose) {
  auto ta = read_tensors(a), tb = read_tensors(b);
  WeightDiff d;
  if (ta.size() != tb.size()) return {1e30, 1L << 40, 0};
  for (size_t i = 0; i < ta.size(); i++) {
    if (ta[i].first != tb[i].first || ta[i].second.size() != tb[i].second.size()) return {1e30, 1L << 40, 0};
    for (size_t j = 0; j < ta[i].second.size(); j++) {
      const double x = double(std::fabs(ta[i].second[j] - tb[i].second[j]));  // as max_abs_diff_files
      d.max_abs = std::max(d.max_abs, x);
      d.over += x > loose;
      d.total++;
    }
  }
  return d;
}

// "--steps S --batch B --micro-batch M": the same global batch run in micro-batches of M.
inline std::string steps_args(int steps, int batch, int micro) {
  return "--steps " + std::to_string(steps) + " --batch " + std::to_string(batch) + " --micro-batch " +
         std::to_string(micro);
}

// ----- shared end-to-end pieces (need Catch2's macros: include after catch.hpp) -----------------

// A run of a technique binary with --save and --log-json into scratch space; runs are cached by
// their command line, because several test cases read the same run.
struct CachedRun {
  Log log;
  std::string output, ckpt;
};
inline const CachedRun& cached_run(const std::string& bin, int np, const std::string& args, int timeout_s = 180) {
  static std::map<std::string, CachedRun> cache;
  const std::string key = bin + " " + std::to_string(np) + " " + args;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const std::string tag = "run" + std::to_string(cache.size());
  CachedRun r;
  r.ckpt = scratch(tag + "_ck");
  const std::string log = scratch(tag + ".jsonl");
  Result res = run_bin(bin, args + " --save " + r.ckpt + " --log-json " + log, np, timeout_s);
  INFO(key << "\n" << res.output);
  REQUIRE(res.status == 0);
  r.output = res.output;
  r.log = read_log(log);
  REQUIRE(r.log.steps.size() > 0);
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

// Resumes `bin` (np ranks, `args` + --resume from_ckpt) to `steps` and checks it continues the
// reference run: the losses of the steps after the checkpoint and the final weights.
inline void check_resume(const std::string& bin, int np, const std::string& args, const std::string& from_ckpt,
                         const CachedRun& ref, int steps_done, double loss_tol, double weight_tol) {
  const std::string log = scratch("resume.jsonl"), out = scratch("resume_ck");
  Result r = run_bin(bin, args + " --resume " + from_ckpt + " --overwrite --save " + out + " --log-json " + log, np, 120);
  INFO(bin << " " << args << "\n" << r.output);
  REQUIRE(r.status == 0);
  const std::vector<double> l = read_log(log).losses(), want = ref.log.losses();
  REQUIRE(l.size() == want.size() - size_t(steps_done));
  CHECK(max_rel_diff(l, std::vector<double>(want.begin() + steps_done, want.end())) <= loss_tol);
  CHECK(max_abs_diff_files(out + "/model.safetensors", ref.ckpt + "/model.safetensors") <= weight_tol);
}

}  // namespace tst
