// algorithms.cu — the collectives written out over the group's own send/recv (algorithms.h). Each
// function is one of the playbook's figures as code; notes/collectives.md derives the costs.
//
// Conventions. A buffer of n elements split into P parts: part i is elements [n·i/P, n·(i+1)/P),
// so parts differ by at most one element and, when P divides n, part i is exactly chunk i of
// reduce_scatter's input / all_gather's output. A "ring" is a list of group ranks in ring order
// and `p` this rank's position in it. Every sum is add_inplace(mine, received) on the tensor's
// device; each part is summed on one rank only and then copied to the others, so every rank ends
// with the same bits (the order of each algorithm's sums is stated where it sums).
#include "comm/algorithms.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "comm/watchdog.h"
#include "kernels/elementwise.h"

namespace ts {

namespace {

Collectives g_algo = Collectives::Library;

const struct {
  Collectives a;
  const char* name;
} kNames[] = {{Collectives::Library, "library"},
              {Collectives::Ring, "ring"},
              {Collectives::Tree, "tree"},
              {Collectives::HalvingDoubling, "halving-doubling"},
              {Collectives::TwoLevel, "two-level"}};

// The messages of a written-out collective, apart from any a caller has in flight on the group (MPI
// matches by tag; NCCL matches a pair's messages in issue order, and every rank issues these in
// the same order).
constexpr int kTag = 7061;

Tensor part(const Tensor& t, int parts, int i) {
  const int64_t n = t.numel(), a = n * i / parts, b = n * (i + 1) / parts;
  return t.view(a, {b - a});
}
// Parts [i, j) together.
Tensor parts(const Tensor& t, int parts, int i, int j) {
  const int64_t n = t.numel(), a = n * i / parts, b = n * j / parts;
  return t.view(a, {b - a});
}
Tensor scratch(const Tensor& like, int64_t n) { return Tensor::empty({std::max<int64_t>(n, 1)}, like.dtype, like.device(), Tag::Comm); }

// One step: send `s` to dst while receiving `r` from src, both at once so a ring cannot deadlock.
// An empty side is skipped; both ends of a message compute the same size, so they agree.
void exchange(Comm& c, const Tensor& s, int dst, const Tensor& r, int src) {
  if (s.numel() && r.numel()) c.send_recv(s, dst, r, src, kTag);
  else if (s.numel()) c.send(s, dst, kTag);
  else if (r.numel()) c.recv(r, src, kTag);
}

// ----- the ring (the playbook's appendix, figure by figure) --------------------------------------

// Reduce-scatter on a ring of P ranks, in place: afterwards part p of buf holds the sum of every
// rank's part p. Step s (0..P-2): send part p-s-1 to the next rank, receive part p-s-2 from the
// previous one and add it to ours. A part c therefore starts at position c+1 and travels c+1 →
// c+2 → … → c, gaining one term per hop: its sum is ((x_{c+1} + x_{c+2}) + …) + x_c. After P-1
// steps the last part received, p-(P-2)-2 = p-P ≡ p, is complete. Each rank sends P-1 parts of
// n/P: time (P-1)(α + n/P·β).
void ring_reduce_scatter(Comm& c, const std::vector<int>& ring, int p, const Tensor& buf) {
  const int P = int(ring.size());
  if (P == 1) return;
  const int next = ring[(p + 1) % P], prev = ring[(p + P - 1) % P];
  Tensor tmp = scratch(buf, (buf.numel() + P - 1) / P);
  for (int s = 0; s < P - 1; s++) {
    const int send = ((p - s - 1) % P + P) % P, recv = ((p - s - 2) % P + P) % P;
    Tensor mine = part(buf, P, recv), got = tmp.view(0, {mine.numel()});
    exchange(c, part(buf, P, send), next, got, prev);
    if (mine.numel()) add_inplace(mine, got);
  }
}

// All-gather on a ring, in place: part i of buf at position i reaches every rank. Step s: send
// part p-s (ours at s = 0, then the one just received), receive part p-s-1. (P-1)(α + n/P·β).
void ring_all_gather(Comm& c, const std::vector<int>& ring, int p, const Tensor& buf) {
  const int P = int(ring.size());
  const int next = ring[(p + 1) % P], prev = ring[(p + P - 1) % P];
  for (int s = 0; s < P - 1; s++)
    exchange(c, part(buf, P, ((p - s) % P + P) % P), next, part(buf, P, ((p - s - 1) % P + P) % P), prev);
}

// All-reduce = reduce-scatter + all-gather: 2(P-1)(α + n/P·β), the bandwidth-optimal 2(P-1)/P·n.
void ring_all_reduce(Comm& c, const std::vector<int>& ring, int p, const Tensor& buf) {
  ring_reduce_scatter(c, ring, p, buf);
  ring_all_gather(c, ring, p, buf);
}

// Broadcast as a pipelined chain root → root+1 → … → root-1, the message cut into P = N pieces:
// at step t position v sends piece t-v onward and receives piece t-v+1, so the pipe fills in N-2
// steps and drains P pieces: (P+N-2)(α + n/P·β) = (2N-2)(α + n/N·β).
void ring_broadcast(Comm& c, const Tensor& buf, int root) {
  const int N = c.size(), v = (c.rank() - root + N) % N, P = N;
  const int next = (c.rank() + 1) % N, prev = (c.rank() + N - 1) % N;
  auto piece = [&](int i, bool real) { return real && i >= 0 && i < P ? part(buf, P, i) : buf.view(0, {0}); };
  for (int t = 0; t <= P + N - 3; t++) exchange(c, piece(t - v, v < N - 1), next, piece(t - v + 1, v > 0), prev);
}

std::vector<int> whole_group(const Comm& c) {
  std::vector<int> ring(size_t(c.size()));
  for (int i = 0; i < c.size(); i++) ring[size_t(i)] = i;
  return ring;
}

// ----- recursive halving-doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005) -------------

// Reduce-scatter by recursive halving on N = 2^k ranks, in place: at distance d = N/2, N/4, …, 1
// a rank and its partner r XOR d split the parts they still share [lo, hi) in two; the one whose
// bit d is clear keeps the lower half, sends the upper half and adds the partner's lower half. The
// bits of r pick the halves from the top bit down, so after k steps rank r keeps part r. The sum of
// part c is a tree: pairs at distance N/2 first, then N/4, …: k steps of n/2, n/4, … elements:
// log N·α + (N-1)/N·n·β.
void halving_reduce_scatter(Comm& c, const Tensor& buf) {
  const int N = c.size(), r = c.rank();
  Tensor tmp = scratch(buf, buf.numel() / 2 + 1);
  int lo = 0, hi = N;
  for (int d = N / 2; d >= 1; d /= 2) {
    const int mid = (lo + hi) / 2;
    const bool lower = (r & d) == 0;
    const int keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    Tensor keep = parts(buf, N, keep_lo, keep_hi), got = tmp.view(0, {keep.numel()});
    exchange(c, lower ? parts(buf, N, mid, hi) : parts(buf, N, lo, mid), r ^ d, got, r ^ d);
    if (keep.numel()) add_inplace(keep, got);
    lo = keep_lo, hi = keep_hi;
  }
}

// All-gather by recursive doubling, in place: at distance d = 1, 2, …, N/2 a rank swaps all it
// holds (d parts, next to its partner's) with r XOR d, doubling it: log N·α + (N-1)/N·n·β.
void doubling_all_gather(Comm& c, const Tensor& buf) {
  const int N = c.size(), r = c.rank();
  int lo = r, hi = r + 1;
  for (int d = 1; d < N; d *= 2) {
    const int w = hi - lo, plo = (r & d) == 0 ? hi : lo - w;
    exchange(c, parts(buf, N, lo, hi), r ^ d, parts(buf, N, plo, plo + w), r ^ d);
    lo = std::min(lo, plo), hi = std::max(hi, plo + w);
  }
}

// ----- NCCL's double binary tree (src/graph/trees.cc) ---------------------------------------------

// The binary tree over labels 0..N-1 that NCCL builds (ncclGetBtree): label v's parent clears v's
// lowest set bit and sets the next one up, or only clears it where that leaves the tree; 0 is the
// root with one child. Every odd label is a leaf, so about half the ranks only send.
int btree_parent(int v, int N) {
  if (v == 0) return -1;
  const int bit = v & -v, up = (v ^ bit) | (bit << 1);
  return up < N ? up : v ^ bit;
}

struct TreeLinks {
  int parent = -1, top = 0;   // this rank's parent (-1: the top) and the tree's top rank
  std::vector<int> children;  // ascending label: the order their sums are added
};

// Tree h of the double tree, counted from `root` (0 for an all-reduce). Tree 1 is tree 0 shifted
// by one label (N odd) or mirrored (N even), as ncclGetDtree builds it, so that the leaves of one
// are the inner nodes of the other: each rank sends and receives about the same in the two.
TreeLinks tree_links(int N, int h, int r, int root) {
  auto label = [&](int q) {
    const int x = (q - root + N) % N;
    return h == 0 ? x : N % 2 ? (x + N - 1) % N : N - 1 - x;
  };
  auto rank = [&](int v) { return ((h == 0 ? v : N % 2 ? (v + 1) % N : N - 1 - v) + root) % N; };
  TreeLinks t;
  const int v = label(r), up = btree_parent(v, N);
  t.parent = up < 0 ? -1 : rank(up);
  t.top = rank(0);
  for (int u = 0; u < N; u++)
    if (btree_parent(u, N) == v) t.children.push_back(rank(u));
  return t;
}

// Up the tree: own + child 0's subtree + child 1's subtree, then on to the parent.
void tree_reduce(Comm& c, const TreeLinks& t, const Tensor& buf, const Tensor& tmp) {
  for (int child : t.children) {
    c.recv(tmp, child, kTag);
    add_inplace(buf, tmp);
  }
  if (t.parent >= 0) c.send(buf, t.parent, kTag);
}
void tree_down(Comm& c, const TreeLinks& t, const Tensor& buf) {
  if (t.parent >= 0) c.recv(buf, t.parent, kTag);
  for (int child : t.children) c.send(buf, child, kTag);
}

// All-reduce: half h of the buffer reduced up tree h to its top and sent back down. Depth
// D = ⌊log2 N⌋+1 and each half goes up and down whole (the trees run one after the other here;
// NCCL pipelines chunks through both at once): 2·2D(α + n/2·β) = 4D·α + 2D·n·β unpipelined, while
// NCCL's pipelined trees cost about 2D·α + n·β. Sums: each node adds its children in label order.
void tree_all_reduce(Comm& c, const Tensor& buf) {
  Tensor tmp = scratch(buf, buf.numel() / 2 + 1);
  for (int h = 0; h < 2; h++) {
    Tensor half = part(buf, 2, h);
    if (!half.numel()) continue;
    const TreeLinks t = tree_links(c.size(), h, c.rank(), 0);
    tree_reduce(c, t, half, tmp.view(0, {half.numel()}));
    tree_down(c, t, half);
  }
}

// Broadcast: half h down tree h counted from the root; tree 1's top is another rank, which gets
// its half from the root first (one extra hop).
void tree_broadcast(Comm& c, const Tensor& buf, int root) {
  for (int h = 0; h < 2; h++) {
    Tensor half = part(buf, 2, h);
    if (!half.numel()) continue;
    const TreeLinks t = tree_links(c.size(), h, c.rank(), root);
    if (t.top != root && c.rank() == root) c.send(half, t.top, kTag);
    if (t.top != root && c.rank() == t.top) c.recv(half, root, kTag);
    tree_down(c, t, half);
  }
}

// ----- two-level: inside the node, across nodes, inside the node -----------------------------------

// The rings of the hierarchy, or false where the nodes hold different numbers of the group's ranks.
// local: this node's ranks (ascending); cross: the rank at this rank's local position on each node.
bool two_level_rings(Comm& c, std::vector<int>& local, int& lp, std::vector<int>& cross, int& cp) {
  const std::vector<int>& node = nodes_of(c);
  const int M = *std::max_element(node.begin(), node.end()) + 1, L = c.size() / M;
  std::vector<std::vector<int>> members(static_cast<size_t>(M));
  for (int q = 0; q < c.size(); q++) members[size_t(node[size_t(q)])].push_back(q);
  for (const auto& m : members)
    if (int(m.size()) != L) return false;
  cp = node[size_t(c.rank())];
  local = members[size_t(cp)];
  lp = int(std::find(local.begin(), local.end(), c.rank()) - local.begin());
  cross.clear();
  for (const auto& m : members) cross.push_back(m[size_t(lp)]);
  return true;
}

// All-reduce on M nodes of L ranks: reduce-scatter inside the node (part lp of L holds the node's
// sum), all-reduce that part across the nodes on a ring of the ranks at position lp, all-gather
// inside the node. Only n/L per rank crosses the network: 2(L-1)(α_in + n/L·β_in) +
// 2(M-1)(α_out + n/(LM)·β_out). Sums: each node's ring sum, then those M sums in ring order.
void two_level_all_reduce(Comm& c, const Tensor& buf) {
  std::vector<int> local, cross;
  int lp = 0, cp = 0;
  two_level_rings(c, local, lp, cross, cp);
  ring_reduce_scatter(c, local, lp, buf);
  ring_all_reduce(c, cross, cp, part(buf, int(local.size()), lp));
  ring_all_gather(c, local, lp, buf);
}

const char* op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::AllReduce: return "all_reduce";
    case CollectiveOp::ReduceScatter: return "reduce_scatter";
    case CollectiveOp::AllGather: return "all_gather";
    case CollectiveOp::Broadcast: return "broadcast";
  }
  return "?";
}

