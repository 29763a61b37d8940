// run.cu — output paths checked up front, stop signals agreed between steps.
#include "training/run.h"
#include "training/checkpoint_files.h"
#include "training/report.h"

#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstring>

#include "training/checkpoint.h"
#include "tensor/device.h"
#include "comm/watchdog.h"
#include "tensor/shape_only.h"

namespace ts {

static std::string parent_of(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();  // "dir/" names dir
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Why a directory cannot take new entries, or "" when it can.
static std::string dir_problem(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return "directory " + dir + " does not exist";
  if (!S_ISDIR(st.st_mode)) return dir + " is not a directory";
  if (access(dir.c_str(), W_OK | X_OK) != 0) return "directory " + dir + " is not writable";
  return "";
}

// A file written at the end of the run: an existing writable file, or a new one in a writable
// directory. Checked without creating anything.
static std::string file_problem(const std::string& flag, const std::string& path) {
  struct stat st;
  std::string p;
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) p = "is a directory";
    else if (access(path.c_str(), W_OK) != 0) p = "is not writable";
  } else if (std::string d = dir_problem(parent_of(path)); !d.empty()) {
    p = "cannot be created: " + d;
  }
  return p.empty() ? "" : flag + " " + path + ": " + p;
}

// --save DIR is the checkpoint itself (published by renaming DIR.tmp, a sibling), or with
// --keep-last the directory of step_ checkpoints; one layout never overwrites the other.
static std::string save_problem(const RunConfig& rc) {
  const std::string& dir = rc.save_dir;
  struct stat st;
  const bool exists = stat(dir.c_str(), &st) == 0;
  if (exists && !S_ISDIR(st.st_mode)) return "--save " + dir + ": exists and is not a directory";
  std::string d = rc.keep_last > 0 && exists ? dir_problem(dir) : dir_problem(parent_of(dir));
  if (!d.empty()) return "--save " + dir + ": cannot write checkpoints: " + d;
  if (!exists) return "";
  const bool single = access((dir + "/model.safetensors").c_str(), F_OK) == 0;
  const bool steps = !step_checkpoints(dir).empty();
  if (rc.keep_last > 0 && single)
    return "--save " + dir + " holds one checkpoint; --keep-last writes step_ checkpoints into a directory of its own";
  if (rc.keep_last == 0 && steps)
    return "--save " + dir + " holds step_ checkpoints written with --keep-last; pass --keep-last N to add to them";
  return "";
}

// The directory's canonical path, or "" when it does not exist.
static std::string real_dir(const std::string& dir) {
  char buf[PATH_MAX];
  return realpath(dir.c_str(), buf) ? std::string(buf) : std::string();
}

// --save DIR over a checkpoint that this run did not resume from would silently replace another
// run's weights (a long run's, by a five-step experiment): refused unless --overwrite. Resuming
// from DIR, or from one of its step_ checkpoints, continues that run and saves over it freely.
static std::string overwrite_problem(const RunConfig& rc) {
  const std::string& dir = rc.save_dir;
  const bool holds = access((dir + "/model.safetensors").c_str(), F_OK) == 0 ||
                     access((dir + "/trainer.json").c_str(), F_OK) == 0 || !step_checkpoints(dir).empty();
  if (rc.overwrite || !holds) return "";
  if (!rc.resume_dir.empty()) {
    const std::string save = real_dir(dir), from = real_dir(rc.resume_dir);
    if (from == save || parent_of(from) == save) return "";
  }
  return "--save " + dir + " holds a checkpoint that this run did not resume from: --resume " + dir +
         " to continue it, or add --overwrite to replace it";
}

// The lowest rank with a problem tells every rank what it is; every rank then stops.
static void stop_on_any_rank(std::string err) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  err = first_error(err, MPI_COMM_WORLD, "checks before the first step");
  if (err.empty()) return;
  if (world == 1) err = err.substr(err.find(": ") + 2);
  config_error("%s (checked before the first step)", err.c_str());
}

