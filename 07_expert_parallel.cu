// 07_expert_parallel.cu — expert parallelism: the experts of a mixture-of-experts model are
// spread over the --ep ranks of each expert-parallel group, and tokens travel to their experts.
//
// The playbook's expert-parallel chapter, runnable, on the Mixtral-style model of 01 --experts.
// Every rank trains on its dp slice of the global batch (world = dp) and holds E/ep experts of
// every layer; the dense weights (attention, norms, embeddings, routers) are replicated. In each
// MoE layer a rank routes its own tokens, then
//   dispatch  all-to-all of variable counts (the counts are exchanged first): each token row goes
//             to the rank that owns its expert;
//   experts   the owner runs each of its experts over every row it received, grouped per expert
//             in global token order (the order 01 uses);
//   combine   a second all-to-all returns the outputs to the tokens' ranks, which weight and sum.
// Where the rest of the chapter lives: this file moves rows; what decides them is 01's MoE block,
// unchanged (common/model/moe.cu, declared with its formulas in common/model/moe.h):
//   routing   moe_router_forward: fp32 softmax over the E router logits, top-k (ties to the lower
//             index), the k weights renormalised to sum to 1 (Mixtral's router);
//   grouping  make_routing_plan: each expert's rows in token order, and the counts sent first;
//   capacity  expert_capacity: at most floor(c·T·K/E) rows per expert and sequence (--capacity-
//             factor c; 0 = dropless), the earliest tokens kept, a dropped one keeps its residual;
//   aux loss  aux_per_sequence: E · Σ_e f_e · P_e per sequence and layer (Switch Transformer eq. 4),
//             added to the loss with weight --aux-loss-coef α;
//   combine   moe_combine: y[t] = Σ_k w[t,k] · expert_{i(t,k)}(h[t]).
// DeepSeekMoE as DeepSeek-V3 trains it (moe.h's header; notes/07_expert_parallel.md) changes none
// of this file: its shared experts (--shared-experts) are dense and run where the tokens are; its
// sigmoid router (--router sigmoid, moe_router_sigmoid_forward) picks by the biased scores, within
// the --group-limit best of --expert-groups groups (a group of E/G consecutive experts: at G = ep
// one rank, so a token's rows go to at most M ranks); and the selection-only bias moves after each
// step by the loads summed over every dp rank (moe_step_report, MoeBlock::update_bias), the same
// on every rank and every mesh.
// --dispatch two-level is DeepSeek-V3's node-limited dispatch (technical report §3.2.2), on the nodes
// MPI reports (mesh.h's node_of_ranks): the experts are placed by node (node n holds group n of
// --expert-groups = nodes), a token goes once to each node it routes to (over the rail: the ranks
// with its rank's local index, one per node) with its experts' ids and gate weights, and that
// node's rank (the entry) fans it out to its experts' ranks; the outputs return to the entry, which
// sends one gate-weighted partial sum per (token, node) back (the block's weighting, MoeBlock's
// routed_forward hook). Backward, dy crosses once per (token, node) and is scaled per expert at the
// entry, the input gradients come back summed per node, and the gate weights' gradient is formed
// at the entry from the outputs it kept, K floats per copy. Bytes per level are counted from the
// routing and printed against the communicators' and the balanced prediction.
// Backward mirrors it: the output gradients are dispatched, the input gradients combined. Dense
// gradients are averaged over all dp ranks; an expert's over the dp/ep ranks that hold it (the
// mesh's ep_dp group), both with 02's bucketed reducer.
//
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 2 --experts 4 --top-k 2
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 4 --experts 8 --top-k 2 --expert-ffn 32 --shared-experts 1 --router sigmoid --routed-scaling 2.5 --expert-groups 4 --group-limit 2
//   ./build/07_expert_parallel --dry-run --preset 8b --vocab 32000 --experts 8 --top-k 2 --dp 8 --ep 8 --batch 8 --dtype bf16
// (the last: Mixtral 8x7B's shape, Llama-3-8B's layers with 8 experts and a 32000-token vocabulary)
#ifndef TS_07_EXPERT_PARALLEL_CU
#define TS_07_EXPERT_PARALLEL_CU
#include <map>

#include "02_data_parallel.cu"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "model/moe.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/run.h"
#include "training/step_time.h"
#include "training/train.h"

