// step_time.cu — the hardware tables, the calibration and the pieces of step_time.h.
#include "training/step_time.h"
#include "training/config_flags.h"
#include "training/report.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <filesystem>
#include <fstream>

namespace ts {

// Latency: the order of NCCL-tests' small-message times on such clusters (not calibrated here).
const Network& h100_network() {
  static const Network n{{1, 2, 4, 8, 16, 32, 64},
                         {436.0, 361.7, 160.1, 99.6, 84.7, 64.9, 32.9},
                         {249.8, 184.6, 119.0, 69.0, 55.0, 28.0, 11.0},
                         {249.7, 181.6, 115.8, 68.6, 54.5, 27.9, 11.1},
                         50,  // 8 × 400 Gb/s NICs per node of 8 GPUs
                         20e-6,
                         40e-6};
  return n;
}

// The A100's network: the H100 table scaled by NVLink 3 / NVLink 4 (600 / 900 GB/s) inside a node
// and by 200 / 400 Gb/s NICs across nodes (an assumption: no measurement of our own).
Network scaled(const Network& n, double intra, double inter) {
  Network s = n;
  for (auto* v : {&s.all_reduce, &s.all_gather, &s.reduce_scatter})
    for (size_t i = 0; i < v->size(); i++) (*v)[i] *= i == 0 ? intra : inter;
  s.p2p_inter_gbs *= inter;
  return s;
}

constexpr double kHopperFp8Speedup = 1.75;
const Gpu* find_gpu(const std::string& name) {
  static const std::vector<Gpu> kGpus = {
      // FP8 GEMMs on Hopper: 1.75× bf16's for large matmuls with 128-element block scaling, DeepSeek-V3's
      // recipe (NVIDIA, "Boosting Matrix Multiplication Speed and Flexibility with NVIDIA cuBLAS 12.9",
      // 2025; the datasheet's dense peaks, 1979 and 989 TFLOP/s, would say 2); the A100 has no FP8.
      // SMs: 132 on the H100 SXM5 and its H200 and H800 variants, 108 on the A100 (NVIDIA's Hopper
      // and Ampere architecture whitepapers).
      {"h100", 80, 989, 3350, kH100Achievable, h100_network(), "", kHopperFp8Speedup, 132},
      {"h200", 141, 989, 4800, kH100Achievable, h100_network(), "", kHopperFp8Speedup, 132},
      {"a100", 80, 312, 2039, kH100Achievable, scaled(h100_network(), 600.0 / 900, 0.5), "", 1, 108},
      // The H800: an H100 SXM with NVLink cut to 400 GB/s (NVIDIA's H800 datasheet), the same
      // compute and HBM3; across nodes DeepSeek-V3's cluster has the H100's 400 Gb/s InfiniBand
      // per GPU (technical report §3.1: "IB (50 GB/s)").
      {"h800", 80, 989, 3350, kH100Achievable, scaled(h100_network(), 400.0 / 900, 1.0), "", kHopperFp8Speedup, 132}};
  for (const Gpu& g : kGpus)
    if (name == g.name) return &g;
  return nullptr;
}

// The rate one rank reaches on a whole training step of 01 (F × tokens/s, so the non-matmul work
// is in it and the achievable fraction is 1), and the bus bandwidths and small-message latency of
// bench_comm at 2 ranks. One "node": every rank on this machine.
//   {"gflops": 21.3, "memory_gib": 7.7, "all_reduce_gbs": 0.9, "all_gather_gbs": 0.6,
//    "reduce_scatter_gbs": 0.5, "latency_s": 2e-05}
static Json read_json_file(const char* flag, const std::string& path, const char* hint) {
  std::ifstream f(path);
  if (!f) config_error("%s: cannot read %s%s", flag, path.c_str(), hint);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  try {
    return Json::parse(text);
  } catch (const FormatError& e) {
    config_error("%s %s: %s", flag, path.c_str(), e.what());
  }
}
static double positive(const Json& j, const std::string& key) {
  const double v = j.as_double();
  if (!(v > 0)) throw FormatError(key + " must be > 0");
  return v;
}
static double positive_at(const Json& j, const char* key) { return positive(j.at(key), key); }

// The bus bandwidths and latencies of a calibration or --network file (the same keys).
static Network parse_network(const Json& j, const std::string& source) {
  Network n;
  if (j.contains("nodes"))
    for (const Json& v : j.at("nodes").as_array()) n.nodes.push_back(positive(v, "nodes"));
  else
    n.nodes = {1};
  if (n.nodes[0] != 1) throw FormatError("nodes must start at 1");
  for (size_t i = 1; i < n.nodes.size(); i++)
    if (n.nodes[i] <= n.nodes[i - 1]) throw FormatError("nodes must increase");
  for (auto [key, v] : {std::pair{"all_reduce_gbs", &n.all_reduce}, {"all_gather_gbs", &n.all_gather},
                        {"reduce_scatter_gbs", &n.reduce_scatter}}) {
    const Json& x = j.at(key);
    if (x.is_array())
      for (const Json& e : x.as_array()) v->push_back(positive(e, key));
    else
      v->push_back(positive(x, key));
    if (v->size() != n.nodes.size())
      throw FormatError(std::string(key) + " has " + std::to_string(v->size()) + " values for " +
                        std::to_string(n.nodes.size()) + " node counts");
  }
  n.latency_intra_s = positive_at(j, "latency_s");
  n.latency_inter_s = j.contains("latency_inter_s") ? positive_at(j, "latency_inter_s") : n.latency_intra_s;
  n.p2p_inter_gbs = j.contains("p2p_inter_gbs") ? positive_at(j, "p2p_inter_gbs") : n.all_gather.back();
  n.source = source;
  return n;
}

Gpu local_gpu(const std::string& path) {
  const Json j = read_json_file("--calibration", path, " (make bench writes it; or pass --calibration FILE)");
  try {
    // Memory bandwidth is not measured: the roofline is left out (the step rate already holds it).
    Gpu g{"local", positive_at(j, "memory_gib"), positive_at(j, "gflops") / 1e3, 1e9, 1.0,
          parse_network(j, "measured here by make bench")};
    if (j.contains("model")) {
      if (!j.at("model").is_string()) throw FormatError("model must be a string (01's model flags)");
      g.measured_on = j.at("model").as_string();
    }
    return g;
  } catch (const FormatError& e) {
    config_error("--calibration %s: %s", path.c_str(), e.what());
  }
}

Network read_network(const std::string& path) {
  const Json j = read_json_file("--network", path, "");
  try {
    return parse_network(j, path);
  } catch (const FormatError& e) {
    config_error("--network %s: %s", path.c_str(), e.what());
  }
}

std::string beyond_table(const Network& n, int nodes) {
  const double last = n.nodes.back();
  if (nodes <= last) return "";
  char b[600];
  snprintf(b, sizeof b,
           "assumed beyond the measured %g nodes (%s), for groups spanning up to %d: the last values held, all-reduce "
           "%.1f, all-gather %.1f, reduce-scatter %.1f GB/s (a ring's bus bandwidth does not depend on its ranks in the "
           "α–β model; how a larger fabric falls short of that is not known here); a cluster's own: --network FILE",
           last, n.source.c_str(), nodes, n.all_reduce.back(), n.all_gather.back(), n.reduce_scatter.back());
  return b;
}

std::string default_calibration_path() {
  std::error_code e;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", e);
  return ((e ? std::filesystem::path("build") : exe.parent_path()) / "calibration.json").string();
}

static constexpr const char* kCalibrationHelp =
    "this machine as make bench measured it (the file it writes; default: calibration.json beside the binary): "
    "the rates the run's predicted step time uses";

Calibration read_calibration(Args& a) {
  Calibration c;
  // The default is recorded as "" (trainer.json keeps every flag): a run repeated from its
  // checkpoint on another machine, or from another build folder, looks beside its own binary.
  const std::string previous = a.group("operations");
  const std::string named = a.get_str("--calibration", "", kCalibrationHelp);
  a.group(previous);
  const bool given = !named.empty();
  c.path = given ? named : default_calibration_path();
  if (given || std::filesystem::exists(c.path)) {
    c.gpu = local_gpu(c.path);
    c.found = true;
    if (!c.gpu.measured_on.empty()) {  // flags a run would refuse are refused here, before any step
      const ConfigErrorWhere where("--calibration " + c.path + ": model");
      c.model = model_of_flags(c.gpu.measured_on);
    }
  }
  return c;
}

// The table, linear in log2(nodes) between its points; past its last point the last value holds
// (an assumption, printed by beyond_table: in the α–β model a ring's bus bandwidth does not depend
// on the number of ranks, so the fall the table shows is its own fabric at its own sizes; carried
// on ∝ 1/nodes it would put a 2048-node all-reduce at 1 GB/s, a fiftieth of one NIC).
double bus_bandwidth(const Network& n, Collective op, int nodes) {
  if (op == Collective::P2P) return nodes > 1 ? n.p2p_inter_gbs : n.all_gather[0];
  const std::vector<double>& bw = op == Collective::AllReduce ? n.all_reduce
                                  : op == Collective::AllGather ? n.all_gather
                                                                : n.reduce_scatter;
  const size_t last = n.nodes.size() - 1;
  if (nodes >= n.nodes[last]) return bw[last];
  size_t i = 0;
  while (i + 1 < last && n.nodes[i + 1] <= nodes) i++;
  const double f = (std::log2(double(nodes)) - std::log2(n.nodes[i])) / (std::log2(n.nodes[i + 1]) - std::log2(n.nodes[i]));
  return bw[i] + std::max(0.0, f) * (bw[i + 1] - bw[i]);
}

// A latency per call plus bytes over bandwidth (Hockney 1994, as NCCL-tests' "time ≈ overhead +
// size / bw").
double collective_seconds(const Network& n, Collective op, double wire_bytes, double calls, int nodes) {
  if (wire_bytes <= 0) return 0;
  if (n.price && op != Collective::P2P) return n.price(op, wire_bytes, calls, nodes);
  return calls * (nodes > 1 ? n.latency_inter_s : n.latency_intra_s) + wire_bytes / (bus_bandwidth(n, op, nodes) * 1e9);
}

Collective collective_of(const std::string& op) {
  return op == "all_reduce" ? Collective::AllReduce
         : op == "all_gather" ? Collective::AllGather
         : op == "reduce_scatter" ? Collective::ReduceScatter
                                  : Collective::P2P;
}

double group_seconds(const Network& n, const std::map<std::string, double>& ops, double calls, int nodes,
                     const char* only) {
  if (ops.empty()) return 0;
  double t = 0;
  for (auto& [op, bytes] : ops)
    if (!only || op == only) t += collective_seconds(n, collective_of(op), bytes, calls / double(ops.size()), nodes);
  return t;
}

// Equal bytes are an equal model: ModelConfig is plain numbers (a mismatch of bytes only recounts).
double flops_per_token_of(const ModelConfig& m) {
  static_assert(std::is_trivially_copyable_v<ModelConfig>, "compared bytewise");
  thread_local ModelConfig last;
  thread_local double flops = -1;
  if (flops < 0 || std::memcmp(&last, &m, sizeof m) != 0) last = m, flops = flops_per_token(m);
  return flops;
}

// Tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide", §3): cuBLAS
// computes the m×n output in tiles, one thread block each, padded at the edges, and runs them in
// waves of one block per SM, the last wave partly empty. The guide names 256×128 and 128×256 as
// cuBLAS's most efficient tiles and 128×128 as the next. A short, wide-k shape can also split k
// over 2 or 4 blocks per tile (cuBLASLt's split-K), filling more of the waves for a second pass
// that reads the s fp32 partials and writes the output at memory bandwidth. The fraction of the
// achievable rate the best of these reaches: ~0.97 for large shapes (16384 rows by 3072: 12 waves,
// the last 64% full); 0.82 for a 1,024-row shard by 2,304 columns over k = 16,384 (split 4: 576
// blocks in 5 waves, less the 42 MB pass) where unsplit it would fill 55% (144 tiles in 2 waves).
double wave_efficiency(const Gpu& g, double m, double k, double n, double elem_bytes) {
  if (g.sms <= 0) return 1;
  const double ideal = 2 * m * k * n / (g.peak_tflops * 1e12 * g.achievable);  // every wave full
  double best = 0;
  for (const auto& [tm, tn] : {std::pair{256.0, 128.0}, {128.0, 256.0}, {128.0, 128.0}})
    for (const double split : {1.0, 2.0, 4.0}) {
      const double blocks = std::ceil(m / tm) * std::ceil(n / tn) * split;
      const double fill = m * n * split / (std::ceil(blocks / g.sms) * g.sms * tm * tn);
      const double pass = split > 1 ? (4 * split + elem_bytes) * m * n / (g.hbm_gbs * 1e9) : 0;
      best = std::max(best, ideal / (ideal / fill + pass));
    }
  return best;
}

// The roofline (Williams, Waterman & Patterson 2009): a matmul of m×k by k×n runs at
// min(achievable peak × the waves' fill, arithmetic intensity × memory bandwidth).
double matmul_efficiency(const Gpu& g, double m, double k, double n, double elem_bytes) {
  const double intensity = 2 * m * k * n / (elem_bytes * (m * k + k * n + m * n));  // FLOPs per byte moved
  return std::min(g.achievable * wave_efficiency(g, m, k, n, elem_bytes), intensity * g.hbm_gbs / (g.peak_tflops * 1e3));
}

// The layer's matmuls (q,k,v; o; gate,up; down), weighted by their FLOPs. SP gathers a tp group's
// tokens before each matmul, so the rows are the micro-batch's tokens on this cp rank.
double layer_efficiency(const Gpu& g, const ModelConfig& m, double tokens, int tp, double elem_bytes) {
  const double h = m.dim, kv = double(m.kv_heads) * (m.dim / m.heads), f = m.ffn;
  const double shapes[][2] = {{h, (h + 2 * kv) / tp}, {h / tp, h}, {h, 2 * f / tp}, {f / tp, h}};
  double flops = 0, seconds = 0;
  for (const auto& s : shapes) {
    const double w = tokens * s[0] * s[1];
    flops += w;
    seconds += w / matmul_efficiency(g, tokens, s[0], s[1], elem_bytes);
  }
  return flops / seconds;
}

// Full recompute runs all of the forward again (8N instead of 6N per token, Korthikanti et al.
// 2022); selective the attention core (its 4·s·h of the 12·s·h FLOPs per layer and token that run
// forward).
double recompute_factor(const ModelConfig& m, Recompute r) {
  const double F = flops_per_token_of(m), attn_forward = 4.0 * m.layers * m.dim * double(m.seq);
  return r == Recompute::Full ? 1 + (F / 3) / F : r == Recompute::Selective ? 1 + attn_forward / F : 1.0;
}

double fp8_speedup(const Gpu& g, const RunConfig& rc) {
  return rc.fp8.recipe != Fp8Recipe::Off ? g.fp8_gemm_speedup : 1.0;
}

// F = 6N + 12·L·h·s with N the parameters past the embedding: take out the core, the head (V·h)
// and, with experts, the router (L·h·E).
double fp8_flops_per_token(const ModelConfig& m) {
  const double core = 12.0 * m.layers * m.dim * double(m.seq), head = double(m.vocab) * m.dim;
  const double router = double(m.layers) * m.dim * m.experts;
  return flops_per_token_of(m) - core - 6 * (head + router);
}

// Bucket by bucket as gradients become ready (PyTorch DDP, Li et al. 2020; the playbook's "overlap
// with backward").
double reduction_exposed(double t_reduce, double t_window, double last_bucket_share) {
  return std::max(t_reduce - t_window, t_reduce * std::min(1.0, last_bucket_share));
}

double attention_share(const ModelConfig& m) { return 12.0 * m.layers * m.dim * double(m.seq) / flops_per_token_of(m); }

StepTerms compute_terms(const Gpu& g, const RunConfig& rc, int tp, int cp, int pp, int gpus) {
  const ModelConfig& m = rc.model;
  StepTerms s;
  s.pipeline = pp > 1;
  s.efficiency = layer_efficiency(g, m, double(rc.micro_batch) * m.seq / cp, tp, dtype_size(rc.dtype));
  const double tokens = double(rc.batch) * m.seq;
  // FP8's GEMMs (their forward again under full recomputation) at fp8_speedup times the rate.
  const double fp8 = fp8_flops_per_token(m) * (rc.recompute == Recompute::Full ? 4.0 / 3 : 1.0);
  s.priced_flops = flops_per_token_of(m) * recompute_factor(m, rc.recompute) - fp8 * (1 - 1 / fp8_speedup(g, rc));
  s.t_compute = s.priced_flops * tokens / gpus / (g.peak_tflops * 1e12 * s.efficiency);
  return s;
}

// ----- the MoE term ---------------------------------------------------------------------------------------

// Per layer: the router's D×E matmul and K routed plus S shared SwiGLU experts of width F_e
// (gate, up, down: 3·D·F_e parameters each), 6 FLOPs per parameter and token (flops_per_token's).
double moe_flops_per_token(const ModelConfig& m) {
  if (m.experts == 0) return 0;
  const double D = m.dim, F = m.expert_width();
  return 6.0 * m.layers * D * (m.experts + 3.0 * F * (m.top_k + m.shared_experts));
}

// Full recomputation runs every MoE block's forward again (2 of its 6 FLOPs: 8/6); selective
// reruns only the attention core.
static double moe_recompute(Recompute r) { return r == Recompute::Full ? 4.0 / 3 : 1.0; }

// A SwiGLU of width F over `rows` rows: gate and up (D → 2F, 2/3 of its FLOPs), down (F → D, 1/3),
// each at its roofline efficiency; the seconds for `flops` of it.
static double swiglu_seconds(const Gpu& g, double flops, double rows, double D, double F, double e) {
  const double up = matmul_efficiency(g, rows, D, 2 * F, e), down = matmul_efficiency(g, rows, F, D, e);
  return flops * (2.0 / 3 / up + 1.0 / 3 / down) / (g.peak_tflops * 1e12);
}

// Row passes of D elements per routed row and layer, read or written, outside the matmuls
// (common/model/moe.cu): forward, the gather into expert order (2) and the weighted combine
// (1); backward, the weighted gather of dy (2), the gate weights' dot products (2) and the
// combine of dx (1). Expert parallelism adds the owner's grouping and ungrouping gathers, 2 + 2
// each way.
static double row_passes(int ep) { return ep > 1 ? 16 : 8; }

MoeTerms moe_terms(const Gpu& g, const RunConfig& rc, const MoeShape& x) {
  const ModelConfig& m = rc.model;
  MoeTerms t;
  if (m.experts == 0) return t;
  const double D = m.dim, E = m.experts, K = m.top_k, F = m.expert_width(), e = dtype_size(rc.dtype);
  const double work = x.tokens * x.layers * moe_recompute(rc.recompute);  // token-layers, forward reruns in
  const double mb = double(rc.micro_batch) * m.seq;                       // one micro-batch's tokens
  t.imbalance = x.imbalance;
  t.router_s = 6 * D * E * work / (g.peak_tflops * 1e12 * matmul_efficiency(g, mb, D, E, e));
  // Balanced, an expert receives K/E of the micro-batch tokens of each of the ep ranks.
  const double fp8 = fp8_speedup(g, rc);  // the experts are linear layers: FP8 under --dtype fp8
  t.experts_s = x.imbalance * swiglu_seconds(g, 18 * D * F * K * work, mb * K * x.ep / E, D, F, e) / fp8;
  if (m.shared_experts > 0)
    t.shared_s = swiglu_seconds(g, 18 * D * F * m.shared_experts * work, mb, D, F * m.shared_experts, e) / fp8;
  t.copies_s = row_passes(x.ep) * D * e * K * work * x.imbalance / (g.hbm_gbs * 1e9);
  for (const DispatchLevel& l : x.dispatch) {
    t.level_s.push_back(collective_seconds(g.net, Collective::P2P, l.bytes, l.calls, l.nodes));
    t.dispatch_s += t.level_s.back();
  }
  return t;
}

void add_moe_term(StepTerms& s, const Gpu& g, const RunConfig& rc, const MoeShape& x) {
  if (rc.model.experts == 0) return;
  s.moe = moe_terms(g, rc, x);
  // compute_terms priced every FLOP at the dense layer's efficiency, spread over every rank:
  // take out the MoE blocks' share of it, forward reruns counted alike, and put in their own.
  const ModelConfig& m = rc.model;
  const double router = 6.0 * m.layers * m.dim * m.experts;  // bf16 under fp8 too; the experts at fp8's rate
  const double share = (router + (moe_flops_per_token(m) - router) / fp8_speedup(g, rc)) * moe_recompute(rc.recompute) /
                       s.priced_flops;
  s.t_moe = s.moe.compute();
  s.t_compute += s.t_moe - share * s.t_compute;
  s.t_ep = s.moe.dispatch_s;
}

void print_assumptions(RunLog& log, const Gpu& g) {
  if (g.name == "local") {
    const std::string on = g.measured_on.empty() ? "" : " (01 with " + g.measured_on + ")";
    log.line("assumed (measured here by make bench): a training step's FLOPs at %.1f GFLOP/s per rank%s; bus bandwidth "
             "all-reduce %.2f, all-gather %.2f, reduce-scatter %.2f GB/s; %.0f µs per call", 1e3 * g.peak_tflops, on.c_str(),
             g.net.all_reduce[0], g.net.all_gather[0], g.net.reduce_scatter[0], 1e6 * g.net.latency_intra_s);
    return;
  }
  log.line("assumed: matmuls at up to %.0f%% of %.0f TFLOP/s (roofline at %.0f GB/s); bus bandwidth by nodes spanned, "
           "%s (all-reduce %.0f GB/s in a node, %.1f across %g nodes); %.0f/%.0f µs per call in/across nodes",
           100 * g.achievable, g.peak_tflops, g.hbm_gbs, g.net.source.c_str(), g.net.all_reduce[0], g.net.all_reduce.back(),
           g.net.nodes.back(), 1e6 * g.net.latency_intra_s, 1e6 * g.net.latency_inter_s);
}

// "measured 12.3 ms (median of …)" and the summary's measured fields.
static std::string measured_text(const StepTimes& t, Json& j) {
  j["measured_s"] = t.median_s;
  j["warmup_s"] = t.warmup_s;
  j["measured_steps"] = double(t.measured);
  char measured[200];
  if (t.measured > 0)
    snprintf(measured, sizeof measured, "measured %.1f ms (median of the %zu steps after the warm-up step %ld, which took %.1f ms)",
             1e3 * t.median_s, t.measured, t.first_step, 1e3 * t.warmup_s);
  else
    snprintf(measured, sizeof measured, "measured %.1f ms (the warm-up step alone: run more --steps)", 1e3 * t.median_s);
  return measured;
}

// "compute 1.2 + tp 0.3 + …": the terms that are not zero, in ms.
static std::string terms_text(const StepTerms& c, const std::string& dense) {
  std::string terms;
  auto term = [&](const char* fmt, double a, double b = 0) {
    char s[96];
    snprintf(s, sizeof s, fmt, 1e3 * a, 1e3 * b);
    terms += (terms.empty() ? "" : " + ") + std::string(s);
  };
  term("compute %.1f", c.t_compute);
  if (c.t_tp > 0) term("tp %.1f", c.t_tp);
  if (c.t_cp > 0) term("cp %.1f exposed (of %.1f)", c.t_cp_exposed, c.t_cp);
  if (c.t_dp > 0) term((dense + " %.1f exposed (of %.1f)").c_str(), c.t_dp_exposed, c.t_dp);
  if (c.pipeline) term("bubble %.1f", c.t_bubble);
  if (c.t_pp > 0) term("pp p2p %.1f", c.t_pp);
  if (c.t_ep > 0) term("ep all-to-all %.1f", c.t_ep);
  return terms;
}

// The MoE blocks' part of the compute term, piece by piece.
static void print_moe(RunLog& log, const StepTerms& c) {
  const MoeTerms& t = c.moe;
  log.line("  of compute, the MoE blocks %.1f ms = router %.1f + experts %.1f (the busiest ep rank's rows, %.3f × "
           "balanced routing's) + shared experts %.1f + row copies %.1f",
           1e3 * c.t_moe, 1e3 * t.router_s, 1e3 * t.experts_s, t.imbalance, 1e3 * t.shared_s, 1e3 * t.copies_s);
}

// Every run that prints it is a test of the model: a miss names the term that missed.
Json step_time_report(RunLog& log, const RunConfig& rc, const Calibration& cal, Device dev, const std::string& dense,
                      const std::function<StepTerms(const Gpu&)>& predict, const StepTimes& t) {
  Json j = Json::object();
  const double tokens = double(rc.batch) * rc.model.seq;
  const std::string measured = measured_text(t, j);
  const std::string why = !cal.found ? "no calibration of this machine at " + cal.path +
                                           " (make bench writes it; or pass --calibration FILE)"
                          : dev != Device::CPU ? "make bench calibrates the CPU (01 --device cpu); this run is on " +
                                                     std::string(device_name(dev))
                                               : "";
  if (!why.empty()) {
    log.line("step time: %s; not predicted: %s", measured.c_str(), why.c_str());
    return j;
  }
  const StepTerms c = predict(cal.gpu);
  log.line("step time: predicted %.1f ms = %s ms; %s; measured/predicted %.2f", 1e3 * c.step,
           terms_text(c, dense).c_str(), measured.c_str(), t.median_s / c.step);
  log.line("  %.0f tokens/s predicted, %.0f measured: the step-time model (common/training/step_time.h) with %s",
           tokens / c.step, tokens / t.median_s, cal.path.c_str());
  if (c.t_moe > 0) print_moe(log, c);
  print_assumptions(log, cal.gpu);
  if (!cal.gpu.measured_on.empty() && !same_cost_shape(cal.model, rc.model))
    log.line("  that rate is 01's on another model than this run's: a model runs at its own rate (notes/07, \"Which "
             "rate\"); --calibration FILE measured on this run's model prices it");
  j["calibration"] = cal.path;
  if (!cal.gpu.measured_on.empty()) j["calibration_model"] = cal.gpu.measured_on;
  const std::pair<const char*, double> terms_json[] = {
      {"predicted_s", c.step},        {"compute_s", c.t_compute},       {"tp_s", c.t_tp},
      {"cp_s", c.t_cp},               {"cp_exposed_s", c.t_cp_exposed}, {"dp_s", c.t_dp},
      {"dp_exposed_s", c.t_dp_exposed}, {"bubble_s", c.t_bubble},       {"pp_s", c.t_pp},
      {"ep_s", c.t_ep},               {"predicted_tokens_per_s", tokens / c.step},
      {"measured_tokens_per_s", tokens / t.median_s}};
  for (const auto& [key, v] : terms_json) j[key] = v;
  if (c.t_moe > 0)  // of compute_s; only a MoE run has these keys
    for (const auto& [key, v] : {std::pair{"moe_s", c.t_moe}, {"moe_router_s", c.moe.router_s},
                                 {"moe_experts_s", c.moe.experts_s}, {"moe_shared_s", c.moe.shared_s},
                                 {"moe_copies_s", c.moe.copies_s}, {"moe_imbalance", c.moe.imbalance}})
      j[key] = v;
  return j;
}

void predict_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Calibration& cal, Device dev,
                       const std::string& dense, std::function<StepTerms(const Gpu&)> predict) {
  loop.step_time = [&log, rc, cal, dev, dense, predict](const StepTimes& t) {
    return step_time_report(log, rc, cal, dev, dense, predict, t);
  };
}

}  // namespace ts
