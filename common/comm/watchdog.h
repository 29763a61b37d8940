// watchdog.h — MPI's start and end, and every blocking call outside the counted collectives
// (host values, splits, NCCL's rendezvous) under the watchdog's deadline (--timeout): a call
// that never returns ends every rank with a message naming the group, the operation and the
// step, never a hang. comm.h's collectives wait under the same deadline.
#pragma once
#include <mpi.h>

#include <functional>
#include <string>

#include "comm/comm.h"

#define MPI_CHECK(x)                                                 \
  do {                                                               \
    int e_ = (x);                                                    \
    if (e_ != MPI_SUCCESS) {                                         \
      char s_[MPI_MAX_ERROR_STRING];                                 \
      int n_ = 0;                                                    \
      MPI_Error_string(e_, s_, &n_);                                 \
      fatal("MPI error %s: %s", #x, s_);                             \
    }                                                                \
  } while (0)

#ifdef TS_CUDA
#define NCCL_CHECK(x)                                                                \
  do {                                                                               \
    ncclResult_t r_ = (x);                                                           \
    if (r_ != ncclSuccess) fatal("NCCL error %s: %s", #x, ncclGetErrorString(r_));   \
  } while (0)
#endif

namespace ts {

// MPI_Init unless already initialised, under the watchdog's timer from its first instant (at the
// default --timeout: the flags are read after it).
void comm_init(int* argc, char*** argv);
// Releases every live Comm (newest first), then MPI_Finalize unless already finalised: NCCL's
// teardown waits for its peers, so it must run while every rank is still alive, and a Mesh held
// by main outlives this call.
void comm_finalize();
// The watchdog: a wait longer than this many seconds aborts every rank (--timeout).
void set_comm_timeout(double seconds);
double comm_timeout();

// Blocking operations on host values outside the counted collectives (the step's loss and
// gradient norm, a checkpoint's barriers and agreements) wait under the same watchdog: `what`
// names the operation, and the watchdog's message adds the group (the Comm's name) and the step.
void watched_allreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                       const std::string& what);
void watched_bcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm, const std::string& what);
void watched_barrier(MPI_Comm comm, const std::string& what);
void watched_allgather(const void* in, int count, MPI_Datatype type, void* out, MPI_Comm comm, const std::string& what);
void watched_gather(const void* in, int count, MPI_Datatype type, void* out, int root, MPI_Comm comm,
                    const std::string& what);
void watched_gatherv(const void* in, int count, MPI_Datatype type, void* out, const int* counts, const int* displs,
                     int root, MPI_Comm comm, const std::string& what);
// A blocking call MPI (or NCCL) has no non-blocking form of: a communicator split, the rendezvous
// of NCCL's communicators, MPI_Init and MPI_Finalize. A timer thread watches it with the same
// deadline and ends the job the same way, naming `what` on `comm`'s group.
void watched_blocking(MPI_Comm comm, const std::string& what, const std::function<void()>& call);
// MPI_Comm_split of `parent`, watched (the mesh's groups).
MPI_Comm watched_split(MPI_Comm parent, int color, int key, const std::string& what);
// The ranks of this job on this rank's node (MPI_Comm_split_type, watched); the caller frees it.
MPI_Comm node_comm(const std::string& what);
// Collective over `comm`: "rank r: <its err>" for the lowest rank whose `err` is not empty, on
// every rank, or "" when every err is empty. An error one rank finds is then reported by every
// rank alike (config_error), instead of that rank leaving while the others wait for it.
std::string first_error(const std::string& err, MPI_Comm comm, const std::string& what);

// The bf16 reduction MPI uses: each element summed in fp32 and rounded to nearest even, so the
// result depends on the reduction order like NCCL's does. Exposed for tests.
void bf16_sum_into(bf16* inout, const bf16* in, int64_t n);

}  // namespace ts