namespace ep {
using namespace ts;

// ----- dispatch and combine ------------------------------------------------------------------------

// Who sends what: rank p of the ep group owns experts [p·per, (p+1)·per). The routing plan groups
// this rank's rows by global expert, so the rows for peer p are one contiguous block.
struct Exchange {
  std::vector<int64_t> send_rows, recv_rows;  // [P] rows to / from each peer
  std::vector<int64_t> local_counts;          // [per] rows each local expert received
  std::vector<int32_t> grouped;               // received row of each grouped row ([expert][peer] order)
  std::vector<int32_t> ungrouped;             // grouped row of each received row
};

// recv_counts[p·per + i]: rows peer p sends to local expert i ([peer][expert] order as received).
inline Exchange plan_exchange(const std::vector<int64_t>& counts, const std::vector<int32_t>& recv_counts, int P,
                              int per) {
  Exchange x;
  x.send_rows.assign(size_t(P), 0);
  x.recv_rows.assign(size_t(P), 0);
  x.local_counts.assign(size_t(per), 0);
  std::vector<int64_t> at(size_t(P) * per);  // where (peer, expert) starts in the received rows
  int64_t off = 0;
  for (int p = 0; p < P; p++)
    for (int i = 0; i < per; i++) {
      x.send_rows[size_t(p)] += counts[size_t(p) * per + i];
      const int64_t n = recv_counts[size_t(p) * per + i];
      x.recv_rows[size_t(p)] += n;
      x.local_counts[size_t(i)] += n;
      at[size_t(p) * per + i] = off;
      off += n;
    }
  x.ungrouped.assign(size_t(off), 0);
  for (int i = 0; i < per; i++)
    for (int p = 0; p < P; p++)
      for (int64_t r = 0; r < recv_counts[size_t(p) * per + i]; r++) {
        x.ungrouped[size_t(at[size_t(p) * per + i] + r)] = int32_t(x.grouped.size());
        x.grouped.push_back(int32_t(at[size_t(p) * per + i] + r));
      }
  return x;
}

// ----- two-level dispatch (DeepSeek-V3 technical report §3.2.2) -------------------------------------

// The ep group as nodes × ranks per node (mesh.h's node_of_ranks says which ranks share a node).
// Under --dispatch two-level the experts are placed by node: the rank with index l among node n's
// ep ranks holds slot n·Q + l, experts [slot·per, (slot+1)·per), so node n holds the n-th E/nodes
// consecutive experts, group n of --expert-groups nodes. Flat: slot = ep rank.
struct Topology {
  bool two_level = false;
  int nodes = 1, per_node = 1;   // Nn, Q
  std::vector<int> node, local;  // [P] each ep rank's node (0.. in order of the nodes' ids) and index on it
  std::vector<int> rank_at;      // [Nn·Q] the ep rank of each slot
  int slot(int r) const { return two_level ? node[size_t(r)] * per_node + local[size_t(r)] : r; }
};

inline Topology make_topology(const std::vector<int>& node_ids, bool two_level) {
  Topology t;
  t.two_level = two_level;
  std::vector<int> ids = node_ids;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  t.nodes = int(ids.size());
  std::vector<int> seen(ids.size(), 0);
  for (int id : node_ids) {
    const int n = int(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin());
    t.node.push_back(n);
    t.local.push_back(seen[size_t(n)]++);
  }
  t.per_node = *std::max_element(seen.begin(), seen.end());
  t.rank_at.assign(size_t(t.nodes) * t.per_node, -1);
  for (size_t r = 0; r < node_ids.size(); r++) t.rank_at[size_t(t.node[r] * t.per_node + t.local[r])] = int(r);
  return t;
}

// Why the two-level dispatch cannot run on `t`, or "": every node must hold as many of the ep
// group's ranks, and the routing's groups must be the nodes (--group-limit then bounds the nodes a
// token reaches).
inline std::string two_level_problem(const Topology& t, const ModelConfig& m) {
  char b[256];
  for (int r : t.rank_at)
    if (r < 0) {
      snprintf(b, sizeof b, "--dispatch two-level needs as many ep ranks on every node: the ep group's %d ranks are "
               "on %d nodes unevenly", int(t.node.size()), t.nodes);
      return b;
    }
  if (m.expert_groups != t.nodes) {
    snprintf(b, sizeof b, "--dispatch two-level puts expert group g on node g: --expert-groups must equal the %d "
             "node(s) the ep group spans (got %d)", t.nodes, m.expert_groups);
    return b;
  }
  return "";
}

// One layer's two-level routes: built by the forward's dispatch (with the lists the tokens' ranks
// send), reused by its combine and by the backward. Three roles, every rank all of them:
//   source  this rank's tokens: to node n (its rank with our local index, over the rail group of
//           the ranks with our local index) one copy of each token that has experts there, with
//           their ids and gate weights (K each, in 01's slot order); copy order: node, token. What
//           comes back is one row per copy too (the node's partial sum), summed per token;
//   entry   the copies that arrive from every node, fanned out inside the node, one row per
//           (token, expert) to the expert's rank: fan order: rank, expert, source node, token; the
//           rows that return are weighted and summed per copy here;
//   owner   the rows of its experts from every entry, grouped [expert][source ep rank] as flat is.
struct TwoLevelPlan {
  std::vector<int64_t> copies_out, copies_in;  // [Nn] over the rail group
  std::vector<int32_t> copy_rows, copy_token;  // x row (its token's h) and token (its dy) of each copy sent
  std::vector<int32_t> token_copies;           // [N, K] each token's copies, nodes ascending, −1 past the last
  std::vector<int32_t> dw_at;                  // [N·K] where (t, k)'s dw arrives (Σ copies_out·K: a zero, dropped)
  std::vector<float> copy_w;                   // [Σ copies_in, K] the arrived gate weights (0 past the last)
  std::vector<int32_t> fan_copy, copy_fan;     // each fanned row's copy; [Σ copies_in, K] each slot's fanned row or −1
  std::vector<float> fan_w;                    // each fanned row's gate weight
  std::vector<int64_t> fan_out, fan_in;        // [Q] rows to / from each rank of the node
  std::vector<int32_t> grouped, ungrouped;     // as in Exchange
  std::vector<int64_t> local_counts;           // [per]
  int64_t remote_copies_in = 0, remote_pairs_in = 0, remote_fan_out = 0, remote_fan_in = 0;  // from / to other ranks
  int64_t routed_copies = 0, routed_pairs = 0;  // this rank's copies and (token, expert) rows to other nodes, from
                                                // the router's choices (count_routed)
};

// The source's side. x is grouped by expert (counts[e] rows of expert e); token: the token of each
// x row (the key a copy is made per); src [N·K]: the x row of each (token, slot), −1 if dropped;
// wa: each x row's gate weight. Per copy, K expert ids (−1 past the last) and K weights (0) go
// with it: what the entry fans out by and weights with.
inline void plan_sources(TwoLevelPlan& p, std::vector<int32_t>& lists, std::vector<float>& weights,
                         const std::vector<int64_t>& counts, const std::vector<int32_t>& token,
                         const std::vector<int32_t>& src, const std::vector<float>& wa, const Topology& t, int K) {
  const int per_node_experts = int(counts.size()) / t.nodes;
  std::vector<int32_t> expert, slot(token.size());  // each x row's expert and (token, slot) index t·K + k
  for (size_t e = 0; e < counts.size(); e++) expert.insert(expert.end(), size_t(counts[e]), int32_t(e));
  for (size_t a = 0; a < src.size(); a++)
    if (src[a] >= 0) slot[size_t(src[a])] = int32_t(a);
  int32_t keys = 0;
  for (int32_t v : token) keys = std::max(keys, v + 1);
  std::vector<std::vector<int32_t>> rows_of(static_cast<size_t>(keys));  // x rows per key, in slot order
  for (size_t r = 0; r < token.size(); r++) rows_of[size_t(token[r])].push_back(int32_t(r));
  for (auto& rows : rows_of)
    std::sort(rows.begin(), rows.end(), [&](int32_t a, int32_t b) { return slot[size_t(a)] < slot[size_t(b)]; });
  p.copies_out.assign(size_t(t.nodes), 0);
  p.token_copies.assign(src.size(), -1);
  p.dw_at.assign(src.size(), -1);
  std::vector<int> seen(src.size() / size_t(K), 0);  // copies of each token so far
  for (int n = 0; n < t.nodes; n++)
    for (const auto& rows : rows_of) {
      const int32_t c = int32_t(p.copy_rows.size());
      int j = 0;
      for (int32_t r : rows) {
        if (expert[size_t(r)] / per_node_experts != n) continue;
        const int32_t tok = slot[size_t(r)] / K;
        if (j == 0) {
          p.copy_rows.push_back(r);
          p.copy_token.push_back(tok);
        }
        int32_t* mine = &p.token_copies[size_t(tok) * K];
        int& had = seen[size_t(tok)];
        if (had == 0 || mine[had - 1] != c) mine[had++] = c;
        p.dw_at[size_t(slot[size_t(r)])] = c * K + j;
        lists.push_back(expert[size_t(r)]);
        weights.push_back(wa[size_t(r)]);
        j++;
      }
      if (j == 0) continue;
      lists.insert(lists.end(), size_t(K - j), -1);
      weights.insert(weights.end(), size_t(K - j), 0.f);
      p.copies_out[size_t(n)]++;
    }
  for (int32_t& at : p.dw_at)
    if (at < 0) at = int32_t(p.copy_rows.size()) * K;
}

// The entry's side, from the lists and weights that arrived (copies_in[m] from node m): which rank
// of the node each (token, expert) row goes to, in fan order; counts[q][i][m]: rows for local
// expert i of rank q from node m, what the owners need to group them.
inline std::vector<int32_t> plan_entries(TwoLevelPlan& p, const std::vector<int32_t>& lists,
                                         const std::vector<float>& weights, const Topology& t, int me, int K, int per) {
  const int Q = t.per_node, Nn = t.nodes, first = t.node[size_t(me)] * Q * per;  // this node's first expert
  std::vector<std::vector<int32_t>> bucket(size_t(Q) * per * Nn);  // slots c·K + j
  std::vector<int64_t> pairs_in(size_t(Nn), 0);
  int32_t c = 0;
  for (int m = 0; m < Nn; m++)
    for (int64_t i = 0; i < p.copies_in[size_t(m)]; i++, c++)
      for (int j = 0; j < K && lists[size_t(c) * K + j] >= 0; j++) {
        const int e = lists[size_t(c) * K + j] - first;  // q·per + i
        bucket[size_t(e) * Nn + m].push_back(c * K + j);
        pairs_in[size_t(m)]++;
      }
  std::vector<int32_t> counts(bucket.size());
  p.fan_out.assign(size_t(Q), 0);
  p.copy_w = weights;
  p.copy_fan.assign(lists.size(), -1);
  for (size_t b = 0; b < bucket.size(); b++) {
    counts[b] = int32_t(bucket[b].size());
    p.fan_out[b / size_t(per * Nn)] += counts[b];
    for (int32_t s : bucket[b]) {
      p.copy_fan[size_t(s)] = int32_t(p.fan_copy.size());
      p.fan_copy.push_back(s / K);
      p.fan_w.push_back(weights[size_t(s)]);
    }
  }
  const int mine = t.node[size_t(me)];
  p.remote_copies_in = c - p.copies_in[size_t(mine)];
  for (int m = 0; m < Nn; m++) p.remote_pairs_in += m == mine ? 0 : pairs_in[size_t(m)];
  p.remote_fan_out = int64_t(p.fan_copy.size()) - p.fan_out[size_t(t.local[size_t(me)])];
  return counts;
}

// The owner's side, from counts_in[q][i][m] (rows of its expert i that entry q fanned from node m):
// [expert][source ep rank] order, the ep rank at (m, q) being the source; global token order, as flat.
inline void plan_owner(TwoLevelPlan& p, const std::vector<int32_t>& counts_in, const Topology& t, int me, int per) {
  const int Q = t.per_node, Nn = t.nodes;
  std::vector<int64_t> at(counts_in.size());
  int64_t off = 0;
  p.fan_in.assign(size_t(Q), 0);
  for (size_t b = 0; b < counts_in.size(); b++) {
    at[b] = off;
    off += counts_in[b];
    p.fan_in[b / size_t(per * Nn)] += counts_in[b];
  }
  p.local_counts.assign(size_t(per), 0);
  p.ungrouped.assign(size_t(off), 0);
  for (int i = 0; i < per; i++)
    for (size_t r = 0; r < t.node.size(); r++) {
      const size_t b = (size_t(t.local[r]) * per + i) * Nn + size_t(t.node[r]);
      for (int64_t j = 0; j < counts_in[b]; j++) {
        p.ungrouped[size_t(at[b] + j)] = int32_t(p.grouped.size());
        p.grouped.push_back(int32_t(at[b] + j));
      }
      p.local_counts[size_t(i)] += counts_in[b];
    }
  p.remote_fan_in = off - p.fan_in[size_t(t.local[size_t(me)])];
}

// What the two levels moved, summed over the layers' calls: rows crossing nodes (copies: one per
// (token, node), out from this rank's tokens (counted from the router's choices) and in from other
// nodes' (from the plan), per forward; every inter-node hop carries one row per copy), the
// (token, expert) pairs those copies stand for (what a flat dispatch would move), and the bytes
// each level's all-to-alls put on the wire by those counts.
struct LevelCounts {
  double copies = 0, copies_in = 0, pairs_out = 0, pairs_in = 0, fan_out = 0, fan_in = 0;
  double inter_bytes = 0, intra_bytes = 0;
};

// The MoE block with its experts behind two all-to-alls. Routing, capacity and the aux loss are the
// base block's; the flat dispatch leaves the combine's weighting to it too (only where the experts
// run changes), the two-level one weights and sums on the experts' nodes.
class ExpertParallelMoe : public MoeBlock {
 public:
  ExpertParallelMoe(const Model& m, Comm& group, const Topology& topo) : MoeBlock(m), ep_(group), topo_(topo) {
    keeps_input_ = false;  // the owner keeps the rows it received instead
    per_ = m.cfg.experts / group.size();
    if (!topo_.two_level) return;
    plans_.resize(size_t(m.cfg.layers));
    // The rail: the ranks with this rank's local index, one per node (what crosses nodes); the
    // node: the ep ranks that share this one's (what stays on NVLink).
    const int r = ep_.rank();
    inter_ = std::make_unique<Comm>("ep_inter", watched_split(ep_.mpi(), topo_.local[size_t(r)], topo_.node[size_t(r)],
                                                              "the ep group's ranks of one local index"));
    intra_ = std::make_unique<Comm>("ep_intra", watched_split(ep_.mpi(), topo_.node[size_t(r)], topo_.local[size_t(r)],
                                                              "the ep group's ranks of one node"));
  }

