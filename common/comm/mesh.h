// mesh.h — the device mesh: world = dp × pp × cp × tp ranks, TP innermost.
//
//   rank = ((dp_rank·pp + pp_rank)·cp + cp_rank)·tp + tp_rank      (dp-pp-cp-tp, the default)
//   rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank      (pp-dp-cp-tp: pp_outer)
//
// TP is innermost because it communicates every layer and wants the fastest links (neighbouring
// ranks share a node); DP is outermost because it communicates once per step. With pp_outer the
// pipeline stages are outermost instead (Megatron-LM's default order, "tp-cp-ep-dp-pp" read from
// the inside): a stage's dp × cp ranks are neighbours, so the EP groups carved from them span few
// nodes, as DeepSeek-V3 places them (EP 64 on 8 nodes, PP 16 across the rest). Expert
// parallelism carves its groups out of dp × cp: the dp·cp ranks that share (pp, tp) are numbered
// j = dp_rank·cp + cp_rank and cut into consecutive blocks of ep; each block is one EP group
// (experts sharded over it), ep_rank = j mod ep. The ranks of a dp×cp group with the same ep_rank
// hold the same experts and reduce their gradients together (the ep_dp group).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace ts {

struct MeshConfig {
  int dp = 1, pp = 1, cp = 1, tp = 1, ep = 1;
  bool pp_outer = false;  // pp-dp-cp-tp: the pipeline stages outermost (above)
};
// "dp-pp-cp-tp" or "pp-dp-cp-tp": the axes from outermost to innermost.
const char* rank_order_name(const MeshConfig& c);

// The groups of a rank. DP_CP is where dense gradients are reduced (CP ranks hold different
// tokens of the same weights); EP_DP is where expert gradients are.
enum class Axis { World, DP, PP, CP, TP, EP, DP_CP, EP_DP };
constexpr int kNumAxes = 8;
const char* axis_name(Axis a);  // "world", "dp", "pp", "cp", "tp", "ep", "dp_cp", "ep_dp"

struct MeshCoords {
  int dp = 0, pp = 0, cp = 0, tp = 0, ep = 0;
};
MeshCoords mesh_coords(const MeshConfig& c, int rank);
int mesh_rank(const MeshConfig& c, int dp, int pp, int cp, int tp);
// World ranks of `rank`'s group along `a`, in group-rank order.
std::vector<int> mesh_group(const MeshConfig& c, int rank, Axis a);
// Why `c` cannot run on `world` ranks, or "" when it can.
std::string mesh_config_problem(const MeshConfig& c, int world);

struct Mesh {
  MeshConfig cfg;
  int rank = 0, world = 1;
  int dp_rank = 0, pp_rank = 0, cp_rank = 0, tp_rank = 0, ep_rank = 0;
  // CUDA tensors use NCCL when no two ranks share a GPU (host and PCI bus id compared), else MPI
  // staged through host memory; CPU tensors always use MPI. Each Comm reports its choice with
  // transport().
  Device device = Device::CPU;
  std::shared_ptr<Comm> groups[kNumAxes];

  Comm& group(Axis a) { return *groups[int(a)]; }
  Comm& world_comm() { return group(Axis::World); }
  Comm& dp() { return group(Axis::DP); }
  Comm& pp() { return group(Axis::PP); }
  Comm& cp() { return group(Axis::CP); }
  Comm& tp() { return group(Axis::TP); }
  Comm& ep() { return group(Axis::EP); }
  Comm& dp_cp() { return group(Axis::DP_CP); }
  Comm& ep_dp() { return group(Axis::EP_DP); }
};

// Validates first (every rank identically, before any collective: config_error, one message from
// rank 0, every rank exits non-zero), then builds every group. Initialises MPI if needed; on
// CUDA it also selects this rank's GPU (local rank modulo the GPUs visible). TS_NCCL=0 in the
// environment forces the staged MPI path even when NCCL could run.
Mesh make_mesh(const MeshConfig& cfg, Device dev);
// The ranks of `parent` that pass the same `color`, ordered by `key`, as one group of `size` ranks
// named `name` (`what` in a stalled call's report): an MPI communicator, and where the parent carries CUDA tensors by NCCL
// (`parent_nccl`), an NCCL communicator split from it (none for a group of one). Collective over
// the parent: every rank calls it. make_mesh builds its axes with it; a chapter that regroups an
// axis (HSDP's shard and replica groups) splits that axis's Comm the same way.
std::shared_ptr<Comm> split_group(MPI_Comm parent, void* parent_nccl, int color, int key, int size, const std::string& name,
                                  const std::string& what);

// Which node each rank of `group` runs on, in group-rank order: the ranks that MPI's shared-memory
// split (MPI_COMM_TYPE_SHARED) puts together share a node, named by their lowest world
// rank, numbered 0, 1, … in that order. Collective over the world. A cluster's nodes are its
// hosts; MPICH simulates several on one host for debugging (MPIR_CVAR_NUM_CLIQUES=n: world rank r
// goes to node r mod n, so the nodes are round-robin, not blocks of consecutive ranks).
std::vector<int> node_of_ranks(Comm& group);
// Rank 0 prints the rank-to-group table: every rank's coordinates and the ranks of each of its
// groups that has more than one, "rank 3: dp=0 pp=1 cp=0 tp=1 ep=0 | pp {1,3} tp {2,3}".
void print_mesh(const Mesh& m);

}  // namespace ts
