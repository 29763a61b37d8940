// lab/08_frontier.h — what the frontier's training stacks overlap that 02–07 run one after the other,
// priced by `--plan --frontier LIST` (notes/08, "The frontier's overlaps, priced"). Nothing here runs:
// each function takes a term step_terms composed from the chapters and says how much of it a stack
// that overlaps it would still show, after the paper or framework that does it.
//
//   async-tp     each sequence-parallel all-gather and reduce-scatter cut into tp ring steps, each
//                step's transfer hidden behind the GEMM on the shard in hand (Wang et al., ASPLOS
//                2023, "collective matmul"; Megatron-LM's --tp-comm-overlap; torchtitan's async TP)
//   a2a-overlap  the expert all-to-all behind the other micro-batch's compute, its two hops (across
//                nodes, then NVLink) at once (DeepSeek-V3 report §3.2.1–3.2.2, DualPipe)
//   dp-overlap   each chunk's reduce-scatter launched as its last backward ends, each unit's gather
//                waited for only by its own first forward (Megatron-LM's distributed optimizer,
//                --overlap-grad-reduce and --overlap-param-gather)
//   flash        the attention core as a fused kernel runs it: its masked half skipped, at that
//                kernel's own efficiency (FlashAttention-2, Dao 2023; FlashAttention-3, Shah et al. 2024)
#ifndef TS_LAB_08_FRONTIER_H
#define TS_LAB_08_FRONTIER_H
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "training/step_time.h"