  // --dispatch two-level owns the gate weighting too (MoeBlock's hook): it sums on the experts' nodes.
  void routed_forward(Model& m, int l, const Tensor& y, const Tensor& x, const Tensor& w,
                      const std::vector<int64_t>& counts, LayerActs& a) override {
    if (topo_.two_level) return two_level_forward(m, l, y, x, counts, a);
    MoeBlock::routed_forward(m, l, y, x, w, counts, a);
  }
  void routed_backward(Model& m, int l, const Tensor& dh, const Tensor& dw, const Tensor& dy,
                       const std::vector<int64_t>& counts, LayerActs& a) override {
    if (topo_.two_level) return two_level_backward(m, l, dh, dw, dy, a);
    MoeBlock::routed_backward(m, l, dh, dw, dy, counts, a);
  }

  Tensor experts_forward(Model& m, int l, const Tensor& x, const std::vector<int64_t>& counts, LayerActs& a) override {
    const int P = ep_.size(), E = m.cfg.experts;
    Tensor send_c = Tensor::empty({E}, DType::I32, Device::CPU, Tag::Comm);
    Tensor recv_c = Tensor::empty({E}, DType::I32, Device::CPU, Tag::Comm);
    for (int e = 0; e < E; e++) send_c.i32()[e] = int32_t(counts[size_t(e)]);
    {
      TraceScope t("ep all_to_all (counts)", Lane::Comm);
      ep_.all_to_all(recv_c, send_c);  // counts first: each owner learns how many rows will arrive
    }
    a.mlp_state.resize(kNumSlots + 1);
    a.mlp_state[kNumSlots] = recv_c;
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(recv_c.i32(), recv_c.i32() + E), P, per_);
    tally(xc, m, E);
    // x holds this rank's N·K routed rows; balanced routing brings in as many for its experts.
    busiest_rows = std::max(busiest_rows, double(xc.grouped.size()) / double(std::max<int64_t>(1, x.size(0))));
    Tensor recv = rows(m, xc.grouped.size(), Tag::Workspace);
    dispatch(recv, x, xc, "dispatch");
    Tensor xr = rows(m, xc.grouped.size(), Tag::Activations);
    moe_gather(xr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    a.mlp_state[kIn] = xr;
    Tensor outr = rows(m, xr.size(0), Tag::Workspace);
    run_experts(m, l, ep_.rank() * per_, xc.local_counts, xr, outr, a);
    Tensor back = rows(m, xr.size(0), Tag::Workspace);
    moe_gather(back, outr, from_host_i32(xc.ungrouped, m.dev), Tensor());
    Tensor out = rows(m, x.size(0), Tag::Activations);
    combine(out, back, xc, "combine");
    return out;
  }

  void experts_backward(Model& m, int l, const Tensor& dx, const Tensor& dout, const std::vector<int64_t>& counts,
                        LayerActs& a) override {
    const int E = m.cfg.experts;
    const Tensor& rc = a.mlp_state[kNumSlots];
    const Exchange xc = plan_exchange(counts, std::vector<int32_t>(rc.i32(), rc.i32() + E), ep_.size(), per_);
    tally(xc, m, 0);
    const int64_t R = int64_t(xc.grouped.size());
    Tensor recv = rows(m, R, Tag::Workspace), dr = rows(m, R, Tag::Workspace), dxr = rows(m, R, Tag::Workspace);
    dispatch(recv, dout, xc, "dispatch backward");
    moe_gather(dr, recv, from_host_i32(xc.grouped, m.dev), Tensor());
    run_experts_backward(m, l, ep_.rank() * per_, xc.local_counts, a.mlp_state[kIn], dr, dxr, a);
    moe_gather(recv, dxr, from_host_i32(xc.ungrouped, m.dev), Tensor());
    combine(dx, recv, xc, "combine backward");
  }

  // Wire bytes this rank's all-to-alls send, from the routing counts (the measured bytes exactly);
  // over predict_balanced_bytes it is the routing's imbalance factor.
  double routed_bytes = 0;
  // Of routed_bytes, those to and from ep ranks on another node (the topology's, from mesh.h's
  // node_of_ranks): what would cross the inter-node network (InfiniBand) on a cluster.
  double inter_node_bytes = 0;
  // The most rows this rank's experts received in one layer's forward, over balanced routing's N·K:
  // the expert activations it saves grow by this factor over the balanced prediction.
  double busiest_rows = 0;
  LevelCounts levels;  // --dispatch two-level
  const Topology& topology() const { return topo_; }
  Comm& inter() { return *inter_; }
  Comm& intra() { return *intra_; }