// The one line a fall-back prints, once per group and op in a process, from the group's rank 0.
void say_fallback(Comm& c, CollectiveOp op, const char* why) {
  static std::set<std::string> said;
  const std::string key = c.name() + "/" + op_name(op);
  if (c.rank() != 0 || !said.insert(key).second) return;
  fprintf(stderr, "collectives: %s on group '%s' (%d ranks) runs as ring: %s\n", op_name(op), c.name().c_str(),
          c.size(), why);
}

}  // namespace

void set_collectives(const std::string& name) {
  for (const auto& n : kNames)
    if (name == n.name) {
      g_algo = n.a;
      return;
    }
  config_error("--collectives must be %s (got '%s')", collectives_names(), name.c_str());
}
Collectives collectives() { return g_algo; }
const char* collectives_name(Collectives a) { return kNames[int(a)].name; }
const char* collectives_names() { return "library|ring|tree|halving-doubling|two-level"; }

static int delete_nodes(MPI_Comm, int, void* v, void*) {
  delete static_cast<std::vector<int>*>(v);
  return MPI_SUCCESS;
}

const std::vector<int>& nodes_of(Comm& c) {
  // Kept as an attribute of the group's communicator: MPI frees it with the communicator.
  static int key = MPI_KEYVAL_INVALID;
  if (key == MPI_KEYVAL_INVALID) MPI_CHECK(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_nodes, &key, nullptr));
  void* found = nullptr;
  int has = 0;
  MPI_CHECK(MPI_Comm_get_attr(c.mpi(), key, &found, &has));
  if (has) return *static_cast<std::vector<int>*>(found);
  MPI_Comm node = MPI_COMM_NULL;
  watched_blocking(c.mpi(), "MPI_Comm_split_type (two-level collectives: the ranks on this node)", [&] {
    MPI_CHECK(MPI_Comm_split_type(c.mpi(), MPI_COMM_TYPE_SHARED, c.rank(), MPI_INFO_NULL, &node));
  });
  int me = c.rank(), leader = 0;
  watched_allreduce(&me, &leader, 1, MPI_INT, MPI_MIN, node, "all_reduce (the lowest group rank on this node)");
  MPI_CHECK(MPI_Comm_free(&node));
  std::vector<int> leaders(size_t(c.size()));
  watched_allgather(&leader, 1, MPI_INT, leaders.data(), c.mpi(), "all_gather (the node of each group rank)");
  std::vector<int> distinct = leaders;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  auto* nodes = new std::vector<int>(leaders.size());
  for (size_t q = 0; q < leaders.size(); q++)
    (*nodes)[q] = int(std::lower_bound(distinct.begin(), distinct.end(), leaders[q]) - distinct.begin());
  MPI_CHECK(MPI_Comm_set_attr(c.mpi(), key, nodes));
  return *nodes;
}

