// lab/08_nccl_tuner.h — the planner's collectives priced as NCCL's tuner prices them: per call, by
// message size, ranks and nodes, the cheaper of ring and tree (all-reduce) and of NCCL's three
// protocols, with each algorithm's own latency terms (notes/08, "Which algorithm NCCL runs").
//
// NCCL's cost model (src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime, NVIDIA/nccl at
// 5067397c) gives each (collective, algorithm, protocol) a latency and a bandwidth and picks the
// least `latency + bytes / bandwidth`. This file writes that model out for what a training step
// issues (all-reduce, all-gather, reduce-scatter; send/recv and all-to-all are not tuned there) on
// NVLink inside a node and the network across, with tuning.cc's constants. β, the bus bandwidth
// the model scales, is not NCCL's topology search: it is the measured table (common/training/
// step_time.h, the playbook's busbw at 256 MiB), inverted through this same model at the table's
// own message size, so the model reproduces every measured point and adds only what NCCL's
// latency terms say about other sizes and group shapes. Nothing here is fitted to a training run.
#ifndef TS_LAB_08_NCCL_TUNER_H
#define TS_LAB_08_NCCL_TUNER_H
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "training/step_time.h"

namespace mesh5d {
using namespace ts;

enum class Algo { Tree, Ring, TwoLevel };  // tuning.cc's order (NCCL_ALGO_TREE 0, NCCL_ALGO_RING 1)
enum class Proto { LL, LL128, Simple };     // NCCL_PROTO_LL, NCCL_PROTO_LL128, NCCL_PROTO_SIMPLE
inline const char* algo_name(Algo a) { return a == Algo::Tree ? "tree" : a == Algo::Ring ? "ring" : "two-level"; }
inline const char* proto_name(Proto p) { return p == Proto::LL ? "LL" : p == Proto::LL128 ? "LL128" : "Simple"; }

// tuning.cc's ncclTunerConstantsDefaults, µs, [Tree, Ring][LL, LL128, Simple]: the base latency of
// a launch, and one step's latency over NVLink (hwLatencies[NCCL_HW_NVLINK]) and over the network
// (hwLatencies[NCCL_HW_NET]; graph->latencyInter adds 0 for InfiniBand, net_ib's props->latency).
constexpr double kBaseLatencyUs[2][3] = {{6.8, 14.0, 8.4}, {6.6, 14.0, 8.4}};
constexpr double kNvlinkLatencyUs[2][3] = {{0.6, 1.25, 4.0}, {0.6, 1.9, 3.4}};
constexpr double kNetLatencyUs[2][3] = {{5.0, 8.5, 14.0}, {2.7, 4.0, 14.0}};
// getNetOverhead on Intel x86: 1 µs a network post, 3× under Simple: a multi-node ring's floor per step.
constexpr double kNetOverheadUs = 1.0;
// ncclTopoGetAlgoTime: a multi-node ring all-reduce under Simple pays 1.4× its latency on
// compute capability ≥ 8.0 ("plateau effect of ring") once a channel's share of a rank's part is
// ≥ 64 B; channels assumed 32 (NCCL runs up to MAXCHANNELS = 64; fewer only lowers the threshold).
constexpr double kRingPlateau = 1.4, kAssumedChannels = 32;
// llMaxBws for Hopper in one node (141 GB/s), across nodes by the CPU (Intel: 39.0 on 2 nodes,
// 20.4 on more): the LL protocol's cap.
inline double ll_max_gbs(int nodes) { return nodes == 1 ? 141.0 : nodes == 2 ? 39.0 : 20.4; }
// treeCorrectionFactor: the tree all-reduce's bandwidth × this, by log2(bytes / 64) (64 B to 256 MiB).
constexpr double kTreeCorrection[3][24] = {
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9}};
// The playbook measured its table at 256 MB messages ("communication bandwidth by number of nodes").
constexpr double kTableBytes = 268435456;

// One group: its ranks, the nodes they span, and the ranks per node the table was measured with.
struct Span {
  int ranks = 1, nodes = 1;
};

inline int log2i(double x) { return x < 1 ? -1 : int(std::floor(std::log2(x))); }