 private:
  // Forward (DeepSeek-V3 §3.2.2): each token once to each node with its experts (the rail), then
  // one row per (token, expert) to the expert's rank inside the node; the owner groups them as the
  // flat dispatch does. The outputs come back to the entry, which keeps them (for dw) and weights
  // and sums each copy's: one row per (token, node) crosses back (sum_levels).
  void two_level_forward(Model& m, int l, const Tensor& y, const Tensor& x, const std::vector<int64_t>& counts,
                         LayerActs& a) {
    TwoLevelPlan& p = plans_[size_t(l)] = TwoLevelPlan();
    plan_levels(p, m, counts, a);
    busiest_rows = std::max(busiest_rows, double(p.grouped.size()) / double(std::max<int64_t>(1, x.size(0))));
    Tensor arrived = rows(m, size_t(sum(p.copies_in)), Tag::Workspace);
    exchange(*inter_, arrived, p.copies_in, gathered(m, x, p.copy_rows), p.copies_out, "dispatch");
    Tensor recv = rows(m, size_t(sum(p.fan_in)), Tag::Workspace);
    exchange(*intra_, recv, p.fan_in, gathered(m, arrived, p.fan_copy), p.fan_out, "dispatch");
    Tensor xr = gathered(m, recv, p.grouped, Tag::Activations);
    a.mlp_state.resize(kNumSlots + 1);
    a.mlp_state[kIn] = xr;
    Tensor outr = rows(m, xr.size(0), Tag::Workspace);
    run_experts(m, l, topo_.slot(ep_.rank()) * per_, p.local_counts, xr, outr, a);
    Tensor kept = a.mlp_state[kNumSlots] = rows(m, p.fan_copy.size(), Tag::Activations);  // o_k[t], fan order
    exchange(*intra_, kept, p.fan_out, gathered(m, outr, p.ungrouped), p.fan_in, "combine");
    sum_levels(m, p, y, kept, copy_slots(m, p), from_host_f32(p.copy_w, m.dev).reshape({sum(p.copies_in), m.cfg.top_k}),
               "combine");
  }
  // Backward: dL/dy_n[t] = dy[t] for each node n, so dy's row travels as the forward's copy did,
  // once per (token, node); the entry scales it per expert, dO_k = w[t,k]·dy[t] (01's moe_gather,
  // the same product), fans it out, sums the input gradients that return per copy (sum_levels), and
  // forms dw[t,k] = dy[t]·o_k[t] from the output rows it kept (gate_weight_grads).
  void two_level_backward(Model& m, int l, const Tensor& dh, const Tensor& dw, const Tensor& dy, LayerActs& a) {
    const TwoLevelPlan& p = plans_[size_t(l)];
    tally_levels(p, m, false);
    Tensor arrived = rows(m, size_t(sum(p.copies_in)), Tag::Workspace);
    exchange(*inter_, arrived, p.copies_in, gathered(m, dy, p.copy_token), p.copies_out, "dispatch backward");
    Tensor fan = rows(m, p.fan_copy.size(), Tag::Workspace);
    moe_gather(fan, arrived, from_host_i32(p.fan_copy, m.dev), from_host_f32(p.fan_w, m.dev));
    Tensor recv = rows(m, size_t(sum(p.fan_in)), Tag::Workspace);
    exchange(*intra_, recv, p.fan_in, fan, p.fan_out, "dispatch backward");
    Tensor dxr = rows(m, recv.size(0), Tag::Workspace);
    run_experts_backward(m, l, topo_.slot(ep_.rank()) * per_, p.local_counts, a.mlp_state[kIn],
                         gathered(m, recv, p.grouped), dxr, a);
    exchange(*intra_, fan, p.fan_out, gathered(m, dxr, p.ungrouped), p.fan_in, "combine backward");
    const Tensor slots = copy_slots(m, p);  // both sums below read it
    sum_levels(m, p, dh, fan, slots, Tensor(), "combine backward");
    gate_weight_grads(m, p, dw, arrived, a.mlp_state[kNumSlots], slots);
  }
  // The combine, per (token, node): the entry sums each copy's fanned rows (weighted by w: the
  // forward; unweighted: dh), y_n[t] = Σ_{k on n} w[t,k]·o_k[t] in 01's slot order, one row per copy
  // crosses back, and the token's rank sums its copies in node order: y[t] = Σ_n y_n[t]. fp32 sums
  // so grouped by node rather than 01's k = 0..K−1: a reordering of K terms, inside notes/00's
  // criterion (and the same bits at K = 2 where both experts share a node).
  void sum_levels(const Model& m, const TwoLevelPlan& p, const Tensor& out, const Tensor& fanned, const Tensor& slots,
                  const Tensor& w, const char* what) {
    const int64_t C = sum(p.copies_in), K = m.cfg.top_k;
    Tensor partial = rows(m, size_t(C), Tag::Workspace), mine = rows(m, p.copy_rows.size(), Tag::Workspace);
    moe_combine(partial, fanned, slots, w);
    exchange(*inter_, mine, p.copies_out, partial, p.copies_in, what);
    moe_combine(out, mine, from_host_i32(p.token_copies, m.dev).reshape({out.size(0), K}), Tensor());
  }
  // dw[t,k] = dy[t]·o_k[t], formed where o_k is (the entry, 01's moe_combine_backward_weights over the
  // same rows: the same bits), K fp32 per copy back over the rail, scattered to (t, k); a dropped
  // slot reads the zero after the last.
  void gate_weight_grads(const Model& m, const TwoLevelPlan& p, const Tensor& dw, const Tensor& dy_copies,
                         const Tensor& kept, const Tensor& slots) {
    const int64_t C = sum(p.copies_in), U = int64_t(p.copy_rows.size()), K = m.cfg.top_k;
    Tensor here = Tensor::empty({C, K}, DType::F32, m.dev, Tag::Workspace);
    moe_combine_backward_weights(here, dy_copies, kept, slots);
    Tensor back = Tensor::empty({U * K + 1, 1}, DType::F32, m.dev, Tag::Workspace);
    ts::zero(back);
    exchange(*inter_, back.view(0, {U, K}), p.copies_out, here, p.copies_in, "gate weights' gradient");
    moe_gather(dw.reshape({dw.numel(), 1}), back, from_host_i32(p.dw_at, m.dev), Tensor());
  }
  // The three sides of the plan, with the lists and counts they exchange: K expert ids and K gate
  // weights per copy over the rail (after the copies per node), rows per (rank, expert, node)
  // inside the node.
  void plan_levels(TwoLevelPlan& p, const Model& m, const std::vector<int64_t>& counts, const LayerActs& a) {
    const int K = m.cfg.top_k, me = ep_.rank();
    const std::vector<int32_t> src = to_host_i32(a.mlp_state[kSrc]);
    std::vector<int32_t> lists;
    std::vector<float> weights;
    plan_sources(p, lists, weights, counts, to_host_i32(a.mlp_state[kPerm]), src,
                 to_host_f32(a.mlp_state[kWa]), topo_, K);
    const std::vector<int32_t> copies_in = ints_all_to_all(*inter_, std::vector<int32_t>(p.copies_out.begin(), p.copies_out.end()));
    p.copies_in.assign(copies_in.begin(), copies_in.end());
    Tensor lists_in = Tensor::empty({sum(p.copies_in) * K}, DType::I32, Device::CPU, Tag::Comm);
    Tensor weights_in = Tensor::empty({sum(p.copies_in) * K}, DType::F32, Device::CPU, Tag::Comm);
    {
      TraceScope t("ep_inter all_to_all_v (expert lists, gate weights)", Lane::Comm);
      inter_->all_to_all_v(lists_in, elems(p.copies_in, K), from_host_i32(lists, Device::CPU, Tag::Comm),
                           elems(p.copies_out, K));
      inter_->all_to_all_v(weights_in, elems(p.copies_in, K), from_host_f32(weights, Device::CPU, Tag::Comm),
                           elems(p.copies_out, K));
    }
    const std::vector<int32_t> fan_counts =
        plan_entries(p, std::vector<int32_t>(lists_in.i32(), lists_in.i32() + lists_in.numel()),
                     std::vector<float>(weights_in.f32(), weights_in.f32() + weights_in.numel()), topo_, me, K, per_);
    plan_owner(p, ints_all_to_all(*intra_, fan_counts), topo_, me, per_);
    count_routed(p, src, a, m.cfg.experts);
    tally_levels(p, m, true);
  }
  // From the router's choices, not the plan (the check on it): the copies (a token's other nodes)
  // and the pairs (its kept choices on other nodes) this rank's tokens send across nodes.
  void count_routed(TwoLevelPlan& p, const std::vector<int32_t>& src, const LayerActs& a, int E) {
    const std::vector<int32_t> idx = to_host_i32(a.mlp_state[kIdx]);
    const size_t K = size_t(a.mlp_state[kIdx].size(1));
    const int mine = topo_.node[size_t(ep_.rank())], per_node = E / topo_.nodes;
    p.routed_copies = p.routed_pairs = 0;
    for (size_t t = 0; t < idx.size() / K; t++) {
      uint64_t seen = 0;
      for (size_t k = 0; k < K; k++) {
        const int n = idx[t * K + k] / per_node;
        if (src[t * K + k] < 0 || n == mine) continue;
        p.routed_pairs++;
        if (!(seen >> n & 1)) p.routed_copies++;
        seen |= uint64_t(1) << n;
      }
    }
  }
  // Bytes this rank puts on the wire per level, every inter-node hop one row per (token, node).
  // Across nodes, forward: the counts (one int to each other node), each copy with its K ids and K
  // gate weights (row + 8K), then a partial row per copy from another node (the combine);
  // backward: each copy's dy row out, and per copy from another node a partial dh row and its K
  // dw floats back. Inside the node: the rows fanned out and back, plus (forward) the counts per
  // (rank, expert, node) to each other rank of the node.
  void tally_levels(const TwoLevelPlan& p, const Model& m, bool forward) {
    const double row = double(m.cfg.dim) * dtype_size(m.dtype), Nn = topo_.nodes, Q = topo_.per_node, K = m.cfg.top_k;
    const double out = double(p.routed_copies), in = double(p.remote_copies_in);
    levels.fan_out += double(p.remote_fan_out);
    levels.fan_in += double(p.remote_fan_in);
    levels.intra_bytes += double(p.remote_fan_out + p.remote_fan_in) * row;
    if (forward) {
      levels.copies += out;
      levels.copies_in += in;
      levels.pairs_in += double(p.remote_pairs_in);
      levels.inter_bytes += out * (row + 8 * K) + in * row + (Nn - 1) * 4;
      levels.intra_bytes += (Q - 1) * per_ * Nn * 4;
    } else {
      levels.pairs_out += double(p.routed_pairs);
      levels.inter_bytes += out * row + in * (row + 4 * K);
    }
  }
  std::vector<int32_t> ints_all_to_all(Comm& c, const std::vector<int32_t>& v) {
    Tensor in = from_host_i32(v, Device::CPU, Tag::Comm), out = Tensor::empty({int64_t(v.size())}, DType::I32, Device::CPU, Tag::Comm);
    TraceScope t(c.name() + " all_to_all (counts)", Lane::Comm);
    c.all_to_all(out, in);
    return std::vector<int32_t>(out.i32(), out.i32() + out.numel());
  }
  // Each arrived copy's K slots: its fanned row per expert, −1 past the last ([Σ copies_in, K] on the device).
  static Tensor copy_slots(const Model& m, const TwoLevelPlan& p) {
    return from_host_i32(p.copy_fan, m.dev).reshape({sum(p.copies_in), m.cfg.top_k});
  }
  Tensor gathered(const Model& m, const Tensor& x, const std::vector<int32_t>& idx, Tag tag = Tag::Workspace) const {
    Tensor out = rows(m, idx.size(), tag);
    moe_gather(out, x, from_host_i32(idx, m.dev), Tensor());
    return out;
  }
  static int64_t sum(const std::vector<int64_t>& v) {
    int64_t n = 0;
    for (int64_t x : v) n += x;
    return n;
  }
  void exchange(Comm& c, const Tensor& out, const std::vector<int64_t>& out_rows, const Tensor& in,
                const std::vector<int64_t>& in_rows, const char* what) {
    TraceScope t(c.name() + " all_to_all_v (" + what + ")", Lane::Comm);
    const int64_t D = in.size(1);
    c.all_to_all_v(out, elems(out_rows, D), in, elems(in_rows, D));
  }
  Tensor rows(const Model& m, size_t n, Tag tag) const {
    return Tensor::empty({int64_t(n), m.cfg.dim}, m.dtype, m.dev, tag);
  }
  std::vector<int64_t> elems(const std::vector<int64_t>& r, int64_t D) const {
    std::vector<int64_t> v;
    for (int64_t n : r) v.push_back(n * D);
    return v;
  }
  void dispatch(const Tensor& recv, const Tensor& send, const Exchange& xc, const char* what) {
    exchange(ep_, recv, xc.recv_rows, send, xc.send_rows, what);
  }
  void combine(const Tensor& out, const Tensor& back, const Exchange& xc, const char* what) {
    exchange(ep_, out, xc.send_rows, back, xc.recv_rows, what);
  }
  // One dispatch and one combine: the rows sent to and received from the other ranks, each a row
  // of D elements; plus the counts exchange (E/ep int32 to each other rank) when count_ints = E.
  void tally(const Exchange& xc, const Model& m, int count_ints) {
    for (int p = 0; p < ep_.size(); p++) {
      if (p == ep_.rank()) continue;
      const double rows_out = double(xc.send_rows[size_t(p)] + xc.recv_rows[size_t(p)]);
      const double b = rows_out * m.cfg.dim * dtype_size(m.dtype) + double(count_ints) / ep_.size() * 4;
      routed_bytes += b;
      if (topo_.node[size_t(p)] != topo_.node[size_t(ep_.rank())]) inter_node_bytes += b;
    }
  }
  Comm& ep_;
  const Topology topo_;
  std::unique_ptr<Comm> inter_, intra_;  // --dispatch two-level: across nodes (one rank each), inside one
  std::vector<TwoLevelPlan> plans_;      // [L] the last forward's routes of each layer
  int per_ = 1;
};

// Installs the expert-parallel MoE block into a model built with the ep shard spec.
inline ExpertParallelMoe& install(Model& m, Comm& group, const Topology& topo) {
  auto* b = new ExpertParallelMoe(m, group, topo);
  m.mlp.reset(b);
  return *b;
}

// The flat ranges of dense and of expert gradients: each layer's held experts are one run.
inline void split_ranges(const ParamTable& t, std::vector<std::pair<int64_t, int64_t>>& dense,
                         std::vector<std::pair<int64_t, int64_t>>& experts) {
  for (const ParamEntry& e : t.entries) {
    if (e.numel == 0) continue;
    auto& v = is_expert_param(e) ? experts : dense;
    if (!v.empty() && v.back().second == e.offset) v.back().second = e.offset + e.numel;
    else v.push_back({e.offset, e.offset + e.numel});
  }
}

inline ShardSpec shard_spec(int ep, int ep_rank) {
  ShardSpec s;
  s.ep = ep;
  s.ep_rank = ep_rank;
  return s;
}

inline void validate(const RunConfig& rc, const MeshConfig& mc) {
  const ModelConfig& m = rc.model;
  if (m.experts < 1) config_error("07_expert_parallel needs a mixture of experts: pass --experts E (and --top-k K)");
  if (mc.ep < 1) config_error("--ep must be >= 1 (got %d)", mc.ep);
  if (m.experts % mc.ep) config_error("--experts %d is not divisible by --ep %d", m.experts, mc.ep);
  if (mc.dp % mc.ep) config_error("--ep %d does not divide --dp %d (expert-parallel groups are cut from the dp ranks)", mc.ep, mc.dp);
}

// ----- predict: memory and bytes per rank ----------------------------------------------------------

struct ParamSplit {
  int64_t dense, experts;  // parameters this rank holds
};
// Of any rank's table.
inline ParamSplit param_split(const ParamTable& t) {
  ParamSplit s{0, 0};
  for (const ParamEntry& e : t.entries) (is_expert_param(e) ? s.experts : s.dense) += e.numel;
  return s;
}
inline ParamSplit param_split(const RunConfig& rc, int ep) { return param_split(Model::make_table(rc.model, 1, shard_spec(ep, 0))); }

// What the memory table's comm row holds (Tag::Comm): the counts, not the rows (those are activations).
inline std::string comm_holds(int ep) { return ep > 1 ? "the per-expert row counts exchanged before each all-to-all" : ""; }

inline MemoryPrediction predict_memory(const RunConfig& rc, int ep) {
  const ParamSplit s = param_split(rc, ep);
  MemoryPrediction p = predict_states(s.dense + s.experts, s.dense + s.experts, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);  // balanced routing
  p.comm_also_holds(comm_holds(ep));
  return p;
}

// Balanced routing: of a micro-batch's N·K routed rows, (ep−1)/ep go to other ranks in the
// dispatch and as many come back in the combine; backward repeats both, and full recompute reruns
// the forward's pair. Plus E/ep int32 counts to each other rank per layer forward.
inline double predict_balanced_bytes(const RunConfig& rc, int dp, int ep) {
  const ModelConfig& m = rc.model;
  const double f = (ep - 1.0) / ep, mbs = double(rc.batch / dp) / rc.micro_batch, full = rc.recompute == Recompute::Full;
  const double rows = 2 * f * double(rc.micro_batch) * m.seq * m.top_k * (2 + full);
  const double counts = (1 + full) * (ep - 1.0) * (m.experts / ep) * 4;
  return mbs * m.layers * (rows * m.dim * dtype_size(rc.dtype) + counts);
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// All-to-all calls per step: per layer a dispatch and a combine forward, and both again backward.
inline double all_to_all_calls(double micro_batches, double layers) { return micro_batches * layers * 4; }

// 07's dispatch as the MoE term's levels: one flat all-to-all over the ep group, `bytes` per rank
// and step (predict_balanced_bytes' for the layers priced), 4 calls per layer and micro-batch.
inline std::vector<DispatchLevel> flat_dispatch(double bytes, double micro_batches, double layers, int nodes) {
  return {{bytes, all_to_all_calls(micro_batches, layers), nodes}};
}

// The nodes a token's K rows reach under balanced routing over Nn nodes: where the routing's groups
// are the nodes (--expert-groups = Nn, as 07's two-level dispatch requires) min(M, K, Nn), M the
// --group-limit; otherwise K experts drawn uniformly reach Nn·(1 − (1 − 1/Nn)^K) of them.
inline double nodes_per_token(const ModelConfig& m, int Nn) {
  if (m.expert_groups == Nn) return std::min({double(m.group_limit), double(m.top_k), double(Nn)});
  return Nn * (1 - std::pow(1 - 1.0 / Nn, m.top_k));
}

// Balanced routing over Nn nodes of Q ep ranks, per step and rank, of the two levels' bytes: of a
// micro-batch's N tokens each reaches r nodes (nodes_per_token), (Nn−1)/Nn of them others, so
// U = N·r·(Nn−1)/Nn copies go out and as many come in. Across nodes, forward: U·(row + 8K) (each
// copy with its K ids and K gate weights), U rows back (the combine's partial sums), one int to
// each other node; backward: U dy rows out, U dh rows and U·K dw floats back.
// Inside the node an entry fans out N·K pairs, (Q−1)/Q of them to other ranks, and as many come
// back, forward and backward; plus per·Nn ints to each other rank. Full recompute repeats the forward.
inline std::pair<double, double> predict_two_level_bytes(const RunConfig& rc, int dp, int ep, int Nn) {
  const ModelConfig& m = rc.model;
  const double N = double(rc.micro_batch) * m.seq, K = m.top_k, row = m.dim * dtype_size(rc.dtype), Q = double(ep) / Nn;
  const double f = (Nn - 1.0) / Nn, r = nodes_per_token(m, Nn), fwd = 1 + (rc.recompute == Recompute::Full);
  const double U = N * r * f, fan = N * K * (Q - 1) / Q;
  const double inter = fwd * (U * (row + 8 * K) + U * row + (Nn - 1) * 4) + U * row + U * (row + 4 * K);
  const double intra = fwd * (2 * fan * row + (Q - 1) * (m.experts / ep) * Nn * 4) + 2 * fan * row;
  const double steps = double(rc.batch / dp) / rc.micro_batch * m.layers;
  return {steps * inter, steps * intra};
}

// 07's two-level dispatch as the MoE term's levels: across the Nn nodes (the rail) and inside one
// (NVLink), each with a dispatch and a combine per layer and micro-batch, forward and backward.
inline std::vector<DispatchLevel> two_level_dispatch(const RunConfig& rc, int dp, int ep, int Nn, double micro_batches) {
  const auto [inter, intra] = predict_two_level_bytes(rc, dp, ep, Nn);
  const double calls = all_to_all_calls(micro_batches, rc.model.layers);
  return {{inter, calls, Nn}, {intra, calls, 1}};
}

// The MoE term's shape (common/training/step_time.h) for a rank of dp that runs `layers` of the
// model's MoE layers: its tokens, the routing imbalance its experts are priced at, its dispatch.
inline MoeShape moe_shape(const RunConfig& rc, int dp, int ep, double layers, double imbalance,
                          std::vector<DispatchLevel> dispatch) {
  MoeShape x;
  x.tokens = double(rc.batch) / dp * rc.model.seq;
  x.layers = layers;
  x.ep = ep;
  x.imbalance = imbalance;
  x.dispatch = std::move(dispatch);
  return x;
}

// The routing imbalance as the step feels it, from the loads every step's report sums over the dp
// ranks (moe_tokens_per_expert, [layer][expert]): each layer's all-to-all waits for the ep rank
// whose experts received the most rows, so per step Σ_l max_p rows(l, p) / Σ_l mean_p rows(l, p),
// averaged over the steps after this process's first (the warm-up the measured median leaves
// out). With dp > ep the dp/ep groups' loads are summed first: their sum stands for each group.
struct RoutedLoads {
  RoutedLoads(const ModelConfig& m, int ep) : m(m), ep(ep) {}
  const ModelConfig& m;
  const int ep;
  double sum = 0;
  long steps = 0, seen = 0;
  // A training step that also tallies its loads.
  std::function<StepResult(long)> tally(std::function<StepResult(long)> step) {
    return [this, step](long s) {
      StepResult r = step(s);
      add(r);
      return r;
    };
  }
  void add(const StepResult& r) {
    if (seen++ == 0 || !r.extra.contains("moe_tokens_per_expert")) return;
    const auto& v = r.extra.at("moe_tokens_per_expert").as_array();
    const int E = m.experts, per = E / ep;
    double busiest = 0, balanced = 0;
    for (int l = 0; l < m.layers; l++) {
      double most = 0, all = 0;
      for (int p = 0; p < ep; p++) {
        double rows = 0;
        for (int i = 0; i < per; i++) rows += v[size_t(l * E + p * per + i)].as_double();
        most = std::max(most, rows);
        all += rows;
      }
      busiest += most;
      balanced += all / ep;
    }
    if (balanced > 0) sum += busiest / balanced, steps++;
  }
  double imbalance() const { return steps > 0 ? sum / double(steps) : kAssumedImbalance; }
};

// This run's step: the dp ranks compute 1/dp of the tokens each, the MoE blocks as the MoE term
// prices them (the busiest rank's experts at `imbalance`; the all-to-alls on the critical path);
// the dense gradients are all-reduced over dp and each expert's over the ep_dp ranks that hold
// it, bucketed as 02 does, behind the last micro-batch's backward.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, int dp, int ep, double bucket_mb,
                                   double imbalance = kAssumedImbalance, int two_level_nodes = 0) {
  StepTerms s = compute_terms(g, rc, 1, 1, 1, dp);
  const int L = rc.model.layers;
  const double mbs = double(rc.batch) / dp / rc.micro_batch;
  const std::vector<DispatchLevel> levels = two_level_nodes > 1 ? two_level_dispatch(rc, dp, ep, two_level_nodes, mbs)
                                                                 : flat_dispatch(predict_balanced_bytes(rc, dp, ep), mbs, L, 1);
  add_moe_term(s, g, rc, moe_shape(rc, dp, ep, L, imbalance, levels));
  const ParamTable t = Model::make_table(rc.model, 1, shard_spec(ep, 0));
  const ParamSplit split = param_split(t);
  const double grad_bytes = 4.0 * double(t.total);
  const double calls = dp::reduction_calls(true, L, grad_bytes, bucket_mb);
  s.t_dp = dp::reduction_seconds(g.net, split.dense, dp, calls, 1) + dp::reduction_seconds(g.net, split.experts, dp / ep, calls, 1);
  s.t_dp_exposed = dp::exposed_seconds(true, s.t_dp, s.last_backward(mbs), grad_bytes, bucket_mb);
  s.total();
  return s;
}

// The run's prediction, priced at the imbalance its routing has shown by the time it is asked, its
// dispatch flat or (two_level_nodes > 1) over that many nodes.
inline std::function<StepTerms(const Gpu&)> predictor(const RunConfig& rc, int dp, int ep, double bucket_mb,
                                                       const RoutedLoads& loads, int two_level_nodes) {
  return [&rc, dp, ep, bucket_mb, &loads, two_level_nodes](const Gpu& g) {
    return predict_step_time(g, rc, dp, ep, bucket_mb, loads.imbalance(), two_level_nodes);
  };
}

inline void print_plan(RunLog& log, const RunConfig& rc, int dp, int ep) {
  const ParamSplit s = param_split(rc, ep);
  const MemoryPrediction p = predict_memory(rc, ep);
  const ModelConfig& m = rc.model;
  print_model(log, m);
  const double e = dtype_size(rc.dtype);
  log.line("dp %d, ep %d: per rank %d of %d experts per layer; expert params %s, dense params %s (replicated)", dp, ep,
           m.experts / ep, m.experts, human_bytes(e * s.experts).c_str(), human_bytes(e * s.dense).c_str());
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s (balanced routing)",
           human_bytes(p.params).c_str(), human_bytes(p.grads).c_str(), human_bytes(p.optimizer).c_str(),
           human_bytes(p.activations).c_str());
  const double rows = double(rc.micro_batch) * m.seq * m.top_k;
  log.line("per layer and micro-batch: N·K = %.0f routed rows of %s; balanced, (ep-1)/ep of them cross ranks: "
           "dispatch %s + combine %s forward, the same backward",
           rows, human_bytes(m.dim * e).c_str(), human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str(),
           human_bytes((ep - 1.0) / ep * rows * m.dim * e).c_str());
  log.line("per-rank all_to_all per step (balanced): %s", human_bytes(predict_balanced_bytes(rc, dp, ep)).c_str());
}

