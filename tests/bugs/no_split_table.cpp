// no_split_table, in 04_tensor_parallel: the model is built from a tp shard spec whose split table
// was dropped, the misuse Model::make_table refuses (without a table every dense tensor would be
// whole on every rank, and the f/g collectives would sum tp copies of full products). Wraps the
// Model constructor that 04's main calls. The run must end on a fatal naming the missing table,
// on every rank, before any step (tests/test_tp.cpp, "bad input").
#include "bug.h"
#include "model/model.h"

// The constructor's C1 symbol takes `this` first; ModelLayout is not trivially copyable, so both
// declarations pass it by invisible reference, as the constructor does.
void real_model_ctor(ts::Model* self, const ts::ModelConfig& cfg, ts::Device dev, ts::DType dt, ts::Recompute rc,
                     ts::ModelLayout layout)
    __asm__("__real__ZN2ts5ModelC1ERKNS_11ModelConfigENS_6DeviceENS_5DTypeENS_9RecomputeENS_11ModelLayoutE");
void no_table_model_ctor(ts::Model* self, const ts::ModelConfig& cfg, ts::Device dev, ts::DType dt, ts::Recompute rc,
                         ts::ModelLayout layout)
    __asm__("__wrap__ZN2ts5ModelC1ERKNS_11ModelConfigENS_6DeviceENS_5DTypeENS_9RecomputeENS_11ModelLayoutE");

void no_table_model_ctor(ts::Model* self, const ts::ModelConfig& cfg, ts::Device dev, ts::DType dt, ts::Recompute rc,
                         ts::ModelLayout layout) {
  if (layout.shard.tp > 1 && layout.shard.tp_split) {
    bug::announce("no_split_table");
    layout.shard.tp_split = nullptr;
  }
  real_model_ctor(self, cfg, dev, dt, rc, std::move(layout));
}
