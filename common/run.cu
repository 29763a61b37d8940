// run.cu — output paths checked up front, stop signals agreed between steps.
#include "run.h"

#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "checkpoint.h"

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

void check_output_paths(const RunConfig& rc) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::string err;
  if (rank == 0 && !rc.log_json.empty()) err = file_problem("--log-json", rc.log_json);
  if (err.empty() && rank == 0 && !rc.trace.empty()) err = file_problem("--trace", rc.trace);
  if (err.empty() && !rc.save_dir.empty()) err = save_problem(rc);
  if (err.empty() && rank == 0 && !rc.save_dir.empty()) err = lock_checkpoint_dir(rc.save_dir);
  // The lowest rank with a problem tells every rank what it is.
  err = first_error(err, MPI_COMM_WORLD, "checking the output paths");
  if (err.empty()) return;
  if (world == 1) err = err.substr(err.find(": ") + 2);
  config_error("%s (checked before the first step)", err.c_str());
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
