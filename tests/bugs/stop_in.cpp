// stop_in, a fault the reliability tests inject into a technique binary (TECHNIQUE+stop_in): the
// last rank stalls or dies as it enters a collective, as a stalled or lost node would, so that the
// tests can prove the other ranks see it (the watchdog, the flight recorder, the abort).
//   TS_STOP_IN=TEXT  the last rank stops (SIGSTOP) as it enters the first operation whose label
//                    (the watchdog's: "all_reduce #3 on group 'dp'", "barrier (checkpoint of step 4:
//                    files created) on group 'world' (2 ranks)") contains TEXT;
//   TS_KILL_IN=TEXT  the last rank is killed (SIGKILL) there.
// Neither set, the variant runs as the technique does. Every operation comm.cu issues or watches
// is noted by the flight recorder before it starts, under that label: the fault wraps those notes
// (flight::collective, flight::p2p, flight::collective_raw; the rank stops before its entry is
// written, so its record never shows the call; the mangled names are MPICH's, whose MPI_Comm is an
// int). The switches live here, not in comm.cu: tests inject their own faults
// (notes/00_architecture.md, "Seeded bugs").
#include <signal.h>

#include <cstdlib>
#include <string>

#include "bug.h"
#include "comm/flight_recorder.h"

namespace {

void stop_if_named(const std::string& what) {
  static const char* stop = getenv("TS_STOP_IN");
  static const char* kill = getenv("TS_KILL_IN");
  if (!stop && !kill) return;
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (ts::world_rank() != world - 1) return;
  for (const char** text : {&stop, &kill})
    if (*text && **text && what.find(*text) != std::string::npos) {
      *text = nullptr;
      const bool stopping = text == &stop;
      fprintf(stderr, "%s: rank %d %s in %s\n", stopping ? "TS_STOP_IN" : "TS_KILL_IN", world - 1,
              stopping ? "stops" : "is killed", what.c_str());
      fflush(stderr);
      raise(stopping ? SIGSTOP : SIGKILL);
    }
}

}  // namespace

uint64_t real_collective(MPI_Comm, const char*, int64_t, ts::DType, int, const std::string&)
    __asm__("__real__ZN2ts6flight10collectiveEiPKclNS_5DTypeEiRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
uint64_t real_p2p(MPI_Comm, const char*, int, int, int64_t, ts::DType, const std::string&)
    __asm__("__real__ZN2ts6flight3p2pEiPKciilNS_5DTypeERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
uint64_t real_collective_raw(MPI_Comm, const char*, int64_t, MPI_Datatype, int, const std::string&)
    __asm__("__real__ZN2ts6flight14collective_rawEiPKcliiRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
uint64_t stop_collective(MPI_Comm, const char*, int64_t, ts::DType, int, const std::string&)
    __asm__("__wrap__ZN2ts6flight10collectiveEiPKclNS_5DTypeEiRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
uint64_t stop_p2p(MPI_Comm, const char*, int, int, int64_t, ts::DType, const std::string&)
    __asm__("__wrap__ZN2ts6flight3p2pEiPKciilNS_5DTypeERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
uint64_t stop_collective_raw(MPI_Comm, const char*, int64_t, MPI_Datatype, int, const std::string&)
    __asm__("__wrap__ZN2ts6flight14collective_rawEiPKcliiRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");

uint64_t stop_collective(MPI_Comm comm, const char* op, int64_t count, ts::DType dtype, int root,
                         const std::string& what) {
  stop_if_named(what);
  return real_collective(comm, op, count, dtype, root, what);
}

uint64_t stop_p2p(MPI_Comm comm, const char* op, int peer, int tag, int64_t count, ts::DType dtype,
                  const std::string& what) {
  stop_if_named(what);
  return real_p2p(comm, op, peer, tag, count, dtype, what);
}

uint64_t stop_collective_raw(MPI_Comm comm, const char* op, int64_t count, MPI_Datatype type, int root,
                             const std::string& what) {
  stop_if_named(what);
  return real_collective_raw(comm, op, count, type, root, what);
}