// The nodes the ep group spans, as MPI reports them (mesh.h's node_of_ranks; collective over the
// world): an all-to-all between ranks of two nodes crosses the inter-node network, one inside a
// node stays on its NVLink.
inline std::vector<int> report_nodes(RunLog& log, Comm& group) {
  const std::vector<int> nodes = node_of_ranks(group);
  std::string each;
  for (int n : nodes) each += " " + std::to_string(n);
  log.line("ep group: %d ranks on %d node(s) (MPI_COMM_TYPE_SHARED); node of each ep rank:%s", group.size(),
           *std::max_element(nodes.begin(), nodes.end()) + 1, each.c_str());
  return nodes;
}

// The ep group's nodes (collective over the world), reported; --dispatch two-level refused, on
// every rank alike, where they cannot carry it.
inline Topology discover_topology(RunLog& log, Mesh& mesh, const ModelConfig& m, bool two_level) {
  Topology t = make_topology(report_nodes(log, mesh.ep()), two_level);
  std::string err = two_level ? two_level_problem(t, m) : "";
  // The ranks that hold the same experts (ep_dp) reduce their gradients together: alike laid out.
  int slot = err.empty() ? t.slot(mesh.ep_rank) : mesh.ep_rank, lo = 0, hi = 0;
  watched_allreduce(&slot, &lo, 1, MPI_INT, MPI_MIN, mesh.ep_dp().mpi(), "all_reduce (the expert slot, least)");
  watched_allreduce(&slot, &hi, 1, MPI_INT, MPI_MAX, mesh.ep_dp().mpi(), "all_reduce (the expert slot, most)");
  if (err.empty() && lo != hi) err = "--dispatch two-level needs every ep group on its nodes alike";
  err = first_error(err, MPI_COMM_WORLD, "the two-level dispatch");
  if (!err.empty()) config_error("%s", err.c_str());
  if (two_level)
    log.line("two-level dispatch: %d node(s) × %d ep rank(s); node n holds experts [n·%d, (n+1)·%d), group n", t.nodes,
             t.per_node, m.experts / t.nodes, m.experts / t.nodes);
  return t;
}

