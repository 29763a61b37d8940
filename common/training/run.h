// run.h — what keeps a run from being lost at its end: every output path is checked before the
// first step, and SIGINT/SIGTERM become a clean stop at a step boundary that every rank agrees on
// (the loop then saves when --save is set).
#pragma once
#include <string>

#include "training/train.h"

namespace ts {

// Collective. Each rank checks what it will write: rank 0 the --log-json and --trace files, every
// rank the --save directory (every rank writes or reads checkpoint slices there). A problem on any
// rank is a config_error on every rank, naming the rank, the path and the problem.
void check_output_paths(const RunConfig& rc);

// Collective, before any mesh is built. When the job's ranks are not the mesh's (dp × pp × cp × tp),
// a config_error that names the fix in the flags this binary has: "add --dp 4" for 02 and 03,
// "add --tp 4" for 04. A binary without mesh flags checks its own world (01 runs on one rank).
void check_launch(const Args& a, const MeshConfig& mc);

// Collective, before the model is allocated: the predicted bytes of one rank, times the ranks that
// share this node's memory (CPU) or this rank's GPU (CUDA), against what is available there now
// (MemAvailable in /proc/meminfo; cudaMemGetInfo). A run that cannot fit stops with the comparison
// instead of dying in the allocator or the OOM killer.
void check_memory_fits(const MemoryPrediction& p, Device dev);

// From now on SIGINT and SIGTERM only raise a flag; a second signal of the same kind acts as usual
// and ends the process at once.
void catch_stop_signals();
// Collective (one small all-reduce, under the watchdog): the signal any rank has received so far, 0 if none.
int agreed_stop_signal();

}  // namespace ts