Collectives algorithm_for(Comm& c, CollectiveOp op, Collectives a) {
  const int N = c.size();
  const bool ar = op == CollectiveOp::AllReduce;
  std::vector<int> local, cross;
  int lp = 0, cp = 0;
  switch (a) {
    case Collectives::Tree: return ar || op == CollectiveOp::Broadcast ? a : Collectives::Ring;
    case Collectives::HalvingDoubling: return op != CollectiveOp::Broadcast && (N & (N - 1)) == 0 ? a : Collectives::Ring;
    case Collectives::TwoLevel: return ar && two_level_rings(c, local, lp, cross, cp) ? a : Collectives::Ring;
    default: return a;
  }
}

// Why `a` fell back to the ring for `op` on c (algorithm_for said so).
static const char* fallback_reason(Comm& c, CollectiveOp op, Collectives a) {
  if (a == Collectives::Tree) return "the double binary tree covers all_reduce and broadcast";
  if (a == Collectives::TwoLevel && op == CollectiveOp::AllReduce) return "two-level needs as many of its ranks on every node";
  if (a == Collectives::TwoLevel) return "two-level covers all_reduce";
  if (op == CollectiveOp::Broadcast) return "halving-doubling covers all_reduce, reduce_scatter and all_gather";
  (void)c;
  return "halving-doubling needs a power-of-two group";
}

