// fake_world_flags.h — the flags of a run without values or peers: --device shape's limits and
// --fake-world N --fake-rank R (comm/fake_world.h, tensor/shape_only.h), read by Program after
// the shared flags.
#pragma once
#include "training/config.h"
#include "training/flags.h"

namespace ts {

// Bad input is one config_error: a rank outside the world, a fake world on a device with values,
// --device shape under mpirun, or a flag a shape-only run cannot honour (--resume, --save,
// --eval-every, --numerics-every).
void read_fake_world_flags(Args& a, const RunConfig& rc);

}  // namespace ts
