// flight_recorder.h — every rank's recent collectives and point-to-point calls, kept so that a
// hang or a failure at scale can be explained afterwards: which rank did not arrive, at which
// collective, or which rank called something else.
//
// Each rank keeps a ring of the last N calls (--flight-recorder N, 0: off). An entry names the
// communicator (its name and world ranks), the call's number on it, the op, the peer and tag of a
// point-to-point call, the element count, dtype and bytes, its state (enqueued: issued; started:
// a wait is blocking on it; completed) and the times of each state. The numbering is what lets a
// reader match entries across ranks:
//   collectives   the n-th collective on a communicator is the same call on every member (MPI
//                 requires every member to issue a communicator's collectives in one order);
//   send/recv     the n-th message from rank a to rank b with tag t on a communicator is one
//                 message at both ends (MPI matches a pair's messages of one tag in order).
//
// The ring is written, one JSON file per rank (rank_<r>.json), into --flight-dir on a watchdog
// timeout, on fatal() and on SIGUSR1 (which does not stop the run). On a timeout or an error the
// failing rank also asks every other rank to write its own, over a communicator of its own, and
// gives them a grace period before the job is aborted; a rank that is stopped or lost writes
// nothing, which is itself the evidence. scripts/flight_analyze.py DIR reads the files.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <string>

#include "tensor/core.h"

namespace ts::flight {

// --flight-recorder and --flight-dir (the default ring is on from MPI_Init, before the flags).
void configure(int capacity, const std::string& dir);

// The communicators the entries refer to. A Comm registers its own under its name; a host
// operation on a communicator nobody registered registers it under MPI's name for it.
void register_group(MPI_Comm comm, const std::string& name);
void forget_group(MPI_Comm comm);

// A call about to be issued: returns its entry's id (0 when the ring is off). Its number, as
// described above, is counted even when the ring is off (next_collective / next_message).
// `peer` and `root` are ranks within the group (-1: none); `what` is the watchdog's label.
uint64_t collective(MPI_Comm comm, const char* op, int64_t count, DType dtype, int root, const std::string& what);
uint64_t p2p(MPI_Comm comm, const char* op, int peer, int tag, int64_t count, DType dtype, const std::string& what);
// MPI_BYTE-like host operations (watched_* on ints, chars) are recorded with their MPI type.
uint64_t collective_raw(MPI_Comm comm, const char* op, int64_t count, MPI_Datatype type, int root,
                        const std::string& what);
// The number the next collective on comm, or the next message src -> dst with this tag, will get
// (the watchdog's label names a call by it).
long next_collective(MPI_Comm comm);
long next_message(MPI_Comm comm, int src, int dst, int tag);
void started(uint64_t id);
void completed(uint64_t id);

// At MPI's start-up (comm_init): the communicator of its own that dump requests travel on
// (a duplicate of the world), and SIGUSR1's handler.
void open_channel(MPI_Comm channel);
// Before MPI_Finalize: withdraws the pending request receive and frees the request channel.
void shutdown();
// From every wait loop: serves a dump asked for by SIGUSR1 or by another rank. Cheap.
void poll();
// Writes this rank's ring to --flight-dir/rank_<r>.json (atomically: a reader never sees half a
// file); returns the path, or "" when the ring is off or the write failed (said on stderr).
std::string dump(const std::string& reason);
// On a timeout or a fatal error, before the job is aborted: this rank's dump, then (from the
// main thread, with MPI usable) a request to every other rank and up to `grace_s` seconds for
// their answers. Prints where the files are and how to read them.
void dump_everywhere(const std::string& reason, bool mpi_usable, double grace_s = 2.0);

}  // namespace ts::flight
