// mesh.cu — rank <-> coordinates, group membership, and the communicators of each group.
#include "comm/mesh.h"
#include "tensor/device.h"
#include "comm/watchdog.h"
#include "comm/fake_world.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <set>

namespace ts {

const char* axis_name(Axis a) {
  static const char* names[kNumAxes] = {"world", "dp", "pp", "cp", "tp", "ep", "dp_cp", "ep_dp"};
  return names[int(a)];
}

const char* rank_order_name(const MeshConfig& c) { return c.pp_outer ? "pp-dp-cp-tp" : "dp-pp-cp-tp"; }

int mesh_rank(const MeshConfig& c, int dp, int pp, int cp, int tp) {
  const int outer = c.pp_outer ? pp * c.dp + dp : dp * c.pp + pp;
  return (outer * c.cp + cp) * c.tp + tp;
}

MeshCoords mesh_coords(const MeshConfig& c, int rank) {
  MeshCoords m;
  m.tp = rank % c.tp;
  m.cp = rank / c.tp % c.cp;
  const int outer = rank / (c.tp * c.cp);  // dp_rank·pp + pp_rank, or pp_rank·dp + dp_rank
  m.pp = c.pp_outer ? outer / c.dp : outer % c.pp;
  m.dp = c.pp_outer ? outer % c.dp : outer / c.pp;
  m.ep = (m.dp * c.cp + m.cp) % c.ep;
  return m;
}

std::vector<int> mesh_group(const MeshConfig& c, int rank, Axis a) {
  MeshCoords m = mesh_coords(c, rank);
  std::vector<int> g;
  // j numbers the dp×cp ranks that share (pp, tp); EP blocks and EP_DP strides are ranges of j.
  auto dpcp = [&](int j) { return mesh_rank(c, j / c.cp, m.pp, j % c.cp, m.tp); };
  int j = m.dp * c.cp + m.cp, n = c.dp * c.cp;
  switch (a) {
    case Axis::World:
      for (int r = 0; r < c.dp * c.pp * c.cp * c.tp; r++) g.push_back(r);
      break;
    case Axis::DP:
      for (int i = 0; i < c.dp; i++) g.push_back(mesh_rank(c, i, m.pp, m.cp, m.tp));
      break;
    case Axis::PP:
      for (int i = 0; i < c.pp; i++) g.push_back(mesh_rank(c, m.dp, i, m.cp, m.tp));
      break;
    case Axis::CP:
      for (int i = 0; i < c.cp; i++) g.push_back(mesh_rank(c, m.dp, m.pp, i, m.tp));
      break;
    case Axis::TP:
      for (int i = 0; i < c.tp; i++) g.push_back(mesh_rank(c, m.dp, m.pp, m.cp, i));
      break;
    case Axis::DP_CP:
      for (int i = 0; i < n; i++) g.push_back(dpcp(i));
      break;
    case Axis::EP:
      for (int i = j / c.ep * c.ep; i < (j / c.ep + 1) * c.ep; i++) g.push_back(dpcp(i));
      break;
    case Axis::EP_DP:
      for (int i = j % c.ep; i < n; i += c.ep) g.push_back(dpcp(i));
      break;
  }
  return g;
}

std::string mesh_config_problem(const MeshConfig& c, int world) {
  char b[512];
  if (c.dp < 1 || c.pp < 1 || c.cp < 1 || c.tp < 1 || c.ep < 1) {
    snprintf(b, sizeof b, "every mesh degree must be at least 1 (got dp=%d pp=%d cp=%d tp=%d ep=%d)", c.dp, c.pp, c.cp,
             c.tp, c.ep);
    return b;
  }
  int prod = c.dp * c.pp * c.cp * c.tp;
  if (prod != world) {
    snprintf(b, sizeof b,
             "the mesh dp=%d x pp=%d x cp=%d x tp=%d needs %d ranks but the job has %d (launch with mpirun -np %d)", c.dp,
             c.pp, c.cp, c.tp, prod, world, prod);
    return b;
  }
  if ((c.dp * c.cp) % c.ep != 0) {
    snprintf(b, sizeof b, "ep=%d must divide dp x cp = %d: expert-parallel groups are carved out of the dp x cp ranks",
             c.ep, c.dp * c.cp);
    return b;
  }
  return "";
}

#ifdef TS_CUDA
// This rank's index among the ranks on its node.
static int local_rank() {
  MPI_Comm node = node_comm("the GPU of each rank");
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(node, &r));
  MPI_CHECK(MPI_Comm_free(&node));
  return r;
}