bool run_written_out(Comm& c, CollectiveOp op, const Tensor& out, const Tensor& in, ReduceOp r, int root) {
  if (g_algo == Collectives::Library || c.size() == 1) return false;
  const bool reduces = op == CollectiveOp::AllReduce || op == CollectiveOp::ReduceScatter;
  if (reduces && (r == ReduceOp::Max || (in.dtype != DType::F32 && in.dtype != DType::BF16))) return false;
  const Collectives a = algorithm_for(c, op, g_algo);
  if (a != g_algo) say_fallback(c, op, fallback_reason(c, op, g_algo));
  const std::map<std::string, OpStats> counted = c.stats();  // the entry point counted the collective
  const int N = c.size();
  const std::vector<int> ring = whole_group(c);
  if (op == CollectiveOp::AllReduce) {
    if (out.raw() != in.raw()) copy(out, in);
    const Tensor buf = out.view(0, {out.numel()});
    if (a == Collectives::Ring) ring_all_reduce(c, ring, c.rank(), buf);
    if (a == Collectives::Tree) tree_all_reduce(c, buf);
    if (a == Collectives::HalvingDoubling) halving_reduce_scatter(c, buf), doubling_all_gather(c, buf);
    if (a == Collectives::TwoLevel) two_level_all_reduce(c, buf);
  } else if (op == CollectiveOp::ReduceScatter) {
    // Summed in a copy of `in` (which the library leaves as it was, but for chunk r when in place).
    Tensor work = Tensor::empty({in.numel()}, in.dtype, in.device(), Tag::Comm);
    copy(work, in.view(0, {in.numel()}));
    if (a == Collectives::HalvingDoubling) halving_reduce_scatter(c, work);
    else ring_reduce_scatter(c, ring, c.rank(), work);
    copy(out, part(work, N, c.rank()).view(0, out.shape));
  } else if (op == CollectiveOp::AllGather) {
    const Tensor buf = out.view(0, {out.numel()}), mine = part(buf, N, c.rank());
    if (mine.raw() != in.raw()) copy(mine, in.view(0, {in.numel()}));
    if (a == Collectives::HalvingDoubling) doubling_all_gather(c, buf);
    else ring_all_gather(c, ring, c.rank(), buf);
  } else {
    const Tensor buf = out.view(0, {out.numel()});
    if (a == Collectives::Tree) tree_broadcast(c, buf, root);
    else ring_broadcast(c, buf, root);
  }
  // Avg is the sum times 1/N, as the library's MPI path divides (comm.cu's divide_host).
  if (r == ReduceOp::Avg && reduces) scale_inplace(out, 1.f / float(N));
  c.set_stats(counted);
  return true;
}

}  // namespace ts
