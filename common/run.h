// run.h — what keeps a run from being lost at its end: every output path is checked before the
// first step, and SIGINT/SIGTERM become a clean stop at a step boundary that every rank agrees on
// (the loop then saves when --save is set).
#pragma once
#include <string>

#include "train.h"

namespace ts {

// Collective. Each rank checks what it will write: rank 0 the --log-json and --trace files, every
// rank the --save directory (every rank writes or reads checkpoint slices there). A problem on any
// rank is a config_error on every rank, naming the rank, the path and the problem.
void check_output_paths(const RunConfig& rc);

// From now on SIGINT and SIGTERM only raise a flag; a second signal of the same kind acts as usual
// and ends the process at once.
void catch_stop_signals();
// Collective (one small MPI_Allreduce): the signal any rank has received so far, 0 if none.
int agreed_stop_signal();

}  // namespace ts
