// program.h — the start every technique's main() shares, under TrainingRun (start.h): MPI, the
// shared flags, the chapter's own flags, the device, the mesh, the data and the log. A chapter
// reads it through start.h; what it does is in train.cu.
#pragma once
#include <functional>
#include <memory>

#include "formats/data.h"
#include "comm/mesh.h"
#include "training/config.h"
#include "training/flags.h"
#include "training/log.h"

namespace ts {

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
}  // namespace ts