// tuning.cc's latency of one call (µs), before the plateau: ring, 2(N−1) steps for an all-reduce
// (N−1 for the gathers), of which the 2(M−1) (M−1) that cross nodes at the network's latency, the
// rest at NVLink's (at least the network post overhead once the ring leaves the node); tree
// (all-reduce only), up and down a chain of N/M − 1 NVLink hops in the node and log2(M) network
// hops across: 2·((N/M − 1)·α_nvlink + log2(M)·α_net).
inline double nccl_latency_us(Collective op, Algo a, Proto p, Span s) {
  const int ai = a == Algo::Tree ? 0 : 1, pi = int(p), N = s.ranks, M = s.nodes;
  const double ppn = double(N) / M;
  double intra = kNvlinkLatencyUs[ai][pi];
  const double inter = kNetLatencyUs[ppn == 1 ? 0 : ai][pi];  // one GPU a node: the tree's network latency
  if (a == Algo::Tree) return kBaseLatencyUs[0][pi] + 2 * ((N / M - 1) * intra + log2i(M) * inter);
  if (M > 1) intra = std::max(intra, kNetOverheadUs * (p == Proto::Simple ? 3 : 1));
  const bool ar = op == Collective::AllReduce;
  const int steps = ar ? 2 * (N - 1) : N - 1, inter_steps = M == 1 ? 0 : ar ? 2 * (M - 1) : M - 1;
  return kBaseLatencyUs[1][pi] + (steps - inter_steps) * intra + inter_steps * inter;
}

// tuning.cc's algorithm bandwidth (GB/s) from the bus bandwidth β: each protocol's refinement, then
// the ring's busbw → algbw conversion N/steps, the tree's 1/2 (its bus bandwidth ×0.92: NCCL models
// a tree all-reduce as moving 2K per rank, as a large ring does, a little slower).
inline double nccl_algbw_gbs(Collective op, Algo a, Proto p, Span s, double beta) {
  double bw = beta;
  if (a == Algo::Ring && p == Proto::LL) bw = std::min(ll_max_gbs(s.nodes), bw * .5);
  if (a == Algo::Ring && p == Proto::LL128) bw *= 0.92;  // 120/128: the flag bytes of each 128-byte line
  if (a == Algo::Tree) bw *= 0.92;
  if (a == Algo::Tree && p == Proto::LL) bw = std::min(bw / 3.8, ll_max_gbs(s.nodes));
  if (a == Algo::Tree && p == Proto::LL128) bw *= s.nodes == 1 ? 7.0 / 9 : 120.0 / 128;
  const int N = s.ranks, steps = op == Collective::AllReduce ? 2 * (N - 1) : N - 1;
  return a == Algo::Ring ? bw * N / steps : bw * .5;
}

// One call of `op` on `bytes` (the message: the all-reduce's buffer, the gathers' whole output),
// priced as ncclTopoGetAlgoTime prices it: the algorithm and protocol chosen, and the seconds.
struct Priced {
  Algo algo = Algo::Ring;
  Proto proto = Proto::Simple;
  double seconds = 0, latency_s = 0;  // the call, and its latency term
};
inline Priced nccl_priced(Collective op, Algo a, Proto p, Span s, double beta, double bytes) {
  double bw = nccl_algbw_gbs(op, a, p, s, beta), lat = nccl_latency_us(op, a, p, s);
  const int log_size = log2i(bytes / 64);
  if (a == Algo::Tree && log_size >= 0 && log_size < 23) bw *= kTreeCorrection[int(p)][log_size];
  if (a == Algo::Ring && p == Proto::Simple && s.nodes > 1 && op == Collective::AllReduce &&
      bytes / (kAssumedChannels * s.ranks) >= 64)
    lat *= kRingPlateau;
  return {a, p, 1e-6 * lat + bytes / (bw * 1e9), 1e-6 * lat};
}
inline double nccl_seconds(Collective op, Algo a, Proto p, Span s, double beta, double bytes) {
  return nccl_priced(op, a, p, s, beta, bytes).seconds;
}
// The cheapest: ring and, for an all-reduce over more than two ranks, tree (NCCL runs
// reduce-scatter and all-gather as rings on nodes of several GPUs: PAT needs one GPU per node).
inline Priced nccl_choose(Collective op, Span s, double beta, double bytes) {
  Priced best{Algo::Ring, Proto::Simple, 1e300};
  for (Algo a : {Algo::Tree, Algo::Ring}) {
    if (a == Algo::Tree && (op != Collective::AllReduce || s.ranks <= 2)) continue;
    for (Proto p : {Proto::LL, Proto::LL128, Proto::Simple}) {
      const Priced c = nccl_priced(op, a, p, s, beta, bytes);
      if (c.seconds < best.seconds) best = c;
    }
  }
  return best;
}

