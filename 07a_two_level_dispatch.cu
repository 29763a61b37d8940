// 07a_two_level_dispatch.cu — DeepSeek-V3's node-limited dispatch (technical report §3.2.2), read
// after 07_expert_parallel.cu: what it adds to chapter 07 is a second way for a token's rows to
// reach their experts, `--dispatch two-level`, registered with the chapter's dispatches.
//
// Why: on a cluster the flat all-to-all sends a token's row across the inter-node network once
// per expert it picked on another node, and that network (InfiniBand, ~50 GB/s) is several times
// slower than NVLink inside a node. DeepSeek-V3 limits each token to M nodes (--group-limit of
// --expert-groups = nodes) and sends it once per node; the node forwards it to its experts.
//
// On the nodes MPI reports (mesh.h's node_of_ranks): the experts are placed by node (node n holds
// group n of --expert-groups = nodes), a token goes once to each node it routes to (over the rail:
// the ranks with its rank's local index, one per node) with its experts' ids and gate weights, and
// that node's rank (the entry) fans it out to its experts' ranks; the outputs return to the entry,
// which sends one gate-weighted partial sum per (token, node) back (the block's weighting:
// TwoLevelMoe replaces MoeBlock's routed_forward, where the flat dispatch only replaces
// experts_forward). Backward, dy crosses once per (token, node) and is scaled per expert at the
// entry, the input gradients come back summed per node, and the gate weights' gradient is formed
// at the entry from the outputs it kept, K floats per copy. Bytes per level are counted from the
// routing and printed against the communicators' and the balanced prediction
// (lab/07a_two_level_dispatch.h).
//
//   MPIR_CVAR_NUM_CLIQUES=2 mpirun -np 4 ./build/07_expert_parallel --preset tiny --experts 8 --top-k 2 --ffn 64 --expert-ffn 32 --shared-experts 1 --router sigmoid --routed-scaling 2.5 --expert-groups 2 --group-limit 1 --batch 8 --steps 3 --dp 4 --ep 4 --quiet --dispatch two-level
#ifndef TS_07A_TWO_LEVEL_DISPATCH_CU
#define TS_07A_TWO_LEVEL_DISPATCH_CU
#include <algorithm>
#include <memory>

#include "07_expert_parallel.cu"
#include "comm/watchdog.h"

namespace ep {
using namespace ts;

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

// The MoE block with the two-level dispatch: it owns the gate weighting too (MoeBlock's
// routed_forward/routed_backward), summing on the experts' nodes.
class TwoLevelMoe : public ExpertParallelMoe {
 public:
  TwoLevelMoe(const Model& m, Comm& group, const Topology& topo)
      : ExpertParallelMoe(m, group, topo.node), topo_(topo) {
    plans_.resize(size_t(m.cfg.layers));
    // The rail: the ranks with this rank's local index, one per node (what crosses nodes); the
    // node: the ep ranks that share this one's (what stays on NVLink).
    const int r = ep_.rank();
    inter_ = std::make_unique<Comm>("ep_inter", watched_split(ep_.mpi(), topo_.local[size_t(r)], topo_.node[size_t(r)],
                                                              "the ep group's ranks of one local index"));
    intra_ = std::make_unique<Comm>("ep_intra", watched_split(ep_.mpi(), topo_.node[size_t(r)], topo_.local[size_t(r)],
                                                              "the ep group's ranks of one node"));
  }

