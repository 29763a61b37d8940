// fake_world.cu — one rank of an N-rank job in one process (fake_world.h): the flags, rank R's
// mesh, and the MPI calls that answer for the N − 1 ranks that are not there.
#include "comm/fake_world.h"
#include "comm/watchdog.h"
#include "tensor/shape_only.h"

#include <mpi.h>

#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace ts {

static int g_world = 0, g_rank = 0;  // g_world > 0: a fake world

bool fake_world() { return g_world > 0; }
int fake_world_size() { return g_world; }
int fake_world_rank() { return g_rank; }

void set_fake_world(int world, int rank) { g_world = world, g_rank = rank; }

// ----- the registered communicators ------------------------------------------------------------

namespace {
struct Fake {
  std::vector<int> members;  // world ranks, in group-rank order
  int rank = 0;
};
std::mutex g_mu;
std::map<MPI_Comm, Fake> g_comms;
std::map<MPI_Group, std::vector<int>> g_groups;  // MPI_Comm_group of a fake communicator: its members

const Fake* fake_of(MPI_Comm c) {
  if (g_world == 0) return nullptr;  // off: not even a lookup
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_comms.find(c);
  return it == g_comms.end() ? nullptr : &it->second;
}

MPI_Comm fake_comm(std::vector<int> members, int rank) {
  MPI_Comm c;
  PMPI_Comm_dup(MPI_COMM_SELF, &c);
  std::lock_guard<std::mutex> lk(g_mu);
  g_comms[c] = Fake{std::move(members), rank};
  return c;
}

size_t type_bytes(MPI_Datatype t) {
  int s = 0;
  PMPI_Type_size(t, &s);
  return size_t(s);
}
// A host buffer of the caller's receives this rank's contribution; a shape-only tensor nothing.
void put(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src || src == MPI_IN_PLACE || shape_only_block(dst) || shape_only_block(src)) return;
  memmove(dst, src, bytes);
}
int done(MPI_Request* r) {
  *r = MPI_REQUEST_NULL;  // MPI_Test of a null request completes at once
  return MPI_SUCCESS;
}
}  // namespace

Mesh make_fake_mesh(const MeshConfig& cfg, Device dev) {
  comm_init(nullptr, nullptr);
  Mesh m;
  m.cfg = cfg;
  m.device = dev;
  m.rank = g_rank, m.world = g_world;
  const int ranks = cfg.dp * cfg.pp * cfg.cp * cfg.tp;
  if (ranks != g_world && cfg.dp >= 1 && cfg.pp >= 1 && cfg.cp >= 1 && cfg.tp >= 1)
    config_error("--fake-world %d: the mesh dp=%d x pp=%d x cp=%d x tp=%d has %d ranks; the world must be their product",
                 g_world, cfg.dp, cfg.pp, cfg.cp, cfg.tp, ranks);
  const std::string problem = mesh_config_problem(cfg, g_world);
  if (!problem.empty()) config_error("--fake-world %d: %s", g_world, problem.c_str());
  const MeshCoords c = mesh_coords(cfg, m.rank);
  m.dp_rank = c.dp, m.pp_rank = c.pp, m.cp_rank = c.cp, m.tp_rank = c.tp, m.ep_rank = c.ep;
  for (int a = 0; a < kNumAxes; a++) {
    std::vector<int> g = mesh_group(cfg, m.rank, Axis(a));
    const int key = int(std::find(g.begin(), g.end(), m.rank) - g.begin());
    m.groups[a] = std::make_shared<Comm>(axis_name(Axis(a)), fake_comm(std::move(g), key), nullptr);
  }
  return m;
}

}  // namespace ts

// ----- MPI's profiling interface: these definitions come before libmpi's ------------------------
// Each answers for a registered communicator and hands any other to MPI (PMPI_*) unchanged.

using ts::done;
using ts::fake_of;
using ts::put;
using ts::type_bytes;