// Where a ring and a tree all-reduce under protocol `p` cost the same in the formulas above, for
// messages past the ring's plateau threshold and before the tree's correction factors: the latency
// the tree saves over the bandwidth it loses, (L_ring − L_tree) / (1/B_tree − 1/B_ring) bytes (the
// ring is cheaper above it; ∞ where the tree is never slower per byte, 0 where its latency is not lower).
inline double crossover_bytes(Span s, double beta, Proto p) {
  const Collective ar = Collective::AllReduce;
  const double plateau = p == Proto::Simple && s.nodes > 1 ? kRingPlateau : 1;
  const double saved = 1e-6 * (plateau * nccl_latency_us(ar, Algo::Ring, p, s) - nccl_latency_us(ar, Algo::Tree, p, s));
  const double lost = 1e-9 / nccl_algbw_gbs(ar, Algo::Tree, p, s, beta) - 1e-9 / nccl_algbw_gbs(ar, Algo::Ring, p, s, beta);
  return saved <= 0 ? 0 : lost <= 0 ? 1e300 : saved / lost;
}

// The wire bytes per rank of one call per message byte (the ring formulas every predict_comm counts).
inline double wire_factor(Collective op, int ranks) {
  return op == Collective::AllReduce ? 2.0 * (ranks - 1) / ranks : double(ranks - 1) / ranks;
}

// β for `op` over `nodes` nodes: the bus bandwidth at which the model's best call at the table's
// 256 MB on `per_node`·nodes ranks takes the measured time, wire bytes / table busbw (bisection:
// the best time falls as β grows).
inline double table_beta(const Network& n, Collective op, int nodes, int per_node) {
  const Span s{nodes * per_node, nodes};
  const double busbw = bus_bandwidth(n, op, nodes);
  if (s.ranks < 2) return busbw;
  const double measured = wire_factor(op, s.ranks) * kTableBytes / (busbw * 1e9);
  double lo = busbw / 4, hi = busbw * 8;
  if (nccl_choose(op, s, hi, kTableBytes).seconds > measured) return hi;
  for (int i = 0; i < 60; i++) {
    const double mid = 0.5 * (lo + hi);
    (nccl_choose(op, s, mid, kTableBytes).seconds > measured ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// The two-level all-reduce of common/comm/algorithms.cu (two_level_all_reduce), for comparison:
// reduce-scatter in each node of L ranks, all-reduce across the M nodes on the L rings of ranks at
// the same position, all-gather in the node — 2(L−1) NVLink steps, 2(M−1) network steps, one
// launch, each step at the ring's Simple latencies. Its network bytes are the flat ring's (each of
// a node's L NICs carries 2(M−1)/M·K/L, as NCCL's L channels of a flat ring do), so its bandwidth
// terms are the ring's across the nodes plus an in-node reduce-scatter and all-gather not pipelined
// behind it: 2(L−1)/L·K/β_node + 2(N−1)/N·K/β_M.
inline double two_level_seconds(Span s, double beta_node, double beta_nodes, double bytes) {
  const int L = s.ranks / s.nodes, M = s.nodes;
  const double intra = std::max(kNvlinkLatencyUs[1][2], 3 * kNetOverheadUs), inter = kNetLatencyUs[1][2];
  const double lat = kBaseLatencyUs[1][2] + 2 * (L - 1) * intra + 2 * (M - 1) * inter;
  return 1e-6 * lat + 2.0 * (L - 1) / L * bytes / (beta_node * 1e9) +
         wire_factor(Collective::AllReduce, s.ranks) * bytes / (beta_nodes * 1e9);
}

// What a plan records per group and collective: the choice for its message and the calls.
struct TunedCall {
  std::string group, op;
  Span span;
  double bytes = 0, calls = 0;  // one call's message, and the calls per step
  Priced choice;
};

// The pricing a planner's group uses under NCCL's tuner: collective_seconds' hook on a copy of the
// cluster's network (step_time.h, Network::price), for the group `name` of `span`, recording each
// call's choice in `trace` where one is given. Send/recv stay the α–β of the table.
inline Network tuned_network(const Network& net, const std::string& name, Span span, int per_node,
                             std::vector<TunedCall>* trace) {
  Network n = net;
  n.price = [net, name, span, per_node, trace](Collective op, double wire_bytes, double calls, int nodes) {
    if (span.ranks < 2 || calls <= 0) return collective_seconds(net, op, wire_bytes, calls, nodes);
    const double bytes = wire_bytes / calls / wire_factor(op, span.ranks);
    const Priced c = nccl_choose(op, span, table_beta(net, op, span.nodes, per_node), bytes);
    if (trace) {
      const char* names[] = {"all_reduce", "all_gather", "reduce_scatter", "p2p"};
      trace->push_back({name, names[int(op)], span, bytes, calls, c});
    }
    return calls * c.seconds;
  };
  return n;
}

}  // namespace mesh5d
#endif  // TS_LAB_08_NCCL_TUNER_H
