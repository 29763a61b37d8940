// local_bias_loads, in 07_expert_parallel: each rank moves DeepSeek-V3's routing bias by the loads
// of its own tokens instead of the loads summed over every rank that routes, so the ranks' biases
// drift apart and away from 01's (tests/test_ep.cpp, "seeded bugs"). Wraps the MoeBlock::update_bias
// that the step's report calls, handing it this rank's counts (not yet reset) for the sum.
#include "bug.h"
#include "model/moe.h"

void real_update_bias(ts::MoeBlock* self, ts::Model& m, const std::vector<int64_t>& loads, const ts::Tensor& master)
    __asm__("__real__ZN2ts8MoeBlock11update_biasERNS_5ModelERKSt6vectorIlSaIlEERKNS_6TensorE");
void local_update_bias(ts::MoeBlock* self, ts::Model& m, const std::vector<int64_t>& loads, const ts::Tensor& master)
    __asm__("__wrap__ZN2ts8MoeBlock11update_biasERNS_5ModelERKSt6vectorIlSaIlEERKNS_6TensorE");

void local_update_bias(ts::MoeBlock* self, ts::Model& m, const std::vector<int64_t>& loads, const ts::Tensor& master) {
  if (self->stats.counts != loads) bug::announce("local_bias_loads");
  real_update_bias(self, m, self->stats.counts, master);
}