  // Forward (DeepSeek-V3 §3.2.2): each token once to each node with its experts (the rail), then
  // one row per (token, expert) to the expert's rank inside the node; the owner groups them as the
  // flat dispatch does. The outputs come back to the entry, which keeps them (for dw) and weights
  // and sums each copy's: one row per (token, node) crosses back (sum_levels).
  void routed_forward(Model& m, int l, const Tensor& y, const Tensor& x, const Tensor&,
                      const std::vector<int64_t>& counts, LayerActs& a) override {
    TwoLevelPlan& p = plans_[size_t(l)] = TwoLevelPlan();
    plan_levels(p, m, counts, a);
    busiest_rows = std::max(busiest_rows, double(p.grouped.size()) / double(std::max<int64_t>(1, x.size(0))));
    Tensor arrived = rows(m, size_t(sum(p.copies_in)), Tag::Workspace);
    exchange(*inter_, arrived, p.copies_in, gathered(m, x, p.copy_rows), p.copies_out, "dispatch");
    Tensor recv = rows(m, size_t(sum(p.fan_in)), Tag::Workspace);
    exchange(*intra_, recv, p.fan_in, gathered(m, arrived, p.fan_copy), p.fan_out, "dispatch");
    Tensor xr = gathered(m, recv, p.grouped, Tag::Activations);
    TwoLevelActs& s = acts<TwoLevelActs>(a);
    s.in = xr;
    Tensor outr = rows(m, xr.size(0), Tag::Workspace);
    run_experts(m, l, topo_.slot(ep_.rank()) * per_, p.local_counts, xr, outr, a);
    Tensor kept = s.kept = rows(m, p.fan_copy.size(), Tag::Activations);  // o_k[t], fan order
    exchange(*intra_, kept, p.fan_out, gathered(m, outr, p.ungrouped), p.fan_in, "combine");
    sum_levels(m, p, y, kept, copy_slots(m, p), from_host_f32(p.copy_w, m.dev).reshape({sum(p.copies_in), m.cfg.top_k}),
               "combine");
  }
  // Backward: dL/dy_n[t] = dy[t] for each node n, so dy's row travels as the forward's copy did,
  // once per (token, node); the entry scales it per expert, dO_k = w[t,k]·dy[t] (01's moe_gather,
  // the same product), fans it out, sums the input gradients that return per copy (sum_levels), and
  // forms dw[t,k] = dy[t]·o_k[t] from the output rows it kept (gate_weight_grads).
  void routed_backward(Model& m, int l, const Tensor& dh, const Tensor& dw, const Tensor& dy,
                       const std::vector<int64_t>&, LayerActs& a) override {
    const TwoLevelPlan& p = plans_[size_t(l)];
    const TwoLevelActs& s = acts<TwoLevelActs>(a);
    tally_levels(p, m, false);
    Tensor arrived = rows(m, size_t(sum(p.copies_in)), Tag::Workspace);
    exchange(*inter_, arrived, p.copies_in, gathered(m, dy, p.copy_token), p.copies_out, "dispatch backward");
    Tensor fan = rows(m, p.fan_copy.size(), Tag::Workspace);
    moe_gather(fan, arrived, from_host_i32(p.fan_copy, m.dev), from_host_f32(p.fan_w, m.dev));
    Tensor recv = rows(m, size_t(sum(p.fan_in)), Tag::Workspace);
    exchange(*intra_, recv, p.fan_in, fan, p.fan_out, "dispatch backward");
    Tensor dxr = rows(m, recv.size(0), Tag::Workspace);
    run_experts_backward(m, l, topo_.slot(ep_.rank()) * per_, p.local_counts, s.in, gathered(m, recv, p.grouped), dxr,
                         a);
    exchange(*intra_, fan, p.fan_out, gathered(m, dxr, p.ungrouped), p.fan_in, "combine backward");
    const Tensor slots = copy_slots(m, p);  // both sums below read it
    sum_levels(m, p, dh, fan, slots, Tensor(), "combine backward");
    gate_weight_grads(m, p, dw, arrived, s.kept, slots);
  }

  LevelCounts levels;
  const Topology& topology() const { return topo_; }
  Comm& inter() { return *inter_; }
  Comm& intra() { return *intra_; }

 private:
  // What the two-level dispatch saves beyond the base block's: the expert outputs the entry kept.
  struct TwoLevelActs : MoeActs {
    Tensor kept;  // [fanned rows, D] o_k[t] in fan order, for the gate weights' gradient
  };
  std::shared_ptr<MoeActs> new_acts() const override { return std::make_shared<TwoLevelActs>(); }

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
    const MoeActs& s = acts(a);
    const std::vector<int32_t> src = to_host_i32(s.src);
    std::vector<int32_t> lists;
    std::vector<float> weights;
    plan_sources(p, lists, weights, counts, to_host_i32(s.perm), src, to_host_f32(s.wa), topo_, K);
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
    const std::vector<int32_t> idx = to_host_i32(acts(a).idx);
    const size_t K = size_t(acts(a).idx.size(1));
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
  const Topology topo_;
  std::unique_ptr<Comm> inter_, intra_;  // across nodes (one rank each), inside one
  std::vector<TwoLevelPlan> plans_;      // [L] the last forward's routes of each layer
};

// The ep group's nodes checked for the two-level dispatch (collective over the world), refused on
// every rank alike where they cannot carry it; this rank's expert slot.
inline int place_two_level(RunLog& log, Mesh& mesh, const ModelConfig& m, const std::vector<int>& nodes) {
  const Topology t = make_topology(nodes, true);
  std::string err = two_level_problem(t, m);
  // The ranks that hold the same experts (ep_dp) reduce their gradients together: alike laid out.
  int slot = err.empty() ? t.slot(mesh.ep_rank) : mesh.ep_rank, lo = 0, hi = 0;
  watched_allreduce(&slot, &lo, 1, MPI_INT, MPI_MIN, mesh.ep_dp().mpi(), "all_reduce (the expert slot, least)");
  watched_allreduce(&slot, &hi, 1, MPI_INT, MPI_MAX, mesh.ep_dp().mpi(), "all_reduce (the expert slot, most)");
  if (err.empty() && lo != hi) err = "--dispatch two-level needs every ep group on its nodes alike";
  err = first_error(err, MPI_COMM_WORLD, "the two-level dispatch");
  if (!err.empty()) config_error("%s", err.c_str());
  log.line("two-level dispatch: %d node(s) × %d ep rank(s); node n holds experts [n·%d, (n+1)·%d), group n", t.nodes,
           t.per_node, m.experts / t.nodes, m.experts / t.nodes);
  return slot;
}

inline const bool kTwoLevelRegistered = add_dispatch(
    {"two-level",
     "two-level: a token once to each node it routes to, then to its experts inside the node (DeepSeek-V3 §3.2.2; "
     "needs --expert-groups = the nodes)",
     place_two_level, [](Model& m, Comm& group, const std::vector<int>& nodes) -> ExpertParallelMoe& {
       return install(m, new TwoLevelMoe(m, group, make_topology(nodes, true)));
     }});
}  // namespace ep
#endif  // TS_07A_TWO_LEVEL_DISPATCH_CU