namespace mesh5d {
using namespace ts;

struct Frontier {
  bool async_tp = false, a2a_overlap = false, dp_overlap = false, flash = false;
  bool any() const { return async_tp || a2a_overlap || dp_overlap || flash; }
};

// "async-tp,a2a-overlap" (or "all", or "none"); an unknown name is a config error.
inline Frontier parse_frontier(const std::string& list) {
  Frontier f;
  size_t at = 0;
  while (at <= list.size() && !list.empty()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string x = list.substr(at, end - at);
    if (x == "all") f = {true, true, true, true};
    else if (x == "async-tp") f.async_tp = true;
    else if (x == "a2a-overlap") f.a2a_overlap = true;
    else if (x == "dp-overlap") f.dp_overlap = true;
    else if (x == "flash") f.flash = true;
    else if (x != "none")
      config_error("--frontier: unknown '%s' (async-tp, a2a-overlap, dp-overlap, flash, all or none)", x.c_str());
    at = end + 1;
  }
  return f;
}

// The attention core's forward is 4·s·h FLOPs per layer and token of the 12·s·h that
// flops_per_token counts with its backward (PaLM's convention, the MFU's numerator), and the forward
// that recomputation reruns includes the core's (4·s·h more). compute_terms prices them all at the
// GEMMs' efficiency. A fused attention kernel runs them otherwise: a causal mask leaves half of the
// score blocks, which FlashAttention-2 skips (Dao 2023, §3.1.1), and it reaches 35% of the H100's
// bf16 peak (Shah et al. 2024, FlashAttention-3, abstract: "FlashAttention-2 achieving only 35%
// utilization on the H100 GPU"), the kernel of the stacks that trained the records here.
// t_compute and priced_flops change together, so the MoE term's share of them stays right.
constexpr double kFlashAttentionEfficiency = 0.35;
inline void flash_attention(StepTerms& s, const RunConfig& rc) {
  const ModelConfig& m = rc.model;
  const double core = 4.0 * m.layers * m.dim * double(m.seq), run = 3 * core + (rc.recompute != Recompute::None ? core : 0);
  const double priced = s.priced_flops - run + 0.5 * run * s.efficiency / kFlashAttentionEfficiency;
  s.t_compute *= priced / s.priced_flops;
  s.priced_flops = priced;
}

// One sequence-parallel collective against the GEMM it is decomposed with, per layer and
// micro-batch: {its time whole, on the critical path (04's pricing); what shows when it runs as tp
// ring steps of K/tp bytes, each behind the GEMM on one row block of the shard in hand}. The pieces
// run one after the other: t_piece + (tp − 1)·max(t_step, t_piece), of which the GEMM whole
// (t_full, in t_compute) was already priced; tp smaller GEMMs run below the whole one's rate where
// the roofline says so (matmul_efficiency at rows/tp). Each ring step pays its latency.
struct Overlapped {
  double whole = 0, exposed = 0;
};
inline Overlapped decompose(const Gpu& g, const RunConfig& rc, Collective op, double rows, double k, double n, int tp,
                            int nodes) {
  const double K = rows * rc.model.dim * dtype_size(rc.dtype), e = dtype_size(rc.dtype);
  const double bw = bus_bandwidth(g.net, op, nodes) * 1e9, alpha = nodes > 1 ? g.net.latency_inter_s : g.net.latency_intra_s;
  auto gemm = [&](double m) { return 2 * m * k * n / (g.peak_tflops * 1e12 * matmul_efficiency(g, m, k, n, e) * fp8_speedup(g, rc)); };
  const double t_full = gemm(rows), t_piece = gemm(rows / tp), t_step = alpha + K / tp / bw;
  Overlapped o;
  o.whole = alpha + (tp - 1.0) / tp * K / bw;
  o.exposed = (tp - 1) * std::max(0.0, t_step - t_piece) + std::max(0.0, tp * t_piece - t_full);
  o.exposed = std::min(o.exposed, o.whole);  // where the pieces' waves lose more than the ring hides: 04's blocking
  return o;
}

// A layer's ten: forward, the all-gather before q,k,v and before gate,up and the reduce-scatter
// after o and after down; backward, the all-gathers of dY before o's and down's dgrad and of X
// again before q,k,v's and gate,up's (the wgrad needs it gathered), and the reduce-scatters of dX
// after q,k,v's and gate,up's dgrad, each behind the GEMM beside it (dgrad and wgrad do the
// forward's FLOPs). Per layer and micro-batch at `rows` tokens (this cp rank's micro-batch).
inline Overlapped async_tp_layer(const Gpu& g, const RunConfig& rc, double rows, int tp, int nodes) {
  const ModelConfig& m = rc.model;
  const double h = m.dim, kv = double(m.kv_heads) * (m.dim / m.heads), f = m.ffn;
  const double shapes[4][2] = {{h, (h + 2 * kv) / tp}, {h / tp, h}, {h, 2 * f / tp}, {f / tp, h}};  // qkv, o, gate-up, down
  const std::pair<int, Collective> pairs[] = {
      {0, Collective::AllGather}, {1, Collective::ReduceScatter}, {2, Collective::AllGather},
      {3, Collective::ReduceScatter}, {3, Collective::AllGather}, {2, Collective::AllGather},
      {2, Collective::ReduceScatter}, {1, Collective::AllGather}, {0, Collective::AllGather},
      {0, Collective::ReduceScatter}};
  Overlapped sum;
  for (const auto& [i, op] : pairs) {
    const Overlapped o = decompose(g, rc, op, rows, shapes[i][0], shapes[i][1], tp, nodes);
    sum.whole += o.whole, sum.exposed += o.exposed;
  }
  return sum;
}

// Megatron's overlapped DP under a pipeline of V chunks per rank: each chunk's reduce-scatter (or
// all-reduce) leaves as that chunk's last backward ends, so of the reduction the last micro-batch's
// backward could not hide (the chapters' rule, `rs_exposed`) only the last chunk's 1/V is left; the
// next step's forward of a unit waits only for that unit's gather, so the gathers show only where
// they outlast the forwards of the first min(m, p) micro-batches, and at least the first unit's.
inline double dp_overlap_exposed(double rs_exposed, double ag, double t_compute, double mbs, int pp, int V, int units) {
  const double window = t_compute / 3 * std::min(mbs, double(pp)) / std::max(1.0, mbs);
  const double ag_exposed = ag > 0 ? std::max(ag / std::max(1, units), ag - window) : 0;
  return rs_exposed / std::max(1, V) + ag_exposed;
}

// DualPipe: a micro-batch's dispatch and combine run while the other micro-batch it is paired with
// computes, and the hop across nodes and the NVLink forward of the chunk before run at once; what
// shows is what outlasts the compute. The communication kernels hold 20 of the GPU's SMs all the
// while (DeepSeek-V3 §3.2.2), so on an H800's 132 (Gpu::sms) the compute beside them runs on the
// other 112 (a GPU without an SM count gives none up). Returns the all-to-all's exposed seconds;
// slows s.t_compute.
constexpr int kCommSms = 20;
inline double overlap_all_to_all(StepTerms& s, const Gpu& g) {
  if (g.sms > kCommSms) s.t_compute *= double(g.sms) / (g.sms - kCommSms);
  const std::vector<double>& l = s.moe.level_s;
  const double t = l.size() > 1 ? *std::max_element(l.begin(), l.end()) : s.t_ep;
  return std::max(0.0, t - s.t_compute);
}

// DeepSeek-V3 §3.3.2–3.3.4: the dispatch forward and the combine's backward (the gradient before
// the down-projection) cross in FP8 with one fp32 scale per 128 elements, the combine forward and
// the dispatch's backward in bf16: of the four crossings' bf16 bytes, this share.
constexpr double kFp8DispatchShare = (2 * (1 + 4.0 / 128) + 2 * 2) / 8;

}  // namespace mesh5d
#endif  // TS_LAB_08_FRONTIER_H
