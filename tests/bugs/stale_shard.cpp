// stale_shard, in 03_zero: the last dp rank never updates its shard of unit 1 (layer 0), so after
// every step's all-gather the other ranks keep reading its initial weights. Wraps AdamW::step,
// which ZeRO's optimizer_step calls once per unit's chunk.
#include "bug.h"
#include "model/model.h"
#include "training/train.h"

using ts::Tensor;

void real_adamw_step(ts::AdamW& opt, const ts::Model& m, const Tensor& weights_range, const Tensor& grads_range,
                     double lr, long t, float clip_coef, const ts::RunConfig& rc)
    __asm__("__real__ZN2ts5AdamW4stepERKNS_5ModelERKNS_6TensorES6_dlfRKNS_9RunConfigE");
void stale_adamw_step(ts::AdamW& opt, const ts::Model& m, const Tensor& weights_range, const Tensor& grads_range,
                      double lr, long t, float clip_coef, const ts::RunConfig& rc)
    __asm__("__wrap__ZN2ts5AdamW4stepERKNS_5ModelERKNS_6TensorES6_dlfRKNS_9RunConfigE");

// ZeRO cuts unit u's range [unit_begin[u], unit_begin[u+1]) into dp equal chunks in rank order:
// the chunk that ends unit 1's range is the last rank's (at dp 1 the whole unit).
void stale_adamw_step(ts::AdamW& opt, const ts::Model& m, const Tensor& weights_range, const Tensor& grads_range,
                      double lr, long t, float clip_coef, const ts::RunConfig& rc) {
  const std::vector<int64_t>& ub = m.table.unit_begin;
  if (ub.size() > 2 && opt.begin >= ub[1] && opt.end == ub[2]) {
    bug::announce("stale_shard");
    return;
  }
  real_adamw_step(opt, m, weights_range, grads_range, lr, t, clip_coef, rc);
}