// This run's counts per step (rank 0's) next to the balanced prediction and to what the flat
// dispatch would send across nodes for the same routing: every (token, expert) row, both ways.
inline void print_levels(RunLog& log, const LevelCounts& c, double n, const RunConfig& rc) {
  const double row = rc.model.dim * dtype_size(rc.dtype);
  log.line("ep two-level (this run's routing, rank 0, per step): across nodes %.0f token copies out, %.0f in, one row "
           "each on every hop (dispatch, combine, and both backward): %s",
           c.copies / n, c.copies_in / n, human_bytes(c.inter_bytes / n).c_str());
  log.line("  they stand for %.0f (token, expert) rows out and %.0f in; a flat dispatch of the same routing moves each "
           "of those across, both ways: %s of rows",
           c.pairs_out / n, c.pairs_in / n, human_bytes(2 * (c.pairs_out + c.pairs_in) / n * row).c_str());
  log.line("  inside nodes (forward and backward): %.0f rows fanned out, %.0f back: %s", c.fan_out / n, c.fan_in / n,
           human_bytes(c.intra_bytes / n).c_str());
}

// The predictions above assume balanced routing; a real router is not. Its imbalance, from this
// run's routing counts (rank 0's): the all-to-all bytes over the balanced prediction, and the most
// rows rank 0's experts received in a layer over the balanced N·K (its MoE activations grow so).
inline void print_imbalance(RunLog& log, double balanced, double routed, double busiest_rows) {
  log.line("ep routing imbalance (this run's counts, rank 0): all_to_all %s per step = %.4f × the balanced %s;",
           human_bytes(routed).c_str(), balanced > 0 ? routed / balanced : 0.0, human_bytes(balanced).c_str());
  log.line("  its experts received up to %.2f × the balanced N·K rows in one layer, so its MoE activations can exceed "
           "the balanced prediction by up to that factor", busiest_rows);
}

