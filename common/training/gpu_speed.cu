// gpu_speed.cu — the kernels of 01's step, priced on an H100/H200 (gpu_speed.h).
#include "training/gpu_speed.h"

#include <algorithm>
#include <cmath>

#include "model/model.h"

namespace ts {

// gemm_fraction: the largest bf16 matmul rate measured on an H100 SXM is 792 TFLOP/s, 80% of 989
// (Bekman, "Machine Learning Engineering", MAMF table, CUDA 12.1, shape 6144×17920×2816); 01's
// GEMMs have a 768-wide operand, so fewer tiles per SM and more traffic per FLOP: 0.65 assumed.
// hbm_fraction: a streaming kernel reaches ~85–90% of the HBM peak (assumed 0.85).
// clock: 989.4 TFLOP/s = 132 SMs × 4,096 dense bf16 FLOP/clock × 1.83 GHz, the clock NVIDIA's
// tensor peak assumes (its FP32 figure, 67 TFLOP/s, assumes the 1.98 GHz maximum).
// v2: FlashAttention-2 reaches ~35% of the H100's peak (Shah et al. 2024, FlashAttention-3,
// abstract) with cp.async double buffering and 128-row blocks; mma.sync itself caps at ~2/3 of the
// wgmma peak. v2 has neither pipelining nor large tiles: 30% forward assumed, and its backward
// kernels at 25% (FA2's backward runs at ~0.85 of its forward's rate: Dao 2023, A100 figures).
// launch: a kernel queued behind another on one stream takes at least ~2 µs.
KernelRates hopper_kernel_rates() { return {0.65, 0.85, 132, 1.83, 0.30, 0.25, 2e-6}; }

const char* rung_name(AttnRung r) { return r == AttnRung::V1 ? "v1 (CUDA cores)" : "v2 (tensor cores)"; }

double roofline_seconds(double flops, double flop_rate, double bytes, double byte_rate) {
  return std::max(flops / flop_rate, bytes / byte_rate);
}

double model_flops_utilization(const ModelConfig& m, double tokens_per_s, double peak_tflops) {
  return flops_per_token(m) * tokens_per_s / (peak_tflops * 1e12);
}

void price(KernelCost& k, const Gpu& g, const KernelRates& r, double flop_rate) {
  const double byte_rate = g.hbm_gbs * 1e9 * r.hbm_fraction;
  const double smem_s = k.smem_instr / (r.sms * r.clock_ghz * 1e9);  // one warp instruction per clock per SM
  const double roof = roofline_seconds(k.flops, flop_rate, k.bytes, byte_rate);
  k.seconds = std::max({roof, smem_s, r.launch_s});
  k.limit = k.seconds == r.launch_s      ? "launch"
            : k.seconds == smem_s        ? "shared memory"
            : k.bytes / byte_rate >= roof ? "memory"
                                          : "compute";
}

// ----- v1 attention: counted from kernels_cuda.cu's loops ---------------------------------------------
// A block has 4 warps; a warp owns RPW rows; NCH = hd/32 accumulators per lane. Per warp and tile:
//   forward (RPW 4): scores hd·(1 + RPW) loads (a key column per lane, RPW broadcast query values)
//     for hd·RPW FMAs; P·V 32·NCH·(1 + RPW) loads for 32·NCH·RPW FMAs; the K and V tile stores
//     2·32·hd/128 per thread, and RPW stores of P.
//   dQ (RPW 2): hd·(2 + 2·RPW) loads for 2·hd·RPW FMAs (S and dP); dS·K 32·NCH·(1 + RPW) loads for
//     32·NCH·RPW FMAs; 2·32·hd/128 tile stores, RPW stores of dS.
//   dK/dV (RPW 2): hd·(2 + 2·RPW) loads for 2·hd·RPW FMAs; 32·NCH·(2 + 2·RPW) loads for 32·NCH·2·RPW
//     FMAs (dV and dK); 2·32·hd/128 tile stores, 2·RPW stores of P and dS.
// One 32-lane 4-byte load (distinct banks, or one broadcast address) per clock per SM; FMAs at 4
// warp instructions per clock per SM (128 lanes): the loads bound every kernel, 1.25–1.5 per FMA.
double causal_tiles(int S, int rows, int tile, bool keys_own_block) {
  double tiles = 0;
  for (int r0 = 0; r0 < S; r0 += rows)
    tiles += keys_own_block ? (S + tile - 1) / tile - r0 / tile      // query tiles reaching key r0
                            : (std::min(r0 + rows, S) - 1) / tile + 1;  // key tiles up to the last query
  return tiles;
}

// Warp instructions of a call: (b, head) pairs × tiles × 4 warps, each doing the counts above.
static SmemWork v1_work(double pairs_tiles, double loads, double stores, double fmas) {
  return {pairs_tiles * 4 * (loads + stores), pairs_tiles * 4 * fmas};
}

SmemWork attention_v1_forward_work(int B, int S, int H, int hd) {
  const double rpw = 4, nch = hd / 32;
  return v1_work(double(B) * H * causal_tiles(S, 16, 32, false), hd * (1 + rpw) + 32 * nch * (1 + rpw),
                 2.0 * 32 * hd / 128 + rpw, hd * rpw + 32 * nch * rpw);
}

SmemWork attention_v1_dq_work(int B, int S, int H, int hd) {
  const double rpw = 2, nch = hd / 32;
  return v1_work(double(B) * H * causal_tiles(S, 8, 32, false), hd * (2 + 2 * rpw) + 32 * nch * (1 + rpw),
                 2.0 * 32 * hd / 128 + rpw, 2 * hd * rpw + 32 * nch * rpw);
}

// Blocks of 8 keys per (b, kv head) loop over the group's H/KVH query heads.
SmemWork attention_v1_dkv_work(int B, int S, int H, int KVH, int hd) {
  const double rpw = 2, nch = hd / 32;
  return v1_work(double(B) * H * causal_tiles(S, 8, 32, true), hd * (2 + 2 * rpw) + 32 * nch * (2 + 2 * rpw),
                 2.0 * 32 * hd / 128 + 2 * rpw, 2 * hd * rpw + 32 * nch * 2 * rpw);
}

// ----- the step ----------------------------------------------------------------------------------------

namespace {
struct Shape {
  double B, S, N, D, F, V, H, KVH, hd, L, es;
};

void add_linear(std::vector<KernelCost>& k, const Shape& s, const char* tag, double in, double out, double calls,
                const std::string& bench_fwd, const std::string& bench_bwd) {
  const double w = in * out, fwd = 2 * s.N * w;
  k.push_back({std::string("linear_forward ") + tag, calls, fwd, s.es * (s.N * in + w + s.N * out), 0, 0, "", bench_fwd});
  // dx = dy·W (bf16 out) and dW += dyᵀ·x (fp32, read and written).
  k.push_back({std::string("linear_backward ") + tag, calls, 2 * fwd,
               s.es * (2 * s.N * out + 2 * s.N * in + w) + 8 * w, 0, 0, "", bench_bwd});
}

void add_attention(std::vector<KernelCost>& k, const Shape& s, AttnRung rung) {
  const int B = int(s.B), S = int(s.S), H = int(s.H), KVH = int(s.KVH), hd = int(s.hd);
  const double io = s.es * s.N * (2 * s.H + 2 * s.KVH) * s.hd + 4 * s.N * s.H;  // q, k, v, out, lse
  const double bwd_io = io + s.es * s.N * (2 * s.H + 2 * s.KVH) * s.hd;           // + dout, dq, dk, dv
  const double rowdot = s.es * 2 * s.N * s.H * s.hd + 4 * s.N * s.H;
  if (rung == AttnRung::V1) {
    const SmemWork f = attention_v1_forward_work(B, S, H, hd), q = attention_v1_dq_work(B, S, H, hd),
                   kv = attention_v1_dkv_work(B, S, H, KVH, hd);
    k.push_back({"attention_forward v1", s.L, 64 * f.fma, io, f.smem, 0, "", "attention_forward"});
    k.push_back({"attention_rowdot", s.L, 2 * s.N * s.H * s.hd, rowdot, 0, 0, "", ""});
    k.push_back({"attention_dq v1", s.L, 64 * q.fma, bwd_io / 2, q.smem, 0, "", ""});
    k.push_back({"attention_dkv v1", s.L, 64 * kv.fma, bwd_io / 2, kv.smem, 0, "", ""});
    return;
  }
  // v2: a tile matmul of 64 rows by 32 by hd is 2·64·32·hd FLOPs; forward 2 per tile, dK/dV 4, dQ 3.
  const double mm = 2.0 * 64 * 32 * s.hd, q_tiles = causal_tiles(S, 64, 32, false),
               k_tiles = causal_tiles(S, 64, 32, true);
  k.push_back({"attention_forward v2", s.L, s.B * s.H * q_tiles * 2 * mm, io, 0, 0, "", "attention_forward"});
  k.push_back({"attention_rowdot", s.L, 2 * s.N * s.H * s.hd, rowdot, 0, 0, "", ""});
  k.push_back({"flash_v2_dkv", s.L, s.B * s.H * k_tiles * 4 * mm, bwd_io / 2, 0, 0, "", ""});
  k.push_back({"flash_v2_dq", s.L, s.B * s.H * q_tiles * 3 * mm, bwd_io / 2, 0, 0, "", ""});
}

// The streaming ops of a layer and of the head and embedding; bytes are compulsory traffic.
void add_streaming(std::vector<KernelCost>& k, const Shape& s, double params, double tensors) {
  const double nd = s.N * s.D * s.es, nf = s.N * s.F * s.es, L = s.L;
  const double rope = 2 * s.N * s.hd * s.es;
  auto op = [&](const char* name, double calls, double bytes, const char* bench) {
    k.push_back({name, calls, 0, bytes, 0, 0, "", bench});
  };
  op("embedding_forward", 1, 2 * nd, "embedding_forward");
  op("convert (norm weight to fp32)", 4 * L + 2, 6 * s.D, "");
  op("rmsnorm_forward", 2 * L + 1, 2 * nd + 4 * s.N, "rmsnorm_forward");
  op("rope_forward q", L, rope * s.H, "rope_forward");
  op("rope_forward k", L, rope * s.KVH, "");
  op("add (residual)", 2 * L, 3 * nd, "add");
  op("swiglu_forward", L, 3 * nf, "swiglu_forward");
  op("cross_entropy fwd+bwd", 1, 2 * s.N * s.V * s.es + 8 * s.N, "cross_entropy fwd+bwd");
  op("swiglu_backward", L, 5 * nf, "swiglu_backward");
  op("rmsnorm_backward (3 kernels)", 2 * L + 1, 5 * nd, "rmsnorm_backward");
  op("add_inplace (residual grad)", 2 * L, 3 * nd, "");
  op("rope_backward q", L, rope * s.H, "rope_backward");
  op("rope_backward k", L, rope * s.KVH, "");
  op("embedding_backward", 1, s.N * s.D * (s.es + 8), "embedding_backward");
  op("zero grads", 1, 4 * params, "");
  op("sum_squares (grad norm)", 2, 2 * params, "");
  // AdamW reads param, grad, m, v (fp32), writes param, m, v and the bf16 compute copy: 30 B each.
  op("adamw_step (per tensor)", tensors, 30 * params / tensors, "");
}
}  // namespace

StepPrediction predict_01_step(const Gpu& g, const KernelRates& r, const ModelConfig& m, int micro_batch,
                               AttnRung rung) {
  const double hd = m.head_dim();
  const Shape s{double(micro_batch), double(m.seq), double(micro_batch) * m.seq, double(m.dim), double(m.ffn),
                double(m.vocab), double(m.heads), double(m.kv_heads), hd, double(m.layers), 2};
  StepPrediction p;
  auto& k = p.kernels;
  add_linear(k, s, "D->D (q, o)", s.D, s.H * hd, 2 * s.L, "", "");
  add_linear(k, s, "D->KV (k, v)", s.D, s.KVH * hd, 2 * s.L, "", "");
  add_linear(k, s, "D->F (gate, up)", s.D, s.F, 2 * s.L, "linear_forward D->F", "linear_backward D->F");
  add_linear(k, s, "F->D (down)", s.F, s.D, s.L, "", "");
  add_linear(k, s, "D->V (head)", s.D, s.V, 1, "", "");
  add_attention(k, s, rung);
  const ParamTable t = Model::make_table(m);
  add_streaming(k, s, double(t.total), double(t.entries.size()));
  // v1's FLOPs are fp32 FMAs on CUDA cores (128 per clock per SM); v2's and the GEMMs' run on tensor cores.
  const double cuda_cores = r.sms * r.clock_ghz * 1e9 * 256, peak = g.peak_tflops * 1e12;
  for (KernelCost& c : k) {
    const bool v1 = c.smem_instr > 0, v2 = c.name.rfind("flash_v2", 0) == 0 || c.name == "attention_forward v2";
    const double rate = v1 ? cuda_cores
                        : v2 ? peak * (c.name == "attention_forward v2" ? r.v2_fwd_fraction : r.v2_bwd_fraction)
                             : peak * r.gemm_fraction;
    price(c, g, r, rate);
    p.step_s += c.calls * c.seconds;
  }
  p.tokens_per_s = s.N / p.step_s;
  p.mfu = model_flops_utilization(m, p.tokens_per_s, g.peak_tflops);
  return p;
}

}  // namespace ts
