// A deliberate bug, linked into a test-only variant of a technique binary (the Makefile's
// SEEDED_BUGS): the bug's object defines __wrap_<symbol> for a call the technique object makes
// into common/, and the link's -Wl,--wrap=<symbol> sends that call through it; __real_<symbol> is
// the original. A renamed or re-typed symbol leaves __real_<symbol> undefined: the link fails.
#pragma once

#include <cstdio>

#include "tensor/core.h"

namespace bug {

// Said once per rank, where the bug first changes the run, so its output is never taken for a
// correct run's (tests/test_equivalence.cpp looks for it: a bug that never fires fails the test).
inline void announce(const char* name) {
  static bool said = false;
  if (!said)
    fprintf(stderr, "warning: rank %d runs the deliberate bug %s (tests/bugs/%s.cpp)\n", ts::world_rank(), name, name);
  said = true;
}

}  // namespace bug