// NCCL refuses two ranks on one GPU, so it is used only when no two ranks share a device. A device
// is named by its host and PCI bus id, not by its index: a scheduler that gives each rank its own
// GPU through CUDA_VISIBLE_DEVICES shows every rank that GPU as device 0. Collective; TS_NCCL=0 on
// any rank means MPI for all.
static bool ranks_have_distinct_gpus(int world) {
  struct Gpu {
    char host[MPI_MAX_PROCESSOR_NAME];
    char bus_id[32];  // "0000:3b:00.0"
    int mpi_only;
  };
  Gpu mine{};
  int len = 0, dev = 0;
  MPI_CHECK(MPI_Get_processor_name(mine.host, &len));
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetPCIBusId(mine.bus_id, int(sizeof mine.bus_id), dev));
  const char* env = getenv("TS_NCCL");
  mine.mpi_only = env && env[0] == '0';
  // Fixed-size records, so one all-gather of bytes carries every rank's.
  std::vector<Gpu> all(world);
  watched_allgather(&mine, int(sizeof mine), MPI_BYTE, all.data(), MPI_COMM_WORLD, "all_gather (the GPU of each rank)");
  std::set<std::pair<std::string, std::string>> seen;
  for (const Gpu& g : all)
    if (g.mpi_only || !seen.insert({g.host, g.bus_id}).second) return false;
  return true;
}
#endif

Mesh make_mesh(const MeshConfig& cfg, Device dev) {
  if (fake_world()) return make_fake_mesh(cfg, dev);  // rank R of N, alone (comm/fake_world.h)
  comm_init(nullptr, nullptr);
  Mesh m;
  m.cfg = cfg;
  m.device = dev;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &m.rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &m.world));
  std::string problem = mesh_config_problem(cfg, m.world);
  if (!problem.empty()) config_error("%s", problem.c_str());
  MeshCoords c = mesh_coords(cfg, m.rank);
  m.dp_rank = c.dp, m.pp_rank = c.pp, m.cp_rank = c.cp, m.tp_rank = c.tp, m.ep_rank = c.ep;

#ifdef TS_CUDA
  void* nccl_world = nullptr;
  if (dev == Device::CUDA) {
    int ngpu = 0;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess) cudaGetLastError(), ngpu = 0;
    TS_CHECK(ngpu > 0, "--device cuda but rank %d sees no GPU", m.rank);
    CUDA_CHECK(cudaSetDevice(local_rank() % ngpu));
    if (m.world > 1 && ranks_have_distinct_gpus(m.world)) {
      // The unique id is NCCL's rendezvous address: rank 0 makes it, MPI carries it to all.
      ncclUniqueId id;
      if (m.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      watched_bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD, "broadcast (NCCL's unique id)");
      ncclComm_t w;
      watched_blocking(MPI_COMM_WORLD, "ncclCommInitRank (the world's NCCL communicator)",
                       [&] { NCCL_CHECK(ncclCommInitRank(&w, m.world, id, m.rank)); });
      nccl_world = w;
    }
  }
#endif
#ifndef TS_CUDA
  void* nccl_world = nullptr;
