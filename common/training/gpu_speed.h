// gpu_speed.h — every kernel of a training step of 01 on a GPU, predicted before any GPU ran it.
//
// Each kernel's time is the roofline (Williams, Waterman & Patterson 2009): the larger of its FLOPs
// over the rate its unit reaches and its compulsory bytes over the memory bandwidth it reaches,
// and at least the time of one launch. The GPU's peaks are step_time.h's table (find_gpu); what a
// kernel reaches of them is KernelRates, each number with its source (notes/gpu_speed.md). The
// step is the sum over the kernels 01 runs (common/model/model.cu's op sequence, forward, backward,
// optimizer), and its MFU is the project's: flops_per_token × tokens/s over the dense peak.
//
// Attention has two rungs. v1 (kernels_cuda.cu): fp32 FMAs on CUDA cores, each inner-loop FMA fed
// by a shared-memory load, so its limit is the shared-memory pipe (32 banks × 4 B per clock per
// SM: one 32-lane load per clock), counted from its loops. v2 (FlashAttention-2's work split on
// tensor cores, mma.sync + ldmatrix, 64-row blocks and 32-wide tiles, no cp.async pipelining): its
// tile FLOPs at an assumed fraction of the dense peak.
#ifndef TS_GPU_SPEED_H
#define TS_GPU_SPEED_H
#include <string>
#include <vector>

#include "training/step_time.h"

namespace ts {

// What kernels reach of a GPU's peaks.
struct KernelRates {
  double gemm_fraction;    // cuBLAS bf16 GEMMs at 01's shapes, of the dense bf16 peak
  double hbm_fraction;     // streaming kernels, of the HBM peak
  double sms, clock_ghz;   // CUDA cores and shared memory (v1 attention)
  double v2_fwd_fraction;  // v2 attention forward, of the dense bf16 peak
  double v2_bwd_fraction;  // v2 dK/dV and dQ kernels
  double launch_s;         // the least time a kernel takes, back to back on one stream
};
// H100 SXM and H200 (the same GH100 chip, 132 SMs; the H200's memory is faster).
KernelRates hopper_kernel_rates();

enum class AttnRung { V1, V2 };
const char* rung_name(AttnRung r);

// One kernel (or one op's kernels) of the step.
struct KernelCost {
  std::string name;
  double calls;           // per step
  double flops, bytes;    // per call: FLOPs executed, bytes it must move to and from HBM
  double smem_instr = 0;  // per call: shared-memory warp instructions (v1 attention)
  double seconds = 0;     // per call, predicted
  std::string limit;      // compute, memory, shared memory or launch
  std::string bench;      // bench_kernels' row that times the same call ("" when none does)
};

// max(flops / flop_rate, bytes / byte_rate): the roofline's time.
double roofline_seconds(double flops, double flop_rate, double bytes, double byte_rate);
// The project's MFU (train.cu's step log): the model's FLOPs per token × tokens/s over the peak.
double model_flops_utilization(const ModelConfig& m, double tokens_per_s, double peak_tflops);
// Prices one kernel on g: sets seconds and limit.
void price(KernelCost& k, const Gpu& g, const KernelRates& r, double flop_rate);

// v1 attention's work per call at batch B (warp instructions): shared-memory loads and stores, FMAs.
struct SmemWork {
  double smem = 0, fma = 0;
};
SmemWork attention_v1_forward_work(int B, int S, int H, int hd);
SmemWork attention_v1_dq_work(int B, int S, int H, int hd);
SmemWork attention_v1_dkv_work(int B, int S, int H, int KVH, int hd);
// Key tiles (or query tiles) a causal S×S attention visits when blocks own `rows` rows and tiles
// are `tile` wide, skipping the fully masked ones: per (batch, head).
double causal_tiles(int S, int rows, int tile, bool keys_own_block);

struct StepPrediction {
  std::vector<KernelCost> kernels;
  double step_s = 0, tokens_per_s = 0, mfu = 0;
};
// 01's step on g at `micro_batch` sequences of m.seq tokens, bf16, one micro-batch per step.
StepPrediction predict_01_step(const Gpu& g, const KernelRates& r, const ModelConfig& m, int micro_batch,
                               AttnRung rung);

}  // namespace ts
#endif  // TS_GPU_SPEED_H
