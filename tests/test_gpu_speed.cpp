// The GPU speed model's arithmetic (common/training/gpu_speed.h) on cases worked by hand.
#include <catch2/catch.hpp>

#include "training/config.h"
#include "training/config_flags.h"
#include "training/gpu_speed.h"

using namespace ts;

namespace {
ModelConfig m124() {
  ModelConfig m;
  apply_preset("124m", m);
  return m;
}
const KernelCost& find(const StepPrediction& p, const std::string& name) {
  for (const KernelCost& k : p.kernels)
    if (k.name == name) return k;
  FAIL("no kernel " << name);
  return p.kernels[0];
}
}  // namespace

TEST_CASE("roofline: the larger of compute time and memory time") {
  CHECK(roofline_seconds(2e12, 1e12, 1e9, 1e12) == Approx(2.0));  // compute-bound
  CHECK(roofline_seconds(1e9, 1e12, 3e12, 1e12) == Approx(3.0));  // memory-bound
}

TEST_CASE("a GEMM's FLOPs, bytes and time at 124m, batch 4") {
  const StepPrediction p = predict_01_step(*find_gpu("h100"), hopper_kernel_rates(), m124(), 4, AttnRung::V2);
  const KernelCost& g = find(p, "linear_forward D->F (gate, up)");
  // 4096 tokens × 768 in × 2048 out: 2·4096·768·2048 FLOPs; bf16 x, W, y: 2·(4096·768 + 768·2048 + 4096·2048) B.
  CHECK(g.flops == Approx(2.0 * 4096 * 768 * 2048));
  CHECK(g.bytes == Approx(2.0 * (4096.0 * 768 + 768.0 * 2048 + 4096.0 * 2048)));
  CHECK(g.calls == 24);  // gate and up in 12 layers
  // Compute-bound at 0.65 × 989 TFLOP/s: 12.885 GFLOP / 642.85 TFLOP/s = 20.04 µs.
  CHECK(g.limit == "compute");
  CHECK(g.seconds == Approx(2.0 * 4096 * 768 * 2048 / (0.65 * 989e12)));
  // A streaming op: the residual add moves 3 · 4096 · 768 · 2 B at 0.85 × 3350 GB/s.
  const KernelCost& a = find(p, "add (residual)");
  CHECK(a.limit == "memory");
  CHECK(a.seconds == Approx(3.0 * 4096 * 768 * 2 / (0.85 * 3350e9)));
}

TEST_CASE("causal tile counts and v1 attention's shared-memory work") {
  // 64-query blocks over 32-key tiles, S = 1024: block i visits 2i + 2 tiles; Σ_{i<16} = 272.
  CHECK(causal_tiles(1024, 64, 32, false) == 272);
  // 64-key blocks over 32-query tiles: block j visits 32 − 2j; Σ_{j<16} = 272.
  CHECK(causal_tiles(1024, 64, 32, true) == 272);
  // A single block of 64 queries over 64 keys sees both tiles.
  CHECK(causal_tiles(64, 64, 32, false) == 2);
  // v1 forward, one (b, h), S = 32, hd = 64: one block of 16 rows, one tile, 4 warps, each
  // 64·5 + 32·2·5 = 640 loads, 32 + 4 stores and 64·4 + 32·2·4 = 512 FMAs.
  const SmemWork f = attention_v1_forward_work(1, 32, 1, 64);
  CHECK(f.smem == 2 * 4 * (640 + 36));  // two 16-row blocks
  CHECK(f.fma == 2 * 4 * 512);
}

TEST_CASE("the step sums its kernels; MFU is the project's") {
  const Gpu& g = *find_gpu("h100");
  const StepPrediction p = predict_01_step(g, hopper_kernel_rates(), m124(), 4, AttnRung::V2);
  double sum = 0;
  for (const KernelCost& k : p.kernels) sum += k.calls * k.seconds;
  CHECK(p.step_s == Approx(sum));
  CHECK(p.tokens_per_s == Approx(4096 / p.step_s));
  CHECK(model_flops_utilization(m124(), p.tokens_per_s, 989) == Approx(flops_per_token(m124()) * 4096 / p.step_s / 989e12));
  CHECK(p.mfu == Approx(model_flops_utilization(m124(), p.tokens_per_s, 989)));
  // v1's attention is bounded by shared memory and makes the step slower than v2's.
  const StepPrediction v1 = predict_01_step(g, hopper_kernel_rates(), m124(), 4, AttnRung::V1);
  CHECK(find(v1, "attention_dkv v1").limit == "shared memory");
  CHECK(v1.step_s > p.step_s);
  // The H200's faster memory helps the memory-bound kernels only.
  const StepPrediction h200 = predict_01_step(*find_gpu("h200"), hopper_kernel_rates(), m124(), 4, AttnRung::V2);
  CHECK(find(h200, "add (residual)").seconds < find(p, "add (residual)").seconds);
  CHECK(find(h200, "linear_forward D->F (gate, up)").seconds == find(p, "linear_forward D->F (gate, up)").seconds);
}