#endif
  // The world's own Comm holds a duplicate of MPI_COMM_WORLD and the world's NCCL communicator.
  m.groups[int(Axis::World)] = std::make_shared<Comm>(
      axis_name(Axis::World), watched_split(MPI_COMM_WORLD, 0, m.rank, "the mesh's 'world' groups"), nccl_world);
  for (int a = 0; a < kNumAxes; a++) {
    if (Axis(a) == Axis::World) continue;
    std::vector<int> g = mesh_group(cfg, m.rank, Axis(a));
    int key = 0;
    while (g[key] != m.rank) key++;
    // Groups partition the world, so their first member names them (the split colour).
    const std::string name = axis_name(Axis(a));
    m.groups[a] = split_group(MPI_COMM_WORLD, nccl_world, g[0], key, int(g.size()), name, "the mesh's '" + name + "' groups");
  }
  return m;
}

std::shared_ptr<Comm> split_group(MPI_Comm parent, void* parent_nccl, int color, int key, int size, const std::string& name,
                                  const std::string& what) {
  MPI_Comm mc = watched_split(parent, color, key, what);
  void* nc = nullptr;
#ifdef TS_CUDA
  if (parent_nccl) {
    // Every rank of the parent takes part in each split; groups of one get no communicator.
    ncclComm_t sub = nullptr;
    watched_blocking(parent, "ncclCommSplit (" + what + ")", [&] {
      NCCL_CHECK(ncclCommSplit(static_cast<ncclComm_t>(parent_nccl), size > 1 ? color : NCCL_SPLIT_NOCOLOR, key, &sub, nullptr));
    });
    nc = sub;
  }
#else
  (void)parent_nccl, (void)size;
#endif
  return std::make_shared<Comm>(name, mc, nc);
}

std::vector<int> node_of_ranks(Comm& group) {
  int rank = 0, world = 1, leader = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  MPI_Comm node = node_comm("the node of each rank");
  watched_allreduce(&rank, &leader, 1, MPI_INT, MPI_MIN, node, "all_reduce (the lowest world rank on this node)");
  MPI_CHECK(MPI_Comm_free(&node));
  std::vector<int> leaders(size_t(world), 0);
  watched_allgather(&leader, 1, MPI_INT, leaders.data(), MPI_COMM_WORLD, "all_gather (the node of each rank)");
  std::sort(leaders.begin(), leaders.end());
  int mine = int(std::lower_bound(leaders.begin(), std::unique(leaders.begin(), leaders.end()), leader) - leaders.begin());
  std::vector<int> nodes(size_t(group.size()), 0);
  watched_allgather(&mine, 1, MPI_INT, nodes.data(), group.mpi(), "all_gather (the node of each rank of a group)");
  return nodes;
}

void print_mesh(const Mesh& m) {
  if (m.rank != 0) return;
  const MeshConfig& c = m.cfg;
  printf("rank-to-group table: %d ranks = dp %d x pp %d x cp %d x tp %d (ep %d), tp innermost%s\n", m.world, c.dp, c.pp,
         c.cp, c.tp, c.ep, c.pp_outer ? ", pp outermost" : "");
  // A group is shown where it has more than one rank and is not another group under a new name
  // (dp_cp is dp without cp; ep_dp is dp_cp without ep).
  const bool show[kNumAxes] = {false, c.dp > 1, c.pp > 1, c.cp > 1, c.tp > 1, c.ep > 1, c.cp > 1 && c.dp > 1,
                               c.ep > 1 && c.dp * c.cp > c.ep};
  for (int r = 0; r < m.world; r++) {
    MeshCoords x = mesh_coords(c, r);
    std::string groups;
    for (int a = 1; a < kNumAxes; a++) {
      if (!show[a]) continue;
      std::string members;
      for (int g : mesh_group(c, r, Axis(a))) members += (members.empty() ? "" : ",") + std::to_string(g);
      groups += std::string(groups.empty() ? " |" : "") + " " + axis_name(Axis(a)) + " {" + members + "}";
    }
    printf("  rank %d: dp=%d pp=%d cp=%d tp=%d ep=%d%s\n", r, x.dp, x.pp, x.cp, x.tp, x.ep, groups.c_str());
  }
  fflush(stdout);
}

}  // namespace ts