// --dispatch flat | two-level (refused otherwise): whether the dispatch is two-level. `help` says
// what the flag does in the program that reads it.
inline bool read_dispatch(Args& a, const char* help) {
  const std::string d = a.get_str("--dispatch", "flat", help);
  if (d != "flat" && d != "two-level") config_error("--dispatch must be flat or two-level (got '%s')", d.c_str());
  return d == "two-level";
}
}  // namespace ep

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 7
using namespace ts;

static const char* kDoc =
    "07_expert_parallel: expert parallelism for the mixture-of-experts model: experts sharded over --ep ranks,\n"
    "tokens dispatched and combined with all-to-all, dense weights data-parallel.\n"
    "usage: mpirun -np N 07_expert_parallel --dp N --ep E --experts X [--top-k K] [flags]";

// Like 02: this rank's contiguous slice of the global batch in micro-batches, only the last one
// reducing. The gradient norm counts the dense tensors once (ep rank 0) and each expert on its
// owner, summed over the ep group (every ep group holds the same reduced values).
// Two gradient reductions: the dense tensors' over every dp rank, each expert's over the ranks
// that hold a copy of it (ep_dp), one bucketed reducer each over its ranges of the flat buffer.
struct Reducers {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  Reducers(Model& m, Mesh& mesh, double bucket_mb)
      : ranges(split(m.table)),
        dense(m, mesh.dp(), true, bucket_mb, ranges.first),
        experts(m, mesh.ep_dp(), true, bucket_mb, ranges.second) {}
  void set_sync(bool sync) {
    dense.set_sync(sync);
    experts.set_sync(sync);
  }
  void finish() {
    dense.finish();
    experts.finish();
  }
  static std::pair<Ranges, Ranges> split(const ParamTable& t) {
    std::pair<Ranges, Ranges> r;
    ep::split_ranges(t, r.first, r.second);
    return r;
  }
  const std::pair<Ranges, Ranges> ranges;  // dense, experts (before the reducers that use them)
  dp::GradReducer dense, experts;
};