extern "C" {

int MPI_Comm_rank(MPI_Comm c, int* rank) {
  if (const auto* f = fake_of(c)) return *rank = f->rank, MPI_SUCCESS;
  return PMPI_Comm_rank(c, rank);
}
int MPI_Comm_size(MPI_Comm c, int* size) {
  if (const auto* f = fake_of(c)) return *size = int(f->members.size()), MPI_SUCCESS;
  return PMPI_Comm_size(c, size);
}
int MPI_Comm_free(MPI_Comm* c) {
  if (fake_of(*c)) {
    std::lock_guard<std::mutex> lk(ts::g_mu);
    ts::g_comms.erase(*c);
  }
  return PMPI_Comm_free(c);
}
int MPI_Comm_split(MPI_Comm c, int color, int key, MPI_Comm* out) {
  if (fake_of(c)) fatal("a fake world does not split its groups further (MPI_Comm_split of a mesh group)");
  return PMPI_Comm_split(c, color, key, out);
}
// The flight recorder names a group's members by translating its ranks into the world's.
int MPI_Comm_group(MPI_Comm c, MPI_Group* g) {
  const auto* f = fake_of(c);
  const int rc = PMPI_Comm_group(c, g);
  if (f) {
    std::lock_guard<std::mutex> lk(ts::g_mu);
    ts::g_groups[*g] = f->members;
  }
  return rc;
}
int MPI_Group_translate_ranks(MPI_Group g1, int n, const int r1[], MPI_Group g2, int r2[]) {
  if (ts::g_world > 0) {
    std::lock_guard<std::mutex> lk(ts::g_mu);
    auto it = ts::g_groups.find(g1);
    if (it != ts::g_groups.end()) {
      for (int i = 0; i < n; i++) r2[i] = it->second[size_t(r1[i])];
      return MPI_SUCCESS;
    }
  }
  return PMPI_Group_translate_ranks(g1, n, r1, g2, r2);
}
int MPI_Group_free(MPI_Group* g) {
  if (ts::g_world > 0) {
    std::lock_guard<std::mutex> lk(ts::g_mu);
    ts::g_groups.erase(*g);
  }
  return PMPI_Group_free(g);
}

// Collectives: every rank sent what this one sent (an all-reduce's MIN or MAX of it is itself).
int MPI_Iallreduce(const void* in, void* out, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c, MPI_Request* r) {
  if (!fake_of(c)) return PMPI_Iallreduce(in, out, n, t, op, c, r);
  put(out, in, size_t(n) * type_bytes(t));
  return done(r);
}
int MPI_Ireduce_scatter_block(const void* in, void* out, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c, MPI_Request* r) {
  const auto* f = fake_of(c);
  if (!f) return PMPI_Ireduce_scatter_block(in, out, n, t, op, c, r);
  if (in != MPI_IN_PLACE) put(out, static_cast<const char*>(in) + size_t(f->rank) * n * type_bytes(t), n * type_bytes(t));
  return done(r);
}
int MPI_Iallgather(const void* in, int n, MPI_Datatype t, void* out, int rn, MPI_Datatype rt, MPI_Comm c,
                   MPI_Request* r) {
  const auto* f = fake_of(c);
  if (!f) return PMPI_Iallgather(in, n, t, out, rn, rt, c, r);
  const size_t chunk = size_t(rn) * type_bytes(rt);
  const void* mine = in == MPI_IN_PLACE ? static_cast<char*>(out) + f->rank * chunk : in;
  for (size_t i = 0; i < f->members.size(); i++) put(static_cast<char*>(out) + i * chunk, mine, chunk);
  return done(r);
}
int MPI_Igather(const void* in, int n, MPI_Datatype t, void* out, int rn, MPI_Datatype rt, int root, MPI_Comm c,
                MPI_Request* r) {
  const auto* f = fake_of(c);
  if (!f) return PMPI_Igather(in, n, t, out, rn, rt, root, c, r);
  if (f->rank == root)
    for (size_t i = 0; i < f->members.size(); i++) put(static_cast<char*>(out) + i * rn * type_bytes(rt), in, rn * type_bytes(rt));
  return done(r);
}
int MPI_Igatherv(const void* in, int n, MPI_Datatype t, void* out, const int counts[], const int displs[],
                 MPI_Datatype rt, int root, MPI_Comm c, MPI_Request* r) {
  const auto* f = fake_of(c);
  if (!f) return PMPI_Igatherv(in, n, t, out, counts, displs, rt, root, c, r);
  if (f->rank == root) put(static_cast<char*>(out) + displs[root] * type_bytes(rt), in, counts[root] * type_bytes(rt));
  return done(r);
}
int MPI_Ibcast(void* buf, int n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* r) {
  if (!fake_of(c)) return PMPI_Ibcast(buf, n, t, root, c, r);
  return done(r);
}
int MPI_Ibarrier(MPI_Comm c, MPI_Request* r) {
  if (!fake_of(c)) return PMPI_Ibarrier(c, r);
  return done(r);
}
int MPI_Ialltoallv(const void* in, const int sc[], const int sd[], MPI_Datatype st, void* out, const int rc[],
                   const int rd[], MPI_Datatype rt, MPI_Comm c, MPI_Request* r) {
  const auto* f = fake_of(c);
  if (!f) return PMPI_Ialltoallv(in, sc, sd, st, out, rc, rd, rt, c, r);
  // Every peer sends this rank what it sends itself. Int32 chunks are the counts an all-to-all_v
  // exchanges first (07's dispatch), copied even in a shape-only tensor: a shape-only run routes
  // every rank alike (balanced, model/moe.cu), so they size the rows that arrive as in the real job.
  const int me = f->rank;
  const char* mine = static_cast<const char*>(in) + sd[me] * type_bytes(st);
  for (size_t p = 0; p < f->members.size(); p++) {
    char* dst = static_cast<char*>(out) + rd[p] * type_bytes(rt);
    const size_t bytes = std::min(size_t(sc[me]) * type_bytes(st), size_t(rc[p]) * type_bytes(rt));
    if (st == MPI_INT && dst != mine) memmove(dst, mine, bytes);
    else put(dst, mine, bytes);
  }
  return done(r);
}
// Point to point: the peer is not there; a message completes as soon as it is posted.
int MPI_Isend(const void* buf, int n, MPI_Datatype t, int dst, int tag, MPI_Comm c, MPI_Request* r) {
  if (!fake_of(c)) return PMPI_Isend(buf, n, t, dst, tag, c, r);
  return done(r);
}
int MPI_Irecv(void* buf, int n, MPI_Datatype t, int src, int tag, MPI_Comm c, MPI_Request* r) {
  if (!fake_of(c)) return PMPI_Irecv(buf, n, t, src, tag, c, r);
  return done(r);
}

}  // extern "C"