void check_output_paths(const RunConfig& rc) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string err;
  if (rank == 0 && !rc.log_json.empty()) err = file_problem("--log-json", rc.log_json);
  if (err.empty() && rank == 0 && !rc.trace.empty()) err = file_problem("--trace", rc.trace);
  if (err.empty() && !rc.save_dir.empty()) err = save_problem(rc);
  if (err.empty() && rank == 0 && !rc.save_dir.empty()) err = lock_checkpoint_dir(rc.save_dir);
  if (err.empty() && !rc.save_dir.empty()) err = overwrite_problem(rc);
  stop_on_any_rank(err);
}

// The number of ranks of this job on this rank's node.
static int ranks_on_node() {
  MPI_Comm node = node_comm("the memory check");
  int n = 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return n;
}

// Bytes the kernel could give this node's processes without swapping, or -1 when unknown.
static double mem_available_bytes() {
  FILE* f = fopen("/proc/meminfo", "r");
  if (!f) return -1;
  char line[256];
  double kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lf kB", &kib) == 1) break;
  fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

void check_memory_fits(const MemoryPrediction& p, Device dev) {
  if (shape_only()) return;  // its tensors take no memory (tensor/shape_only.h)
  const double need = p.params + p.grads + p.optimizer + p.activations;
  int sharers = ranks_on_node();
  double avail = -1;
  std::string where = "this node has";
  const char* source = "MemAvailable in /proc/meminfo";
#ifdef TS_CUDA
  if (dev == Device::CUDA) {
    int gpus = 1;
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    sharers = (sharers + gpus - 1) / gpus;  // ranks are spread over the node's GPUs round-robin
    avail = double(free_b);
    where = "this rank's GPU has";
    source = "cudaMemGetInfo";
  }
#endif
  if (dev == Device::CPU) avail = mem_available_bytes();
  std::string err;
  if (avail >= 0 && need * sharers > avail) {
    char b[1024];
    snprintf(b, sizeof b,
             "predicted %s per rank (params %s, grads %s, optimizer %s, activations %s) × %d rank%s = %s, but %s "
             "%s available (%s): the run would die allocating. Choose a smaller shape (--preset, --micro-batch, "
             "--recompute full, --dtype bf16) or spread it over more devices; --dry-run prints the prediction alone",
             human_bytes(need).c_str(), human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(),
             human_bytes(p.optimizer).c_str(), human_bytes(p.activations).c_str(), sharers, sharers > 1 ? "s" : "",
             human_bytes(need * sharers).c_str(), where.c_str(), human_bytes(avail).c_str(), source);
    err = b;
  }
  stop_on_any_rank(err);
}

void check_launch(const Args& a, const MeshConfig& mc) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int ranks = mc.dp * mc.pp * mc.cp * mc.tp;
  // A degree below 1 is reported by the batch split and the mesh's own validation.
  if (ranks == world || mc.dp < 1 || mc.pp < 1 || mc.cp < 1 || mc.tp < 1) return;
  static const std::pair<const char*, int MeshConfig::*> dims[] = {
      {"--dp", &MeshConfig::dp}, {"--pp", &MeshConfig::pp}, {"--cp", &MeshConfig::cp}, {"--tp", &MeshConfig::tp}};
  std::string uses, product, fix;
  int n = 0;
  for (auto& [flag, degree] : dims) {
    if (!a.declares(flag)) continue;
    const int d = mc.*degree, others = ranks / d;
    uses += (n ? " × " : "") + std::string(flag) + " " + std::to_string(d);
    product += (n ? " × " : "") + std::string(flag);
    if (world % others == 0)
      fix = std::string(a.has(flag) ? "set " : "add ") + flag + " " + std::to_string(world / others);
    n++;
  }
  if (n == 0) return;
  if (n > 1 || fix.empty()) fix = "make " + product + " = " + std::to_string(world);
  config_error("%s needs %d ranks but the job has %d: %s (or launch with mpirun -np %d)", uses.c_str(), ranks, world,
               fix.c_str(), ranks);
}

static volatile sig_atomic_t g_stop_signal = 0;

static void on_stop_signal(int sig) { g_stop_signal = sig; }

void catch_stop_signals() {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int agreed_stop_signal() {
  int mine = g_stop_signal, any = 0;
  watched_allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, "all_reduce (the stop signals)");
  return any;
}

}  // namespace ts