static StepResult train_step(Model& model, AdamW& opt, Reducers& reducers, const TokenData& data, const RunConfig& rc,
                             Mesh& mesh, long step) {
  const int T = rc.model.seq, mb = rc.micro_batch, local = rc.batch / mesh.cfg.dp;
  ts::zero(model.grads);
  for (int s0 = 0; s0 < local; s0 += mb) {
    reducers.set_sync(s0 + mb == local);
    MicroBatch b = make_microbatch(data, step, rc.batch, T, mesh.dp_rank * local + s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
  }
  reducers.finish();
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {mesh.ep().mpi()});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  StepResult r{global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.dp().mpi()}), norm};
  moe_step_report(model, r, {mesh.dp().mpi()}, opt.master);  // the bias from every rank's loads
  return r;
}

// The two levels' bytes: measured by their communicators, counted from the routing, predicted.
static void levels_report(Json& c, RunLog& log, const RunConfig& rc, Mesh& mesh, ep::ExpertParallelMoe& moe, long steps) {
  const double n = double(std::max(1L, steps));
  const auto [inter, intra] = ep::predict_two_level_bytes(rc, mesh.cfg.dp, mesh.cfg.ep, moe.topology().nodes);
  const ep::LevelCounts& l = moe.levels;
  for (auto [comm, predicted, routed] : {std::tuple<Comm*, double, double>{&moe.inter(), inter, l.inter_bytes / n},
                                         {&moe.intra(), intra, l.intra_bytes / n}}) {
    Json j = comm_report(log, *comm, steps, {{"all_to_all", predicted}});
    if (j.at(comm->name()).contains("all_to_all")) j[comm->name()]["all_to_all"]["from_routing"] = routed;
    c[comm->name()] = j.at(comm->name());
  }
  c["ep_inter"]["all_to_all"]["copies"] = l.copies / n;
  c["ep_inter"]["all_to_all"]["copies_in"] = l.copies_in / n;
  c["ep_inter"]["all_to_all"]["pairs_out"] = l.pairs_out / n;
  c["ep_inter"]["all_to_all"]["pairs_in"] = l.pairs_in / n;
  ep::print_levels(log, l, n, rc);
}

// The loop's predicted memory (balanced routing), checkpoint and reports: the first ep group
// writes (each expert by its owner, the dense tensors by ep rank 0, the copies that count, all at
// their global offsets); the all-to-all bytes against the balanced prediction and this run's
// routing; both reductions' bytes.
static void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, Model& model, AdamW& opt,
                        ep::ExpertParallelMoe& moe) {
  loop.predicted = ep::predict_memory(rc, mesh.cfg.ep);
  loop.save = [&](long step) {
    std::vector<CheckpointSlice> mine;
    if (mesh.dp_rank < mesh.cfg.ep) mine.push_back({0, model.table.total, weights_f32(model.params, opt), &opt});
    Json m = Json::object();
    m["dp"] = mesh.cfg.dp;
    m["ep"] = mesh.cfg.ep;
    save_checkpoint(rc.save_dir, rc, model.table, mine, step, m);
  };
  loop.comm = [&](long steps_run) {
    const double n = double(std::max(1L, steps_run));
    const ep::ParamSplit split = ep::param_split(rc, mesh.cfg.ep);
    const double balanced = ep::predict_balanced_bytes(rc, mesh.cfg.dp, mesh.cfg.ep), routed = moe.routed_bytes / n;
    Json c = comm_report(log, mesh.ep(), steps_run, {{"all_to_all", balanced}});
    if (c.at("ep").contains("all_to_all")) {
      c["ep"]["all_to_all"]["from_routing"] = routed;
      c["ep"]["all_to_all"]["inter_node"] = moe.inter_node_bytes / n;
    }
    if (!moe.topology().two_level) ep::print_imbalance(log, balanced, routed, moe.busiest_rows);
    if (!moe.topology().two_level) log.line("  of it across nodes (rank 0): %s per step, inside its node: %s", human_bytes(moe.inter_node_bytes / n).c_str(),
             human_bytes(routed - moe.inter_node_bytes / n).c_str());
    if (moe.topology().two_level) levels_report(c, log, rc, mesh, moe, steps_run);
    Json d = comm_report(log, mesh.dp(), steps_run, {{"all_reduce", dp::allreduce_bytes(split.dense, mesh.cfg.dp)}});
    Json x = comm_report(log, mesh.ep_dp(), steps_run,
                         {{"all_reduce", dp::allreduce_bytes(split.experts, mesh.ep_dp().size())}});
    for (const Json* j : {&d, &x})
      for (const auto& [k, v] : j->items()) c[k] = v;
    return c;
  };
}

// The chapter's flags: the dp degree, the ep degree within it, the bucket size, the dispatch.
struct EpFlags {
  double bucket_mb = 25;
  bool two_level = false;
};
static EpFlags read_ep_flags(Args& args, MeshConfig& mc) {
  mc.dp = args.get_int("--dp", 1, "data-parallel degree (= number of ranks)", degree_range());
  mc.ep = args.get_int("--ep", 1, "expert-parallel degree: experts sharded over groups of this many dp ranks",
                       degree_range());
  EpFlags f;
  f.bucket_mb = args.get_double("--bucket-mb", 25, "gradient bucket size in MiB", dp::bucket_mb_range());
  f.two_level = ep::read_dispatch(args, "flat: one all-to-all over the ep group; two-level: a token once to each node "
                                         "it routes to, then to its experts inside the node (DeepSeek-V3 §3.2.2; needs "
                                         "--expert-groups = the nodes)");
  return f;
}

int main(int argc, char** argv) {
  EpFlags f;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { f = read_ep_flags(a, mc); });
  RunConfig& rc = run.rc;
  const MeshConfig& mc = run.mc;
  ep::validate(rc, mc);
  if (!run.start([&] { ep::print_plan(run.log(), rc, mc.dp, mc.ep); }, [&] { return ep::predict_memory(rc, mc.ep); }))
    return 0;
  const ep::Topology topo = ep::discover_topology(run.log(), run.mesh, rc.model, f.two_level);
  Model& model = run.build_model({ep::shard_spec(mc.ep, topo.slot(run.mesh.ep_rank))});  // its experts, every dense weight
  ep::ExpertParallelMoe& moe = ep::install(model, run.mesh.ep(), topo);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);  // each rank initialises (or loads) its experts and the dense weights
  Reducers reducers(model, run.mesh, f.bucket_mb);
  Loop loop;
  ep::RoutedLoads loads(rc.model, mc.ep);  // the step-time prediction's imbalance, from this run's routing
  loop.step = loads.tally([&](long step) { return train_step(model, opt, reducers, run.data, rc, run.mesh, step); });
  add_reports(loop, run.log(), rc, run.mesh, model, opt, moe);
  return run.train(loop, ep::predictor(rc, mc.dp, mc.ep, f.bucket_mb, loads, topo.two_level ? topo.nodes : 0), "dp");
}
#endif  // TS_PROGRAM == 7
#endif  // TS_07_EXPERT_PARALLEL_CU
